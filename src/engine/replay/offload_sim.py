"""Prefill across datacenters, simulated: a local PD cluster (prefill and decode instances), an
optional prefill cluster behind an inter-cluster link, a router that places each request.

Deployments (the same request stream through each):

- ``homogeneous``: prefill and decode instances in one cluster; no link.
- ``naive``: every prefill on the prefill cluster, its KV over the link to the local decode.
- ``selective``: per request, the router's estimate of when its KV would reach decode
  (:meth:`Router.options`) picks the instance: a local prefill instance, or — when the part
  not cached is at least ``min_offload_tokens`` long — a remote one, whose estimate includes
  the link as the scheduler measures it (the backlog ahead at the measured bandwidth). A
  remote prefill is chosen only when that is sooner than every local one: never queued behind
  a link that cannot deliver in time. Short requests and cache hits stay local because local
  is sooner for them.

In every deployment placement is cache-aware: each instance's estimate counts the prefix it
holds, as the router knows it — from the instances' KV events (``knowledge="events"``,
:class:`engine.replay.kv_placement.EventView`) or from the caches themselves (``"global"``).
What a prefill actually reuses is what its instance actually holds. The events' delay is an
information lag, compared with the time between a session's turns: when the stream is played
faster (:meth:`engine.replay.offload_workload.Workload.at_rate`) it scales with those gaps.

Events of one request: it arrives; its prefill is queued on the chosen instance (FIFO, one
prefill at a time, compute-bound: :meth:`engine.replay.offload_costs.Instance.prefill_s`);
when it ends the instance caches the prompt; the KV goes to decode — within the cluster over
RDMA (``rdma_bps``), from the prefill cluster over the link (:class:`engine.replay.link.Link`:
only the KV the local cluster does not hold, plus the state); decode admits it (FIFO) when a
decode instance has a slot and room for its KV; its first token comes one decode step later
(TTFT = first token - arrival); it occupies the decode instance ``output`` steps, each as long
as reading the weights and the KV the instance holds once it joined
(:meth:`engine.replay.offload_costs.Instance.decode_step_for`); then the KV
decode holds (the prompt, and the reply if the next turn extends it; states at the shared
prefix's boundary and at the end) is written back to a local prefill instance's cache (the one
that prefilled it, else the one holding most of the session) and the session's next turn
arrives ``think_s`` later.

Thread-safety: none (one simulation's thread).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from engine.replay.kv_placement import EventView, GlobalView, InstanceCache
from engine.replay.link import Link, LinkSpec
from engine.replay.offload_costs import GB, Accelerator, Instance, ModelShape
from engine.replay.offload_workload import Session, Workload

DEPLOYMENTS = ("homogeneous", "naive", "selective")
KNOWLEDGE = ("events", "global")


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """Hardware and policy of one deployment. ``local_prefill`` of the ``local_instances``
    prefill, the rest decode; ``remote_instances`` prefill behind ``link`` (not for
    ``homogeneous``)."""

    kind: str
    model: ModelShape
    local_hw: Accelerator
    local_instances: int
    local_prefill: int
    remote_hw: Accelerator | None = None
    remote_instances: int = 0
    link: LinkSpec | None = None
    knowledge: str = "events"
    event_delay_s: float = 0.05
    max_index_entries: int = 1 << 22
    cache_bytes: int = 512 * GB  # each prefill instance's prefix cache (host memory)
    block_tokens: int = 256
    rdma_bps: float = 400e9  # prefill -> decode within a cluster (8 x 400 Gbit/s)
    min_offload_tokens: int = 0
    max_batch: int = 256

    def __post_init__(self) -> None:
        if self.kind not in DEPLOYMENTS:
            raise ValueError(f"kind must be one of {DEPLOYMENTS}, got {self.kind!r}")
        if self.knowledge not in KNOWLEDGE:
            raise ValueError(f"knowledge must be one of {KNOWLEDGE}, got {self.knowledge!r}")
        remote = self.kind != "homogeneous"
        if remote and (self.remote_hw is None or self.remote_instances < 1 or self.link is None):
            raise ValueError(f"a {self.kind} deployment needs remote_hw, remote_instances >= 1 "
                             f"and a link")
        lo = 0 if self.kind == "naive" else 1
        if not lo <= self.local_prefill < self.local_instances:
            raise ValueError(f"local_prefill must be in [{lo}, local_instances - 1], got "
                             f"{self.local_prefill} of {self.local_instances}")
        if self.kind == "naive" and self.local_prefill:
            raise ValueError("a naive deployment prefills nothing locally: local_prefill 0")
        for name in ("event_delay_s", "min_offload_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.cache_bytes < 0 or self.block_tokens < 1 or not self.rdma_bps > 0:
            raise ValueError("cache_bytes >= 0, block_tokens >= 1 and rdma_bps > 0 needed")

    @property
    def remote(self) -> int:
        return 0 if self.kind == "homogeneous" else self.remote_instances

    @property
    def decode_instances(self) -> int:
        return self.local_instances - self.local_prefill


@dataclass(slots=True, eq=False)
class Request:
    session: Session
    turn: int
    seq: int
    arrival_s: float
    prompt: int
    shared: int
    output: int
    instance: int = -1  # prefill instance (local first, then remote)
    remote: bool = False
    believed: int = 0  # cached tokens the router believed the instance held
    cached: int = 0  # cached tokens the prefill reused
    est_ready_s: float = 0.0  # the router's estimate of kv_ready_s
    prefill_start_s: float = 0.0
    prefill_end_s: float = 0.0
    link_bytes: int = 0
    kv_ready_s: float = 0.0
    decode_start_s: float = 0.0
    first_token_s: float = 0.0
    finish_s: float = 0.0
    decoder: int = -1
    decode_bytes: int = 0  # the KV it holds on its decoder (prompt and output)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


@dataclass(slots=True)
class Prefiller:
    cost: Instance
    cache: InstanceCache
    remote: bool
    free_at: float = 0.0
    busy_s: float = 0.0


@dataclass(slots=True)
class Decoder:
    active: int = 0
    used: int = 0
    busy_token_s: float = 0.0  # request-seconds of occupancy


@dataclass(frozen=True, slots=True)
class Option:
    instance: int
    believed: int
    est_ready_s: float


@dataclass
class SimResult:
    deployment: Deployment
    requests: list[Request]
    makespan_s: float
    link: Link | None
    prefillers: list[Prefiller]
    view_stats: dict[str, int] = field(default_factory=dict)


class Router:
    """Places requests (see the module docstring). ``force``: request seq -> instance, to
    replay a decision differently (the tests' brute force). Thread-safety: none (its
    simulation's thread)."""

    def __init__(self, sim: Simulation, force: dict[int, int] | None = None) -> None:
        self.sim, self.force = sim, force or {}

    def options(self, req: Request, now: float) -> list[Option]:
        """Every instance this deployment may send ``req`` to, with the router's estimate of
        when its KV would reach decode there."""
        sim, d = self.sim, self.sim.d
        model = d.model
        limit = min(req.shared, req.prompt - 1)
        n = len(sim.prefillers)
        believed = sim.view.usable(req.session.key, limit, n) if limit > 0 else [0] * n
        local_ids = range(d.local_prefill)
        remote_ids = range(d.local_prefill, n)
        ids: list[int] = []
        if d.kind != "naive":
            ids.extend(local_ids)
        if d.kind == "naive" or (d.kind == "selective"
                                 and req.prompt - max(believed) >= d.min_offload_tokens):
            ids.extend(remote_ids)
        local_held = max((believed[i] for i in local_ids), default=0)
        boundary = limit // d.block_tokens * d.block_tokens if limit > 0 else 0
        out = []
        outlook = sim.link.outlook(now) if sim.link is not None and d.kind != "homogeneous" \
            else None
        flops: dict[int, float] = {}  # cached tokens -> FLOPs of the rest
        handoff = model.kv_bytes(req.prompt) / d.rdma_bps
        nbytes = sim.ship_bytes(req, local_held, local_held >= boundary)
        for i in ids:
            p = sim.prefillers[i]
            c = believed[i]
            if c not in flops:
                flops[c] = model.prefill_flops(req.prompt - c, c)
            start = max(now, p.free_at)
            end = start + flops[c] / p.cost.hw.prefill_flops_per_s
            if p.remote:
                ready = sim.link.estimate(now, start, end, nbytes, nbytes / model.layers,
                                          outlook)
            else:
                ready = end + handoff
            out.append(Option(i, c, ready))
        return out

    def choose(self, req: Request, now: float) -> Option:
        """The soonest of :meth:`options` (ties: the lowest instance, local first)."""
        opts = self.options(req, now)
        if req.seq in self.force:
            return next(o for o in opts if o.instance == self.force[req.seq])
        return min(opts, key=lambda o: (o.est_ready_s, o.instance))


class Simulation:
    """One deployment serving one workload (see the module docstring); :meth:`run` once.
    Thread-safety: none (one thread runs it)."""

    def __init__(self, d: Deployment, workload: Workload, *,
                 force: dict[int, int] | None = None) -> None:
        self.d, self.workload = d, workload
        m = d.model
        self.view: EventView | GlobalView
        caches = []
        publish = None
        if d.knowledge == "events":
            # an information lag, measured against the gaps between a session's turns: it
            # scales with them when the stream is played faster (Workload.at_rate)
            self.view = EventView(hybrid=m.hybrid, block_tokens=d.block_tokens,
                                  delay_s=d.event_delay_s * workload.time_scale,
                                  max_entries=d.max_index_entries)
            publish = self.view.publish
        kind = "sliding_window" if m.swa_layers else ("mamba" if m.linear_layers else None)
        self.prefillers: list[Prefiller] = []
        for i in range(d.local_prefill + d.remote):
            remote = i >= d.local_prefill
            cache = InstanceCache(i, capacity_bytes=d.cache_bytes, block_tokens=d.block_tokens,
                                  block_bytes=m.kv_bytes_per_token * d.block_tokens,
                                  state_bytes=m.state_bytes if m.hybrid else None,
                                  state_kind=kind, window=m.window or None, publish=publish)
            caches.append(cache)
            hw = d.remote_hw if remote else d.local_hw
            self.prefillers.append(Prefiller(Instance(model=m, hw=hw, max_batch=d.max_batch),
                                             cache, remote))
        if d.knowledge == "global":
            self.view = GlobalView(caches)
        self.decode_cost = Instance(model=m, hw=d.local_hw, max_batch=d.max_batch)
        self.decoders = [Decoder() for _ in range(d.decode_instances)]
        self.link = Link(d.link) if d.remote else None
        self.router = Router(self, force)
        self.requests: list[Request] = []
        self._events: list[tuple[float, int, int, object]] = []
        self._tie = itertools.count()
        self._waiting: deque[Request] = deque()

    # ------------------------------------------------------------------ helpers
    def ship_bytes(self, req: Request, local_held: int, shared_state_held: bool) -> int:
        """KV a remote prefill sends over the link: the full-attention KV the local cluster
        does not hold, the state at the prompt's end and (hybrid) the state at the shared
        prefix's boundary unless the local cluster holds it (what later turns resume from)."""
        m, b = self.d.model, self.d.block_tokens
        nbytes = m.kv_bytes_per_token * (req.prompt - local_held) + m.state_bytes(req.prompt)
        boundary = min(req.shared, req.prompt - 1) // b * b
        if m.hybrid and boundary and not shared_state_held:
            nbytes += m.state_bytes(boundary)
        return nbytes

    def _push(self, t: float, kind: int, obj: object) -> None:
        heapq.heappush(self._events, (t, next(self._tie), kind, obj))

    # ------------------------------------------------------------------ the loop
    def run(self) -> SimResult:
        for s in self.workload.sessions:
            self._push(s.arrival_s, ARRIVE, (s, 0))
        now = 0.0
        handlers = {ARRIVE: self._arrive, PREFILLED: self._prefilled, KV_READY: self._kv_ready,
                    DECODED: self._decoded}
        while self._events:
            now, _, kind, obj = heapq.heappop(self._events)
            handlers[kind](now, obj)
        return SimResult(deployment=self.d, requests=self.requests, makespan_s=now,
                         link=self.link, prefillers=self.prefillers,
                         view_stats=self.view.stats())

    def _arrive(self, now: float, obj: object) -> None:
        session, k = obj  # type: ignore[misc]
        t = session.turns[k]
        req = Request(session=session, turn=k, seq=len(self.requests), arrival_s=now,
                      prompt=t.prompt, shared=t.shared, output=t.output)
        self.requests.append(req)
        self.view.sync(now)
        opt = self.router.choose(req, now)
        self._dispatch(req, opt, now)

    def _dispatch(self, req: Request, opt: Option, now: float) -> None:
        p = self.prefillers[opt.instance]
        key = req.session.key
        limit = min(req.shared, req.prompt - 1)
        cached = p.cache.usable(key, limit) if limit > 0 else 0
        p.cache.touch(key, cached)
        req.instance, req.remote, req.believed = opt.instance, p.remote, opt.believed
        req.cached, req.est_ready_s = cached, opt.est_ready_s
        start = max(now, p.free_at)
        dur = p.cost.prefill_s(req.prompt - cached, cached)
        p.free_at = end = start + dur
        p.busy_s += dur
        req.prefill_start_s, req.prefill_end_s = start, end
        m = self.d.model
        if p.remote:
            local = [c.cache for c in self.prefillers if not c.remote]
            held = max((c.held_blocks(key, limit) for c in local), default=0) \
                if limit > 0 else 0
            state = any(c.has_state(key, limit) for c in local) if limit > 0 else False
            nbytes = self.ship_bytes(req, held, state)
            tr = self.link.send(start, end, nbytes, nbytes / m.layers)
            req.link_bytes = nbytes
            req.kv_ready_s = tr.end_s + self.d.link.latency_s
        else:
            req.kv_ready_s = end + m.kv_bytes(req.prompt) / self.d.rdma_bps
        self._push(end, PREFILLED, req)
        self._push(req.kv_ready_s, KV_READY, req)

    def _prefilled(self, now: float, req: Request) -> None:
        cache = self.prefillers[req.instance].cache
        cache.store(req.session.key, req.prompt, (req.shared, req.prompt), now)

    def _kv_ready(self, now: float, req: Request) -> None:
        self._waiting.append(req)
        self._admit(now)

    def _admit(self, now: float) -> None:
        """Start decoding the waiting requests in order while a decoder takes the head."""
        pool, m = self.decode_cost.kv_pool_bytes, self.d.model
        while self._waiting:
            req = self._waiting[0]
            need = req.decode_bytes or m.kv_bytes(req.prompt + req.output)
            req.decode_bytes = need
            fits = [(dec.active, i) for i, dec in enumerate(self.decoders)
                    if dec.active == 0 or (dec.active < self.d.max_batch
                                           and dec.used + need <= pool)]
            if not fits:
                return
            i = min(fits)[1]
            self._waiting.popleft()
            dec = self.decoders[i]
            dec.active += 1
            dec.used += need
            step = self.decode_cost.decode_step_for(dec.used)
            req.decoder, req.decode_start_s = i, now
            req.first_token_s = now + step
            req.finish_s = now + req.output * step
            dec.busy_token_s += req.output * step
            self._push(req.finish_s, DECODED, req)

    def _decoded(self, now: float, req: Request) -> None:
        dec = self.decoders[req.decoder]
        dec.active -= 1
        dec.used -= req.decode_bytes
        session, k = req.session, req.turn
        turn = session.turns[k]
        if self.d.local_prefill:  # the KV decode holds, kept in the local cluster
            context = req.prompt + req.output if turn.save_context else req.prompt
            self._home(req).cache.store(session.key, context, (req.shared, context), now)
        self._admit(now)
        if k + 1 < len(session.turns):
            self._push(now + turn.think_s, ARRIVE, (session, k + 1))

    def _home(self, req: Request) -> Prefiller:
        """The local prefill instance a finished context is written back to: the one that
        prefilled it, else the one holding most of the session (then the least busy)."""
        if not req.remote:
            return self.prefillers[req.instance]
        local = self.prefillers[:self.d.local_prefill]
        key, limit = req.session.key, req.prompt
        return min(local, key=lambda p: (-p.cache.held_blocks(key, limit), p.free_at,
                                         p.cache.index))


ARRIVE, PREFILLED, KV_READY, DECODED = range(4)
