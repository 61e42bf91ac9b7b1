"""Where KV is: each prefill instance's prefix cache, the events it publishes, and what a router
knows of it — learned from those events (:class:`EventView`) or read from the caches themselves
(:class:`GlobalView`, the simulator's global knowledge, for comparison).

A cache holds full blocks of ``block_tokens`` tokens of a session's context (full-attention
KV; vLLM caches only full blocks) and, for a hybrid model, the fixed-size state at a block
boundary (linear-attention states, or a window's last tokens): a hybrid prefix is usable only up
to a boundary whose state is held with every block before it. LRU by bytes; a stored context's
state is touched first and its blocks from the last to the first, so its tail leaves first
(vLLM frees a request's blocks in reverse order for the same reason). Every store and eviction
is published as one :class:`kvstore.events.records.KVEventBatch` (vLLM's wire format:
``BlockStored`` / ``BlockRemoved``; group 0 the full-attention blocks, group 1 the states,
medium ``CPU``, the instance's host-memory prefix cache), msgpack-encoded, and delivered to the
router ``delay_s`` later. The simulation has token counts, not token ids: ``token_ids`` is
empty. Block hashes are ``key * 2**24 + block`` (a session's blocks chain within it).

The router's index maps each (group, block hash) to the set of instances that announced it,
bounded to ``max_entries`` entries (least recently announced forgotten first): events cost
memory, and a forgotten block reads as held nowhere.

Thread-safety: none (one simulation's thread).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from kvstore.events.records import (
    MEDIUM_CPU,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    batch_decoder,
    batch_encoder,
)

BLOCK_BITS = 24  # blocks per session key at most 2**24
KV_GROUP, STATE_GROUP = 0, 1


def block_hash(key: int, block: int) -> int:
    """The external hash of block ``block`` (0-based) of session ``key``."""
    return (key << BLOCK_BITS) | block


class InstanceCache:
    """One prefill instance's prefix cache (see the module docstring)."""

    def __init__(self, index: int, *, capacity_bytes: int, block_tokens: int,
                 block_bytes: int, state_bytes: Callable[[int], int] | None,
                 state_kind: str | None = None, window: int | None = None,
                 publish: Callable[[int, float, list], None] | None = None) -> None:
        if capacity_bytes < 0 or block_tokens <= 0 or block_bytes <= 0:
            raise ValueError(f"capacity_bytes >= 0, block_tokens and block_bytes > 0 needed, "
                             f"got {capacity_bytes}, {block_tokens}, {block_bytes}")
        self.index = index
        self.capacity = capacity_bytes
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self.state_bytes = state_bytes  # None: a dense model (no states)
        self.state_kind, self.window = state_kind, window
        self.publish = publish
        self.used = 0
        self.evicted_bytes = 0
        self._lru: OrderedDict[tuple[int, int], int] = OrderedDict()  # (group, hash) -> bytes

    def usable(self, key: int, limit: int) -> int:
        """Tokens of session ``key``'s context this cache can serve, at most ``limit``."""
        lru, b = self._lru, self.block_tokens
        best = 0
        base = key << BLOCK_BITS
        for j in range(limit // b):
            h = base | j
            if (KV_GROUP, h) not in lru:
                break
            if self.state_bytes is None or (STATE_GROUP, h) in lru:
                best = (j + 1) * b
        return best

    def held_blocks(self, key: int, limit: int) -> int:
        """Tokens of full-attention KV of ``key`` held from the start (states aside)."""
        lru, b = self._lru, self.block_tokens
        n, top, base = 0, limit // b, key << BLOCK_BITS
        while n < top and (KV_GROUP, base | n) in lru:
            n += 1
        return n * b

    def has_state(self, key: int, tokens: int) -> bool:
        """Whether the state at ``tokens`` (a block boundary) of ``key`` is held."""
        n = tokens // self.block_tokens
        return n > 0 and (STATE_GROUP, block_hash(key, n - 1)) in self._lru

    def touch(self, key: int, tokens: int) -> None:
        """The first ``tokens`` of ``key`` were read: most recently used."""
        lru = self._lru
        n = tokens // self.block_tokens
        if n and self.state_bytes is not None:
            s = (STATE_GROUP, block_hash(key, n - 1))
            if s in lru:
                lru.move_to_end(s)
        base = key << BLOCK_BITS
        for j in range(n - 1, -1, -1):
            k = (KV_GROUP, base | j)
            if k in lru:
                lru.move_to_end(k)

    def store(self, key: int, tokens: int, boundaries: tuple[int, ...], now: float) -> None:
        """Keep the full blocks of the first ``tokens`` of ``key`` and (hybrid) the states at
        ``boundaries`` (token positions; rounded down to a block). What does not fit after
        evicting everything older is not kept."""
        b, lru = self.block_tokens, self._lru
        n = tokens // b
        stored: list[tuple[int, int]] = []
        if self.state_bytes is not None:
            for pos in sorted({p // b for p in boundaries if b <= p <= tokens}):
                k = (STATE_GROUP, block_hash(key, pos - 1))
                if self._put(k, self.state_bytes(pos * b)):
                    stored.append(k)
        base, nbytes = key << BLOCK_BITS, self.block_bytes
        for j in range(n - 1, -1, -1):
            k = (KV_GROUP, base | j)
            if k in lru:
                lru.move_to_end(k)
            elif self._put(k, nbytes):
                stored.append(k)
        removed = self._make_room()
        if self.publish is not None and (stored or removed):
            self.publish(self.index, now, self._events(key, stored, removed))

    def _put(self, k: tuple[int, int], nbytes: int) -> bool:
        """Add or refresh ``k``; True if it is new."""
        if k in self._lru:
            self._lru.move_to_end(k)
            return False
        if nbytes > self.capacity:
            return False
        self._lru[k] = nbytes
        self.used += nbytes
        return True

    def _make_room(self) -> list[tuple[int, int]]:
        removed = []
        while self.used > self.capacity:
            k, nbytes = self._lru.popitem(last=False)
            self.used -= nbytes
            self.evicted_bytes += nbytes
            removed.append(k)
        return removed

    def _events(self, key: int, stored: list[tuple[int, int]],
                removed: list[tuple[int, int]]) -> list:
        lru = self._lru
        if removed:  # stored, then evicted at once: never announced
            new_now = set(stored)
            stored = [k for k in stored if k in lru]
            removed = [k for k in removed if k not in new_now]
        events: list = []
        for group in (KV_GROUP, STATE_GROUP):
            new = sorted(h for g, h in stored if g == group)
            kind = "full_attention" if group == KV_GROUP else self.state_kind
            for run in _runs(new):  # one event per run of consecutive (chained) blocks
                parent = run[0] - 1 if run[0] & ((1 << BLOCK_BITS) - 1) else None
                events.append(BlockStored(
                    block_hashes=run, parent_block_hash=parent, token_ids=[],
                    block_size=self.block_tokens, lora_id=None, medium=MEDIUM_CPU,
                    lora_name=None, group_idx=group, kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=self.window if kind == "sliding_window"
                    else None))
            old = [h for g, h in removed if g == group]
            if old:
                events.append(BlockRemoved(block_hashes=old, medium=MEDIUM_CPU,
                                           group_idx=group))
        return events


def _runs(hashes: list[int]) -> list[list[int]]:
    """Sorted hashes split into runs of consecutive ones."""
    runs: list[list[int]] = []
    for h in hashes:
        if runs and runs[-1][-1] == h - 1:
            runs[-1].append(h)
        else:
            runs.append([h])
    return runs


class EventView:
    """The router's index of where blocks are, built only from the instances' event batches,
    each delivered ``delay_s`` after it was published (see the module docstring)."""

    def __init__(self, *, hybrid: bool, block_tokens: int, delay_s: float = 0.0,
                 max_entries: int = 1 << 22) -> None:
        if delay_s < 0 or max_entries < 1:
            raise ValueError(f"delay_s must be >= 0 and max_entries >= 1, got {delay_s}, "
                             f"{max_entries}")
        self.hybrid, self.block_tokens = hybrid, block_tokens
        self.delay_s, self.max_entries = delay_s, max_entries
        self._holders: OrderedDict[tuple[int, int], int] = OrderedDict()  # -> instance bits
        self._inbox: deque[tuple[float, int, bytes]] = deque()
        self._enc, self._dec = batch_encoder(), batch_decoder()
        self.batches = self.events = self.forgotten = 0
        self.peak_entries = 0
        self.peak_inbox_bytes = self._inbox_bytes = 0
        self.wire_bytes = 0

    def publish(self, instance: int, now: float, events: list) -> None:
        """An instance's batch, sent at ``now`` (the caches' ``publish``)."""
        payload = self._enc.encode(KVEventBatch(ts=float(now), events=events))
        self._inbox.append((now + self.delay_s, instance, payload))
        self._inbox_bytes += len(payload)
        self.wire_bytes += len(payload)
        self.peak_inbox_bytes = max(self.peak_inbox_bytes, self._inbox_bytes)

    def sync(self, now: float) -> None:
        """Apply every batch delivered by ``now``, in the order they were sent."""
        inbox = self._inbox
        while inbox and inbox[0][0] <= now:
            _, instance, payload = inbox.popleft()
            self._inbox_bytes -= len(payload)
            self.apply(instance, self._dec.decode(payload))

    def apply(self, instance: int, batch: KVEventBatch) -> None:
        holders, bit = self._holders, 1 << instance
        self.batches += 1
        for ev in batch.events:
            self.events += 1
            if isinstance(ev, BlockStored):
                g = ev.group_idx or 0
                for h in ev.block_hashes:
                    k = (g, h)
                    holders[k] = holders.get(k, 0) | bit
                    holders.move_to_end(k)
            elif isinstance(ev, BlockRemoved):
                g = ev.group_idx or 0
                for h in ev.block_hashes:
                    k = (g, h)
                    m = holders.get(k, 0) & ~bit
                    if m:
                        holders[k] = m
                    else:
                        holders.pop(k, None)
            else:  # AllBlocksCleared
                for k in [k for k, m in holders.items() if m & bit]:
                    m = holders[k] & ~bit
                    if m:
                        holders[k] = m
                    else:
                        del holders[k]
        while len(holders) > self.max_entries:
            holders.popitem(last=False)
            self.forgotten += 1
        self.peak_entries = max(self.peak_entries, len(holders))

    def usable(self, key: int, limit: int, instances: int) -> list[int]:
        """Per instance, the tokens of ``key`` the router believes it can serve (at most
        ``limit``)."""
        holders, b = self._holders, self.block_tokens
        best = [0] * instances
        mask = (1 << instances) - 1
        base = key << BLOCK_BITS
        for j in range(limit // b):
            h = base | j
            mask &= holders.get((KV_GROUP, h), 0)
            if not mask:
                break
            ok = mask & holders.get((STATE_GROUP, h), 0) if self.hybrid else mask
            i = 0
            while ok:
                if ok & 1:
                    best[i] = (j + 1) * b
                ok >>= 1
                i += 1
        return best

    def stats(self) -> dict[str, int]:
        return {"batches": self.batches, "events": self.events, "entries": len(self._holders),
                "peak_entries": self.peak_entries, "max_entries": self.max_entries,
                "forgotten": self.forgotten, "wire_bytes": self.wire_bytes,
                "peak_inbox_bytes": self.peak_inbox_bytes}


class GlobalView:
    """The simulator's global knowledge: what every cache holds now."""

    def __init__(self, caches: list[InstanceCache]) -> None:
        self.caches = caches

    def sync(self, now: float) -> None:
        """Nothing to learn: the caches are read directly."""

    def usable(self, key: int, limit: int, instances: int) -> list[int]:
        return [c.usable(key, limit) for c in self.caches[:instances]]

    def stats(self) -> dict[str, int]:
        return {}
