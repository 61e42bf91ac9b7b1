"""Simulated scale-out: N servers without session affinity, with or without a shared tier.

Each turn goes to a server chosen at random (seeded by conversation and turn), each server with
its own store (DRAM and disk, :class:`~engine.replay.simstore.SimStore`). Without a shared tier
a turn reuses only what its server stored itself — a context from this conversation's previous
turn if that turn ran here, or an older (shorter) one, usable only if no truncation happened
since. With the shared tier (the store's remote tier on Redis) every finished turn is written
through, so any server can fetch the latest context: ``remote_bps`` and ``remote_latency_s``
give the fetch time, and a remote context is fetched only when that is sooner than recomputing
what it adds (the store's rule, with the cost model's prefill time); ``remote_bytes`` (None:
unbounded) bounds the tier with LRU eviction like Redis's ``allkeys-lru``.

The N servers share this simulation's one scheduling loop (one batch at a time across them),
so queueing in TTFT is that of one server doing N servers' work; hit rates and reuse are exact
under the routing. Thread-safety: none (the server loop's one thread).
"""

from __future__ import annotations

import collections
import hashlib
from collections import deque
from dataclasses import dataclass

from engine.replay.costs import CostModel
from engine.replay.server import Job, Method
from engine.replay.simstore import SimStore
from engine.replay.simulated import CostLimits


@dataclass(frozen=True, kw_only=True)
class ScaleOut:
    servers: int = 4
    shared: bool = False
    remote_bps: float = 12.5e9  # 100 Gbit/s (RDMA-class, as Mooncake's transfer engine)
    remote_latency_s: float = 0.0005
    remote_bytes: int | None = None
    only_when_it_pays: bool = True  # False: fetch every remote hit (the hit-rate ceiling)
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.servers, bool) or not isinstance(self.servers, int) \
                or self.servers < 1:
            raise ValueError(f"servers must be an int >= 1, got {self.servers!r}")
        if not self.remote_bps > 0:
            raise ValueError(f"remote_bps must be > 0, got {self.remote_bps!r}")


class MultiServerExecutor(CostLimits):
    def __init__(self, method: Method, cost: CostModel, scale: ScaleOut) -> None:
        if not method.caches:
            raise ValueError("scale-out simulation needs a caching method (as or of)")
        self.method, self.cost, self.scale = method, cost, scale
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

    def server_of(self, job: Job) -> int:
        h = hashlib.blake2b(f"{self.scale.seed}/{job.conv.index}/{job.turn}".encode(),
                            digest_size=8).digest()
        return int.from_bytes(h, "little") % self.scale.servers

    def arrive(self, job: Job) -> None:
        s = self.server_of(job)
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
            return not (turn in cut and self.method.kind == "of")
        return not any(stored_turn < t <= turn for t in cut)

    def prefill(self, job: Job, waiting: deque[Job], running: list[Job]) -> float:
        s = self.server_of(job)
        store, cost, key = self.stores[s], self.cost, job.conv.index
        store.advance(job.start_s)
        store.start(key)
        if job.truncated:
            self._truncated[key].add(job.turn)
            if self.method.kind == "of":
                store.drop(key)
        tier, reused = None, 0
        if job.turn > 0:
            e = store.entry(key)
            if e is not None and self._usable(key, self._version[s].get(key), job.turn):
                tier = store.lookup(key)
                reused = job.kept if self._version[s][key] == job.turn - 1 else min(
                    e.tokens, job.kept)
            r = self._remote.get(key) if self.scale.shared else None
            if r is not None and self._usable(key, r[1], job.turn):
                r_tokens = job.kept if r[1] == job.turn - 1 else min(r[0], job.kept)
                fetch_s = (self.scale.remote_latency_s
                           + (r_tokens - reused) * cost.token_bytes / self.scale.remote_bps)
                saved_s = (cost.prefill_s(job.prompt_len - reused, reused)
                           - cost.prefill_s(job.prompt_len - r_tokens, r_tokens))
                if r_tokens > reused and fetch_s >= saved_s and self.scale.only_when_it_pays:
                    self.declined += 1
                elif r_tokens > reused:
                    tier, reused = "remote", r_tokens
                    self._remote.move_to_end(key)
                    self.remote_hits += 1
        job.hit = "none" if job.turn == 0 else ("miss" if tier is None else tier)
        job.reused = reused
        new = job.prompt_len - job.reused
        job.compute_s = cost.prefill_s(new, job.reused)
        if job.reused:
            if tier == "remote":
                load = (self.scale.remote_latency_s
                        + job.reused * cost.token_bytes / self.scale.remote_bps)
            else:
                load = cost.load_s(job.reused, tier)
            begin = max(job.arrival_s, self._link_free[s], self._prev_start[s])
            end = begin + load
            self._link_free[s] = end
            done = max(job.start_s + job.compute_s, end + job.compute_s / cost.num_layers)
            job.load_s = done - job.start_s - job.compute_s
        if job.start_s > self._prev_start[s]:
            self._prev_start[s] = job.start_s
        return job.compute_s + job.load_s

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
                "remote_bytes_used": self._remote_used}
