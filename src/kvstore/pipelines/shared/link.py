"""What a store does with a shared tier of chunk values (Redis, an object store): read-through,
write-through, prefetch, stats. The tier itself answers :class:`ChunkServer`'s calls
(:class:`kvstore.tiers.remote.tier.RemoteTier` with pipelined commands,
:class:`kvstore.tiers.objects.tier.ObjectTier` with parallel ranged requests); the link is the
same for both. Below, a round trip is one call of the tier (Redis names the commands it
sends; the object tier sends requests in parallel, bounded by the same deadline).

* ``match``: after the local prefix (its full chunks), the chain addresses of the rest of the
  tokens are looked up in one pipelined round trip (headers only, verified); the remote
  prefix counts only if fetching it is estimated to end sooner than recomputing it at the
  caller's prefill rate (:mod:`kvstore.tiers.shared.estimate`).
* ``get``: the local full-chunk prefix comes from the local tiers, the rest in one pipelined
  ``GET`` round trip, every byte verified; then (``fill="disk"``) the fetched context is saved
  locally in the background (DRAM and disk), without sending it back to Redis.
* ``load_layers``: the same, layer by layer with ``GETRANGE``, in round trips of 1, 2, 4, 8,
  ... layers, so the first layers arrive first.
* write-through: each put queues its chunks; a worker thread sends those Redis lacks
  (``EXISTS``, then ``SET NX``, and each chunk's entry in its parent's kids set, so that a
  prompt whose chunk there is a prefix of it finds it), reading them from the local tiers when
  it gets to them; then a hybrid boundary's mark (:mod:`.boundaries`).
* a load right after a match starts from what the match found (:mod:`.found`).
* prefetch: the scheduler's next jobs whose prompts Redis serves further than the local tiers
  are fetched (and filled) by a worker thread.

A remote failure never raises from ``match``/``get``: the chunk is a miss (a ``get`` of tokens
that only the remote could have served raises ``KeyError`` like any miss), and it is counted in
``stats()["remote"]``. Each public call's remote round trips end by one deadline
(``RemoteConfig.deadline_s``, :mod:`kvstore.tiers.shared.deadline`): what has not arrived by
then is a miss too. Local eviction never deletes a remote copy; ``Store.delete`` does
(:meth:`RemoteLink.delete`: ``DEL``, and ``SREM`` of the chunk's kids entry).

Thread-safety: every method may be called from any thread at once; no method holds the store's
metadata lock during a remote call.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvstore.codecs import layer_codec
from kvstore.errors import StoreClosed
from kvstore.eviction.jobs import Job
from kvstore.format import chunk_extent
from kvstore.format.boundary_state import STATE
from kvstore.format.hashing import chunk_hash
from kvstore.format.records import ChunkRecord
from kvstore.pipelines.gather import gather
from kvstore.pipelines.shared.addressing import Chunk, best_kid
from kvstore.pipelines.shared.boundaries import Boundaries
from kvstore.pipelines.shared.found import Found
from kvstore.pipelines.shared.loads import LayerLoads
from kvstore.pipelines.shared.local import LocalTiers
from kvstore.residency.core import Core
from kvstore.threads.background import Worker
from kvstore.threads.fork_join import copy_all
from kvstore.tiers.codecs import remote_value_codec
from kvstore.tiers.shared import value as rv
from kvstore.tiers.shared.chunk_server import ChunkServer
from kvstore.tiers.shared.estimate import worth_fetching
from kvstore.tiers.shared.marks import Mark
from kvstore.view.prefix_tree import Piece, served

RECENT = 4096  # keys fetched from remote, remembered so that filling them does not send them back


@dataclass(slots=True)
class LinkCounters:
    matches: int = 0  # matches that consulted the remote tier
    matched_tokens: int = 0  # tokens matches found remotely beyond the local prefix
    declined_tokens: int = 0  # ... of which fetching was estimated not to pay
    gets: int = 0  # gets (and layer-wise loads) served partly from remote
    served_tokens: int = 0
    misses: int = 0  # gets the remote could not complete
    filled: int = 0  # fetched contexts saved locally
    fill_refused: int = 0  # ... not saved: the eviction policy's admission refused them
    fill_skipped: int = 0  # ... not saved: the write buffer was full
    fill_failed: int = 0
    prefetched: int = 0  # jobs whose KV the prefetcher fetched from remote
    queued_writes: int = 0  # chunks queued for write-through
    lossy_served_tokens: int = 0  # tokens served from values stored through a lossy codec
    fill_skipped_lossy: int = 0  # fetched contexts not saved locally: a lossy value served them
    coded_writes: int = 0  # chunks written through the remote codec (not "none")
    raw_fallback_writes: int = 0  # chunks the remote codec could not take, written raw
    lossy_source_writes: int = 0  # chunks stored lossily here, sent through their own codec
    deleted_chunks: int = 0  # values Store.delete removed from the tier
    delete_failed: int = 0  # ... it could not remove (the tier did not answer)


class RemoteLink(LayerLoads):
    """A tier of chunk values (:class:`ChunkServer`) as a
    :class:`~kvstore.pipelines.shared.tiers.SharedTier` of a store, named ``name`` in its
    ``stats()`` (``"remote"``: Redis; ``"objects"``: an object store)."""

    def __init__(self, core: Core, tier: ChunkServer, *, name: str, local: LocalTiers) -> None:
        self.core = core
        self.tier = tier
        self.name = name
        self.local = local  # this machine's tiers: reads, write-through's chunks, fills
        self.last_fill_error = ""
        if hasattr(tier, "on_swept"):  # an object tier: what its sweep deletes, for KV events
            tier.on_swept = self._swept
        self._lock = threading.Lock()
        self.counters = LinkCounters()
        self.prefill_rate: float | None = None
        self._recent: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        # chain keys of chunks recently served from lossy values (for lossy_tokens; no IO)
        self._lossy: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        # a hybrid layout's boundary states: their marks, lookups, states (no thread)
        self.boundaries = Boundaries(core, tier, lambda: self.prefill_rate)
        self.found = Found()  # what matches found, for the loads that follow them
        # chunks to write through (key, None), and boundary marks after them (key, the mark)
        self._writes: Worker[tuple[bytes, tuple[bytes, Mark] | None]] = Worker(
            self._write_batch, name=f"kvstore-{name}-write", batch=16,
            max_items=tier.cfg.max_queued_chunks, key=lambda it: (it[0], it[1] is None))
        self._fills: Worker[tuple[np.ndarray, str | None, torch.Tensor, torch.Tensor]] = Worker(
            self._fill_batch, name=f"kvstore-{name}-fill", batch=1, max_items=4,
            key=lambda it: (it[1], it[0].tobytes()))
        self._prefetches: Worker[Job] = Worker(
            self._prefetch_batch, name=f"kvstore-{name}-prefetch", batch=1, max_items=256,
            key=lambda j: (j.namespace, j.tokens.tobytes()))

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.counters, name, getattr(self.counters, name) + n)

    # ------------------------------------------------------------------ addressing
    def _rest(self, toks: np.ndarray, namespace: str | None,
              pieces: list[Piece]) -> tuple[int, list[Chunk]]:
        """The local full-chunk prefix length and the chunks of the remaining tokens."""
        c = self.core.config.chunk_tokens
        full = 0
        for p in pieces:
            if p.use != c or p.rec.n_tokens != c:
                break
            full += 1
        parent = pieces[full - 1].rec.key if full else self.core.seed(namespace)
        out = []
        for start in range(full * c, len(toks), c):
            part = toks[start:start + c]
            key = chunk_hash(parent, part)
            out.append(Chunk(key, start, part, parent))
            parent = key
        return full * c, out

    def _local(self, toks: np.ndarray, namespace: str | None) -> list[Piece]:
        return self.core.lookup(toks, namespace)

    # ------------------------------------------------------------------ match
    def match(self, toks: np.ndarray, namespace: str | None, pieces: list[Piece], *,
              exact: bool = False) -> int:
        """How many leading tokens the local tiers and the remote tier together serve, of
        which the remote part only if fetching it pays (``exact``: up to the first value a
        lossy codec encoded; a stored chunk the prompt's last chunk is a prefix of counts
        after its header says it is not lossy: one more round trip)."""
        local = served(pieces)
        if local == len(toks):
            return local
        base, rest = self._rest(toks, namespace, pieces)
        if base + sum(len(ch.tokens) for ch in rest) <= local:
            return local
        with self.tier.deadline():
            return self._match_remote(local, base, rest, exact)

    def _match_remote(self, local: int, base: int, rest: list[Chunk], exact: bool) -> int:
        headers, kids = self.tier.headers_and_kids([(ch.key, ch.tokens) for ch in rest],
                                                   [(ch.parent, ch.tokens) for ch in rest])
        self._count("matches")
        self.found.note_headers([(ch.key, h) for ch, h in zip(rest, headers, strict=True)
                                 if h is not None])
        options: list[tuple[int, int]] = []
        end, nbytes = base, 0
        found: list[tuple[bytes, rv.Header]] = []
        for ch, h, ks in zip(rest, headers, kids, strict=True):
            if exact and h is not None and h.lossy:
                break
            if h is None:  # a stored chunk may still share a prefix with the rest
                ks = [(k, t) for k, t in ks if k != ch.key]  # not the one that is missing
                self.found.note_kids(ch.parent, ks)
                kid = best_kid(ks, ch.tokens)
                if kid is not None and exact:  # served only if its value is not lossy
                    kh = self.tier.headers([(kid[0], kid[1])])[0]
                    self.found.note_headers([(kid[0], kh)] if kh is not None else [])
                    kid = None if kh is None or kh.lossy else kid
                if kid is not None and end + kid[2] > local:
                    end += kid[2]
                    nbytes += len(kid[1]) * self.core.layout.token_bytes
                    options.append((end - local, nbytes))
                break
            found.append((ch.key, h))
            end += len(ch.tokens)
            nbytes += h.value_bytes
            if end > local:
                options.append((end - local, nbytes))
        if not options:
            return local
        if self.prefill_rate is not None and self.tier.estimate.needs_probe() and found:
            self.tier.probe(found)
        pick = worth_fetching(self.tier.estimate, options, self.prefill_rate)
        n = local + (options[pick][0] if pick >= 0 else 0)
        self._count("matched_tokens", options[-1][0])
        self._count("declined_tokens", options[-1][0] - (n - local))
        return n

    # ------------------------------------------------------------------ get
    def get(self, toks: np.ndarray, namespace: str | None,
            out: tuple[torch.Tensor, torch.Tensor] | None,
            device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of all of ``toks`` from the local full-chunk prefix and the remote tier;
        KeyError (a miss) if the remote tier cannot serve the rest."""
        local = self._local(toks, namespace)
        base, rest = self._rest(toks, namespace, local)
        items = self._items(rest)
        with self.tier.deadline():
            exts = self.tier.values_and_headers(items)
            pieces = [(np.asarray(e[0]), len(it[1]), ch.start, len(ch.tokens))
                      for ch, it, e in zip(rest, items, exts, strict=True) if e is not None]
            if exts and exts[-1] is None and all(e is not None for e in exts[:-1]):
                kid = self._kid_extent(rest[-1])  # the tail inside a longer partial chunk
                if kid is not None:
                    exts[-1] = (kid[0], kid[2])
                    pieces.append((np.asarray(kid[0]), kid[1], rest[-1].start,
                                   len(rest[-1].tokens)))
        missing = sum(e is None for e in exts)
        if missing:
            self._count("misses")
            raise KeyError(f"only the first {base} of the {len(toks)} tokens are stored "
                           f"locally, and {missing} of the {len(rest)} remaining chunks are "
                           f"not usable in the remote tier: a miss")
        lay = self.core.layout
        if out is not None and out[0].device.type == "cpu":
            k_out, v_out = out
        else:
            k_out, v_out = self.core.buffers.kv(lay, len(toks))
        if base:
            self.local.read_into(toks[:base], namespace, (k_out, v_out))
        gather(lay, chunk_extent.raw(k_out), chunk_extent.raw(v_out), pieces, self.core.helpers)
        self._remember([k for k, _ in items])
        self._count("gets")
        self._count("served_tokens", len(toks) - base)
        lossy = self._served_lossy(local, base, rest, [e[1] for e in exts])  # type: ignore[index]
        if lossy:  # a local copy would lose the lossy mark (the local tiers store raw KV)
            self._count("fill_skipped_lossy")
        else:
            self._fill_local(toks, namespace, k_out, v_out)
        if out is not None and out[0].device.type != "cpu":
            out[0].copy_(k_out)
            out[1].copy_(v_out)
            return out
        if device is not None and device.type != "cpu":
            return k_out.to(device), v_out.to(device)
        return k_out, v_out

    def _items(self, rest: list[Chunk]) -> list[tuple[bytes, np.ndarray]]:
        """(key, tokens) of the values that hold ``rest``: each chunk's own, but a hybrid
        layout's partial last chunk, which the chunk of a boundary stored after it holds."""
        items = [(ch.key, ch.tokens) for ch in rest]
        if not rest:
            return items
        ch, c = rest[-1], self.core.config.chunk_tokens
        tail = self.boundaries.tail(ch.parent, ch.tokens)
        if tail is None and len(ch.tokens) < c and self.found.header(ch.key) is None:
            tail = self.found.kid(ch.parent, ch.tokens)  # the stored chunk a match found
        if tail is not None:
            items[-1] = tail
        return items

    def _kid(self, ch: Chunk) -> tuple[bytes, np.ndarray] | None:
        """A stored chunk after ``ch.parent`` that starts with all of ``ch.tokens`` (one a
        match found, else one round trip)."""
        got = self.found.kid(ch.parent, ch.tokens)
        if got is not None:
            return got
        kids = self.tier.kids([(ch.parent, ch.tokens)])[0]
        self.found.note_kids(ch.parent, kids)
        kid = best_kid(kids, ch.tokens)
        if kid is None or kid[2] < len(ch.tokens):
            return None
        return kid[0], kid[1]

    def block_end(self, toks: np.ndarray, namespace: str | None, end: int) -> np.ndarray:
        """``toks`` continued to ``end`` as the stored chunk holding their last token goes on
        (a load into pages fills its last block whole): for a hybrid layout the chunk of a
        boundary after them (STATE), else the stored chunk the tail is a prefix of. KeyError if
        this tier holds none that reaches ``end``."""
        _, rest = self._rest(toks, namespace, self._local(toks, namespace))
        if not rest:
            raise KeyError("the last block of the load is stored locally")
        if self.core.layout.boundary_state:
            return np.concatenate([toks, np.full(end - len(toks), STATE, dtype=toks.dtype)])
        ch = rest[-1]
        with self.tier.deadline():
            kid = self._kid(ch)
        if kid is None or ch.start + len(kid[1]) < end:
            raise KeyError(f"the shared tier holds no chunk that fills the load's last block "
                           f"(to {end})")
        return np.concatenate([toks[:ch.start], kid[1][:end - ch.start]]).astype(toks.dtype)

    def _kid_extent(self, ch: Chunk) -> tuple[np.ndarray, int, rv.Header] | None:
        """(verified extent, its tokens, its header) of :meth:`_kid`; two more round
        trips."""
        kid = self._kid(ch)
        if kid is None:
            return None
        got = self.tier.values_and_headers([kid])[0]
        return None if got is None else (got[0], len(kid[1]), got[1])

    def _served_lossy(self, local: list[Piece], base: int, rest: list[Chunk],
                      headers: list[rv.Header]) -> int:
        """Count a get or load whose remote part was served (partly) by lossy values, in
        the store's counters as a local lossy read is; the tokens they served."""
        n = sum(len(ch.tokens) for ch, h in zip(rest, headers, strict=True) if h.lossy)
        if not n:
            return 0
        self._count("lossy_served_tokens", n)
        with self._lock:
            for ch, h in zip(rest, headers, strict=True):
                if h.lossy:
                    self._lossy[ch.key] = None
                    self._lossy.move_to_end(ch.key)
            while len(self._lossy) > RECENT:
                self._lossy.popitem(last=False)
        local_lossy = sum(min(p.use, max(0, base - p.start)) for p in local
                          if layer_codec.NAMES[p.rec.codec] in layer_codec.LOSSY)
        # a get whose local part was lossy is counted once already
        self.core.count(lossy_gets=0 if local_lossy else 1, lossy_tokens_served=n)
        return n

    def lossy_tokens(self, toks: np.ndarray, namespace: str | None, pieces: list[Piece]) -> int:
        """Tokens after the local full-chunk prefix that values of a lossy codec served to a
        recent get or load of this context (remembered, no IO)."""
        _, rest = self._rest(toks, namespace, pieces)
        with self._lock:
            return sum(len(ch.tokens) for ch in rest if ch.key in self._lossy)

    def _fill_local(self, toks: np.ndarray, namespace: str | None, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        """Queue a copy of a fetched context to be stored locally (skipped, and counted, when
        four are queued already: memory stays bounded and the get never waits)."""
        if self.tier.cfg.fill == "none" or self.core.readonly:
            return
        at = np.flatnonzero(toks == STATE)  # a boundary's block end: its KV only
        if len(at):
            toks, k, v = toks[:at[0]], k[:, :, :at[0]], v[:, :, :at[0]]
        kc, vc = self.core.buffers.kv(self.core.layout, len(toks))
        copy_all(self.core.helpers, [(chunk_extent.raw(kc), chunk_extent.raw(k)),
                                     (chunk_extent.raw(vc), chunk_extent.raw(v))])
        if not self._fills.offer((toks.copy(), namespace, kc, vc)):
            self._count("fill_skipped")

    def _fill_batch(self, batch: list[tuple[np.ndarray, str | None, torch.Tensor,
                                            torch.Tensor]]) -> None:
        for toks, ns, k, v in batch:
            try:
                stored = self.local.fill(toks, ns, chunk_extent.raw(k), chunk_extent.raw(v))
            except StoreClosed:
                return
            except Exception as e:  # counted and shown in stats(); the get had its data
                self._count("fill_failed")
                with self._lock:
                    self.last_fill_error = f"{type(e).__name__}: {e}"[:300]
                continue
            self._count("filled" if stored else "fill_refused")

    def _remember(self, keys: list[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._recent[k] = None
                self._recent.move_to_end(k)
            while len(self._recent) > RECENT:
                self._recent.popitem(last=False)

    # ------------------------------------------------------------------ write-through
    def after_put(self, toks: np.ndarray, namespace: str | None) -> None:
        """Queue the chunks of a stored context for write-through (waits if the queue is
        full), then, for a boundary state's context, its mark (:mod:`.boundaries`).
        Chunks just fetched from remote are not sent back."""
        if not self.tier.cfg.write_through:
            return
        c = self.core.config.chunk_tokens
        parent = self.core.seed(namespace)
        items: list[tuple[bytes, tuple[bytes, Mark] | None]] = []
        with self._lock:
            recent = self._recent
            for start in range(0, len(toks), c):
                key = chunk_hash(parent, toks[start:start + c])
                if key not in recent:
                    items.append((key, None))
                parent = key
        mark = self.boundaries.mark_of(toks, namespace)
        if mark is not None and any(k == mark[1].key for k, _ in items):  # its chunk goes
            items.append((mark[1].key, mark))
        n = self._writes.submit(items)
        self._count("queued_writes", n - (mark is not None and items[-1][1] is mark))

    def _write_batch(self, batch: list[tuple[bytes, tuple[bytes, Mark] | None]]) -> None:
        tier = self.tier
        keys = [k for k, m in batch if m is None]
        with tier.deadline():
            there = tier.exists(keys) if keys else []
        send: list[tuple[bytes, bytes]] = []
        kids: list[tuple[bytes, bytes, np.ndarray]] = []
        recs: list[ChunkRecord] = []  # of what is sent, for the KV events
        for k, e in zip(keys, there, strict=True):
            if e is None:
                tier.count("write_failed")
            elif e:
                tier.count("already_present")
                self._announce(k)
            else:
                got = self.local.chunk(k)
                if got is None:  # evicted or superseded locally before it could be sent
                    tier.count("write_failed")
                    continue
                rec, ext = got
                # findable by a prompt whose chunk there is a prefix of it
                kids.append((rec.parent, rec.key, rec.tokens))
                send.append((k, self._value(k, rec, ext)))
                recs.append(rec)
        if send:
            with tier.deadline():
                sent = tier.put(send, kids)
            for rec, ok in zip(recs, sent, strict=True):
                tier.count("written_chunks" if ok else "already_present" if ok is False
                            else "write_failed")
                if ok is not None:  # written, or another store's write of it was there
                    self.core.hooks.shared_stored(self.name, rec)
        marks = [m for _, m in batch if m is not None]  # after their chunks
        if marks:
            self.boundaries.write_marks(marks)

    def _announce(self, key: bytes) -> None:
        """For the KV events: the tier holds chunk ``key`` (found there by write-through)."""
        if self.core.hooks and (rec := self.core.chunk_record(key)) is not None:
            self.core.hooks.shared_stored(self.name, rec)

    def _swept(self, keys: list[bytes]) -> None:
        """For the KV events: the tier's sweep deleted the values ``keys``."""
        self.core.hooks.shared_removed(self.name, keys)

    def _value(self, key: bytes, rec: ChunkRecord, ext: np.ndarray) -> bytes:
        """The remote value of a local chunk (``ext``: its decoded extent), through the
        remote codec; raw if a lossy codec cannot take it (non-finite KV). A chunk stored here
        through a lossy disk codec is no recompute's KV: unless the remote codec is lossy too,
        it goes through its own disk codec, so that the value says it is lossy (a lossless
        remote codec would carry the lossy KV unmarked)."""
        lay, codec = self.core.layout, remote_value_codec(self.tier.cfg.codec, rec.codec)
        if codec != self.tier.cfg.codec:  # its own lossy codec: within its bound of them
            self._count("lossy_source_writes")
        if codec != "none":
            try:
                val = rv.encode_bytes(key, rec.tokens, ext, lay.num_layers, codec=codec,
                                      layout=lay)
                self._count("coded_writes")
                return val
            except ValueError:
                self._count("raw_fallback_writes")
        # a chunk stored through a disk codec keeps checksums of its encoded bytes; ext is
        # decoded, so its checksums are computed afresh
        sums = rec.checksums if rec.codec == 0 else None
        return rv.encode_bytes(key, rec.tokens, ext, lay.num_layers, checksums=sums)

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every chunk queued for write-through so far was sent (or failed, as
        counted in stats). False on timeout."""
        return self._writes.wait(timeout)

    # ------------------------------------------------------------------ deletes
    def delete(self, chunks: list[tuple[bytes, bytes, np.ndarray]]) -> int:
        """Delete the values of ``chunks`` ((key, parent key, token ids), chosen by
        ``Store.delete``) from the tier, and the kids entries of the partial ones, in one
        call bounded by the tier's deadline; returns how many values were deleted. A value
        the tier does not answer for is counted in ``delete_failed``, never raised. The
        values' keys are chain hashes seeded by their namespace: another namespace's values
        are other keys."""
        if not chunks:
            return 0
        keys = [k for k, _, _ in chunks]
        with self._lock:  # not "just fetched" any more: a later put sends them again
            for k in keys:
                self._recent.pop(k, None)
                self._lossy.pop(k, None)
        kids = [(parent, k, toks) for k, parent, toks in chunks]
        self.found.forget(keys)
        # a boundary's first chunk (STATE in it, after a chunk that is not the state's): its
        # mark goes first, so no reader is sent to values that are going
        states = {k for k, _, toks in chunks if (toks == STATE).all()}
        self.boundaries.drop_marks([(parent, k) for k, parent, toks in chunks
                                    if (toks == STATE).any() and parent not in states])
        with self.tier.deadline():
            got = self.tier.delete(keys, kids)
        deleted = sum(1 for g in got if g)
        self.core.hooks.shared_removed(self.name, [k for k, g in zip(keys, got, strict=True)
                                                   if g is not None])  # gone, or never there
        self._count("deleted_chunks", deleted)
        self._count("delete_failed", sum(1 for g in got if g is None))
        return deleted

    # ------------------------------------------------------------------ boundary states
    def find_boundary(self, toks: np.ndarray, namespace: str | None, local: int,
                      pieces: list[Piece]) -> int:
        """The longest boundary of ``toks`` this tier serves beyond the local one
        (``local`` tokens), if fetching it pays; else ``local``."""
        got = self.boundaries.find(toks, namespace, local=local, limit=len(toks),
                                   pieces=pieces)
        return local if got is None else got.position

    def state(self, toks: np.ndarray, namespace: str | None) -> bytes:
        """The state of the boundary after exactly ``toks`` from this tier; KeyError."""
        return self.boundaries.state(toks, namespace)

    def delete_boundary(self, toks: np.ndarray, namespace: str | None) -> int:
        """Delete the boundary after exactly ``toks`` from this tier (its mark, then its own
        chunks); how many values went."""
        return self.delete(self.boundaries.delete(toks, namespace))

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, jobs: list[Job]) -> None:
        """Fetch (and fill locally) the remote KV of these queued jobs in the background."""
        if self.tier.cfg.fill == "none" or self.core.readonly:
            return
        self._prefetches.submit(jobs)

    def _prefetch_batch(self, jobs: list[Job]) -> None:
        for job in jobs:
            with self.tier.deadline():  # one deadline for the job's match and get
                pieces = self._local(job.tokens, job.namespace)
                n = self.match(job.tokens, job.namespace, pieces)
                if n > served(pieces):
                    try:  # fetched from this tier, and filled locally
                        self.get(job.tokens[:n], job.namespace, None, None)
                    except KeyError:  # evicted from Redis meanwhile: counted as a miss
                        continue
                    self._count("prefetched")

    def wait_prefetched(self, timeout: float | None = None) -> bool:
        """Block until queued remote prefetches and the local fills they cause are done."""
        return self._prefetches.wait(timeout) and self._fills.wait(timeout)

    def wait_filled(self, timeout: float | None = None) -> bool:
        """Block until fetched contexts queued to be stored locally are stored."""
        return self._fills.wait(timeout)

    # ------------------------------------------------------------------ documents
    def put_doc(self, name: str, data: bytes) -> bool:
        """Store a small document (not KV) under ``name``; False if this tier keeps no
        documents (an object store) or did not answer (counted in its stats)."""
        put = getattr(self.tier, "put_doc", None)
        return put is not None and put(name, data)

    def get_doc(self, name: str) -> bytes | None:
        """The document stored under ``name`` (untrusted bytes), or None: absent, this tier
        keeps no documents, or it did not answer."""
        get = getattr(self.tier, "get_doc", None)
        return None if get is None else get(name)

    # ------------------------------------------------------------------ lifecycle, stats
    def close(self, *, abandon: bool = False) -> None:
        """Stop prefetching; send what write-through has queued (unless ``abandon``); close
        the connections."""
        try:
            self._prefetches.close(abandon=True)
            self._fills.close(abandon=abandon)
            self._writes.close(abandon=abandon)
        finally:
            self.tier.close()

    def stats(self) -> dict[str, object]:
        with self._lock:
            c = asdict(self.counters)
        return {**self.tier.stats(), **c, **self.boundaries.stats(),
                "prefill_rate": self.prefill_rate,
                "write_queue": self._writes.pending, "write_errors": self._writes.errors,
                "write_dropped": self._writes.dropped,
                "last_write_error": self._writes.last_error,
                "prefetch_errors": self._prefetches.errors,
                "last_fill_error": self.last_fill_error}
