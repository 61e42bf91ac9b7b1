"""Simulated scale-out: N servers without session affinity, with or without a shared tier.

Each turn goes to a server chosen at random (seeded by conversation and turn), each server with
its own store (DRAM and disk, :class:`~engine.replay.simstore.SimStore`). Without a shared tier
a turn reuses only what its server stored itself — a context from this conversation's previous
turn if that turn ran here, or an older (shorter) one, usable only if no truncation happened
since. With the shared tier (the store's remote tier on Redis) every finished turn is written
through, so any server can fetch the latest context: ``remote_bps`` and ``remote_latency_s``
give the fetch time. A remote context is used only when that pays: with ``load="all"`` when the
fetch is sooner than recomputing what it adds (the store's rule, with the cost model's prefill
time); with ``load="split"`` (the default) the front of the prefix is computed while its back
is fetched (:meth:`CostModel.split`), so a link slower than recompute still serves part of the
prefix. ``remote_bytes`` (None: unbounded) bounds the tier with LRU eviction like Redis's
``allkeys-lru``. The shared tier may as well be an object store (a bucket every server shares:
tens of milliseconds of latency, ``remote_latency_s``, and its bandwidth). ``wipe_every_s``
empties every server's own store at each multiple of it (a fleet whose machines restart on
fresh disks every day): what survives is only what the shared tier holds.

The N servers share this simulation's one scheduling loop (one batch at a time across them),
so queueing in TTFT is that of one server doing N servers' work; hit rates and reuse are exact
under the routing. Thread-safety: none (the server loop's one thread).
"""

from __future__ import annotations

import collections
import hashlib
from collections import deque
from dataclasses import dataclass, replace

from engine.replay.costs import CostModel
from engine.replay.server import Job, Method, MethodKind
from engine.replay.simstore import SimStore
from engine.replay.simulated import CostLimits, place_load


@dataclass(frozen=True, kw_only=True)
class ScaleOut:
    servers: int = 4
    shared: bool = False
    remote_bps: float = 12.5e9  # 100 Gbit/s (RDMA-class, as Mooncake's transfer engine)
    remote_latency_s: float = 0.0005
    remote_bytes: int | None = None
    only_when_it_pays: bool = True  # False: fetch every remote hit (the hit-rate ceiling)
    seed: int = 0
    url: str | None = None  # real mode: the shared Redis (simulated: only named)
    wipe_every_s: float | None = None  # simulated: each server's store emptied this often

    def __post_init__(self) -> None:
        if isinstance(self.servers, bool) or not isinstance(self.servers, int) \
                or self.servers < 1:
            raise ValueError(f"servers must be an int >= 1, got {self.servers!r}")
        if not self.remote_bps > 0:
            raise ValueError(f"remote_bps must be > 0, got {self.remote_bps!r}")
        if not self.remote_latency_s >= 0:
            raise ValueError(f"remote_latency_s must be >= 0, got {self.remote_latency_s!r}")
        if self.wipe_every_s is not None and not self.wipe_every_s > 0:
            raise ValueError(f"wipe_every_s must be > 0 or None, got {self.wipe_every_s!r}")

    def server_of(self, job: Job) -> int:
        """The server a turn is routed to: uniform, seeded by conversation and turn (no
        session affinity), the same in both modes."""
        h = hashlib.blake2b(f"{self.seed}/{job.conv.index}/{job.turn}".encode(),
                            digest_size=8).digest()
        return int.from_bytes(h, "little") % self.servers


class MultiServerExecutor(CostLimits):
    """Thread-safety: none (the server loop's one thread)."""

    def __init__(self, method: Method, cost: CostModel, scale: ScaleOut) -> None:
        if not method.caches:
            raise ValueError("scale-out simulation needs a caching method (as or of)")
        self.method, self.scale = method, scale
        self.cost = replace(cost, remote_bps=scale.remote_bps,
                            remote_latency_s=scale.remote_latency_s)
        self.stores = [SimStore(dram_bytes=cost.dram_bytes, disk_bytes=cost.disk_bytes,
                                token_bytes=cost.token_bytes, policy=method.policy,
                                disk_bandwidth=cost.disk_to_dram_bps)
                       for _ in range(scale.servers)]
        self._version: list[dict[int, int]] = [{} for _ in self.stores]  # conv -> turn stored
        self._remote: collections.OrderedDict[int, tuple[int, int]] = collections.OrderedDict()
        self._remote_used = 0
        self._truncated: dict[int, set[int]] = collections.defaultdict(set)
        self._link_free = [0.0] * scale.servers
        self._prev_start = [0.0] * scale.servers
        self.remote_hits = 0
        self.remote_evictions = 0
        self.declined = 0  # remote contexts not fetched: recomputing was estimated sooner
        self._day = [0] * scale.servers  # the wipe period each server's store belongs to
        self.wipes = 0
        self.wiped_contexts = 0

    def server_of(self, job: Job) -> int:
        return self.scale.server_of(job)

    def _wipe_if_due(self, s: int, now: float) -> None:
        """Empty server ``s``'s store if a wipe fell since it was last used."""
        every = self.scale.wipe_every_s
        if every is None or int(now // every) <= self._day[s]:
            return
        self._day[s] = int(now // every)
        self.wiped_contexts += self.stores[s].clear()
        self._version[s].clear()
        self.wipes += 1

    def arrive(self, job: Job) -> None:
        s = self.server_of(job)
        self._wipe_if_due(s, job.arrival_s)
        self.stores[s].advance(job.arrival_s)
        self.stores[s].enqueue(job.conv.index)

    def _usable(self, key: int, stored_turn: int | None, turn: int) -> bool:
        """A context stored after ``stored_turn`` serves turn ``turn``: the previous turn's
        (AS truncates it in place if this turn overflows; OF cannot), or an older one (a
        prefix of the history) if the history was not truncated since."""
        if stored_turn is None:
            return False
        cut = self._truncated[key]
        if stored_turn == turn - 1:
            return not (turn in cut and self.method.kind is MethodKind.OF)
        return not any(stored_turn < t <= turn for t in cut)

    def prefill(self, job: Job, waiting: deque[Job], running: list[Job]) -> float:
        s = self.server_of(job)
        store, cost, key = self.stores[s], self.cost, job.conv.index
        store.advance(job.start_s)
        store.start(key)
        if job.truncated:
            self._truncated[key].add(job.turn)
            if self.method.kind is MethodKind.OF:
                store.drop(key)
        local: tuple[str, int] | None = None  # (tier, tokens) this server holds
        remote: int | None = None  # tokens the shared tier holds
        if job.turn > 0:
            e = store.entry(key)
            if e is not None and self._usable(key, self._version[s].get(key), job.turn):
                tokens = job.kept if self._version[s][key] == job.turn - 1 else min(
                    e.tokens, job.kept)
                if tokens:
                    local = (store.lookup(key), tokens)
            r = self._remote.get(key) if self.scale.shared else None
            if r is not None and self._usable(key, r[1], job.turn):
                tokens = job.kept if r[1] == job.turn - 1 else min(r[0], job.kept)
                if tokens > (local[1] if local else 0):
                    remote = tokens
        begin = max(job.arrival_s, self._link_free[s], self._prev_start[s])
        source = self._choose(job, local, remote, begin)
        job.hit = "none" if job.turn == 0 else "miss"
        job.reused = job.recomputed = 0
        job.load_s = 0.0
        job.compute_s = cost.prefill_s(job.prompt_len, 0)
        if source is not None:
            tier, tokens = source
            end = place_load(cost, job, tier, tokens, begin,
                             split=self.method.load == "split" and (
                                 tier != "remote" or self.scale.only_when_it_pays))
            if end is not None:
                self._link_free[s] = end
            if tier == "remote":
                if job.reused:
                    self._remote.move_to_end(key)
                    self.remote_hits += 1
                    job.hit = "remote"
                else:  # the split computes it all: fetching does not pay
                    self.declined += 1
            else:
                job.hit = tier
        if job.start_s > self._prev_start[s]:
            self._prev_start[s] = job.start_s
        return job.compute_s + job.load_s

    def _choose(self, job: Job, local: tuple[str, int] | None, remote: int | None,
                begin: float) -> tuple[str, int] | None:
        """Where ``job``'s stored prefix comes from: this server's tier, or the shared tier
        when it holds more and fetching pays (the store's rule: with ``load="all"``, only when
        the fetch takes less time than recomputing what it adds; with ``split``, when the
        split over the remote prefix reaches the first token sooner than over the local one)."""
        if remote is None:
            return local
        if not self.scale.only_when_it_pays:
            return ("remote", remote)
        cost, have = self.cost, (local[1] if local else 0)
        if self.method.load == "split":
            head = job.start_s - begin

            def ttft(tier: str, tokens: int) -> float:
                return cost.split(tokens, job.prompt_len - tokens, tier, head_start_s=head)[1]

            mine = ttft(*local) if local else cost.prefill_s(job.prompt_len, 0)
            if ttft("remote", remote) < mine:
                return ("remote", remote)
        else:
            fetch_s = cost.load_s(remote - have, "remote")
            saved_s = (cost.prefill_s(job.prompt_len - have, have)
                       - cost.prefill_s(job.prompt_len - remote, remote))
            if fetch_s < saved_s:
                return ("remote", remote)
        self.declined += 1
        return local

    def decode(self, running: list[Job], steps: int) -> float:
        ctx = sum(j.context_after - j.remaining for j in running)
        return self.cost.decode_s(steps, ctx, len(running))

    def finish(self, job: Job, next_arrival: float | None) -> None:
        s, key = self.server_of(job), job.conv.index
        if self.stores[s].put(key, job.context_after):
            self._version[s][key] = job.turn
        else:
            self._version[s].pop(key, None)
        self.stores[s].finish(key, next_arrival)
        if self.scale.shared:  # write-through
            old = self._remote.pop(key, None)
            if old is not None:
                self._remote_used -= old[0] * self.cost.token_bytes
            self._remote[key] = (job.context_after, job.turn)
            self._remote_used += job.context_after * self.cost.token_bytes
            cap = self.scale.remote_bytes
            while cap is not None and self._remote_used > cap and self._remote:
                _, (tok, _) = self._remote.popitem(last=False)
                self._remote_used -= tok * self.cost.token_bytes
                self.remote_evictions += 1

    def counters(self) -> dict[str, object]:
        return {"servers": self.scale.servers, "shared": self.scale.shared,
                "remote_hits": self.remote_hits, "remote_evictions": self.remote_evictions,
                "declined_fetches": self.declined,
                "remote_bytes_used": self._remote_used, "wipes": self.wipes,
                "wiped_contexts": self.wiped_contexts}
