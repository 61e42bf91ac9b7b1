"""Real scale-out: N servers without session affinity, each with its own store directory (DRAM
and disk), with or without the shared remote tier on a real Redis.

Every turn is routed as in simulated mode (:meth:`ScaleOut.server_of`). Each server is a
:class:`~engine.replay.real.RealExecutor` over its own store and its own
:class:`~engine.generate.Generator` (own load/compute rates); they share the model's weights and
the conversations' histories, which a router would send with each request. With the shared
tier every server's store opens the same Redis (``ScaleOut.url``) under a key prefix of its
own per run, so a run never reuses an earlier run's values. When a turn finishes, its save is
waited for (locally, and with the shared tier its write-through to Redis): the think time before
the conversation's next turn, seconds in the trace, covers both in a deployment.

The servers run on this one machine, one job at a time, so TTFT measures each turn's own
prefill and loads (queueing is that of one machine doing N servers' work); hit rates and reuse
are exact under the routing. Thread-safety: none (the server loop's one thread).
"""

from __future__ import annotations

from collections import deque

import kvstore
from engine.model import Model
from engine.replay.multi import ScaleOut
from engine.replay.real import OneJobAtATime, RealExecutor, _ConvState
from engine.replay.server import Job, Method
from engine.truncation import Truncation


class RealMultiServerExecutor(OneJobAtATime):
    def __init__(self, method: Method, model: Model, stores: list[kvstore.Store], *,
                 scale: ScaleOut, truncation: Truncation, window: int) -> None:
        if not method.caches:
            raise ValueError("scale-out needs a caching method (as or of)")
        if len(stores) != scale.servers:
            raise ValueError(f"stores must hold one store per server ({scale.servers}), "
                             f"got {len(stores)}")
        self.scale = scale
        self.stores = stores
        convs: dict[int, _ConvState] = {}
        self.servers = [RealExecutor(method, model, st, truncation=truncation, window=window,
                                     convs=convs) for st in stores]

    def prefill(self, job: Job, waiting: deque[Job], running: list[Job]) -> float:
        s = self.scale.server_of(job)
        # each server's store sees its own queue
        mine = deque(j for j in waiting if self.scale.server_of(j) == s)
        return self.servers[s].prefill(job, mine, running)

    def decode(self, running: list[Job], steps: int) -> float:
        return sum(self.servers[self.scale.server_of(j)].decode([j], steps) for j in running)

    def finish(self, job: Job, next_arrival: float | None) -> None:
        ex = self.servers[self.scale.server_of(job)]
        ex.finish(job, next_arrival)
        ex.flush()  # the turn's save is durable before the conversation's next turn, and
        if self.scale.shared:  # in Redis (the think time covers both in a deployment)
            ex.store.flush(remote=True)

    def flush(self) -> None:
        for ex in self.servers:
            ex.flush()

    def counters(self) -> dict[str, object]:
        out: dict[str, object] = {"servers": self.scale.servers, "shared": self.scale.shared}
        for i, st in enumerate(self.stores):
            s = st.stats()
            out[f"server{i}"] = {k: s[k] for k in ("hits", "misses", "remote") if k in s}
        return out
