"""The deployment question of prefill across datacenters: for a model, a workload and a link,
the throughput each deployment sustains at a P90 TTFT objective, the P90 TTFT of each at one
load, and the link bandwidth below which remote prefill stops paying.

- **Split** (:func:`plan_split`, the long-timescale rebalancing a deployment does): how many
  local instances prefill and how many decode, chosen to maximize the workload's fluid
  capacity: per request, local prefill seconds, remote prefill seconds, bytes over the link
  and decode instance-seconds (its ``output`` steps, each as long as a batch of requests like it
  makes it, times its share of a decode instance: ``max(1 / max_batch, its KV / the KV
  pool)``), every shared prefix assumed cached; the
  remote cluster takes the longest prompts first (of those the router may send there: at
  least ``min_offload_tokens`` not cached), as far as its instances and the link's nominal
  bandwidth carry them. The same rule for every deployment.
- **Throughput at the objective** (:func:`max_rate`): the highest session arrival rate whose
  P90 TTFT (after the warm-up share of requests) meets the objective, by bisection over the
  rate on a log scale, each point one simulation of the same stream played at that rate
  (:meth:`engine.replay.offload_workload.Workload.at_rate`); the throughput is the request
  rate over the middle 80% of the arrivals there (sessions wait for their replies, so the
  request rate is the system's, not only the stream's).
- **Objective**: ``ttft_p90_s``, or ``slo_factor`` times the homogeneous deployment's P90 TTFT
  at a tenth of its fluid capacity, at least ``min_ttft_p90_s`` (1 s: an interactive TTFT
  objective; the light-load P90 of mostly cached chat turns is a few milliseconds).
- **Crossover**: the selective (and naive) deployment's throughput at each link bandwidth of a
  sweep against the homogeneous one's; where they cross (log-interpolated).

Thread-safety: the functions build their own simulations; any thread may call them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from engine.replay.link import LinkSpec
from engine.replay.offload_costs import GB, Instance, accelerator, model
from engine.replay.offload_sim import Deployment, SimResult, Simulation
from engine.replay.offload_workload import Workload

GBIT = 1e9 / 8  # bytes/s of one Gbit/s


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    model: str
    link: LinkSpec
    local_hw: str = "h20"
    local_instances: int = 8  # of the heterogeneous deployments
    remote_hw: str = "h200"
    remote_instances: int = 4
    homogeneous_instances: int = 12  # the homogeneous deployment's
    knowledge: str = "events"
    event_delay_s: float = 0.05
    max_index_entries: int = 1 << 22
    cache_bytes: int = 512 * GB
    ttft_p90_s: float | None = None  # the objective; None: slo_factor x light-load P90
    slo_factor: float = 3.0
    min_ttft_p90_s: float = 1.0  # the derived objective is at least this (an interactive SLO)
    warmup: float = 0.1
    steps: int = 7  # bisection steps once the rate is bracketed

    def __post_init__(self) -> None:
        model(self.model), accelerator(self.local_hw), accelerator(self.remote_hw)
        for name in ("local_instances", "homogeneous_instances"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2 (a prefill and a decode instance)")
        if self.remote_instances < 1:
            raise ValueError(f"remote_instances must be >= 1, got {self.remote_instances}")
        if self.ttft_p90_s is not None and not self.ttft_p90_s > 0:
            raise ValueError(f"ttft_p90_s must be > 0, got {self.ttft_p90_s!r}")
        if not self.slo_factor > 1 or not 0 <= self.warmup < 1 or self.steps < 1:
            raise ValueError("slo_factor > 1, warmup in [0, 1) and steps >= 1 needed")


def demands(cfg: PlanConfig, workload: Workload, *, remote: bool = True) -> dict[str, np.ndarray]:
    """Per request: local and remote prefill seconds, link bytes, decode instance-seconds
    (a prefix an earlier turn of the session stored assumed cached, as far as whole blocks
    go)."""
    m = model(cfg.model)
    loc = Instance(model=m, hw=accelerator(cfg.local_hw))
    rem = Instance(model=m, hw=accelerator(cfg.remote_hw))
    pool, batch = loc.kv_pool_bytes, loc.max_batch
    rows = []
    for s in workload.sessions:
        for k, t in enumerate(s.turns):
            c = min(t.shared, t.prompt - 1) // 256 * 256 if k else 0  # stored by an earlier turn
            kv = m.kv_bytes(t.prompt + t.output)
            step = loc.decode_step_for(min(pool, batch * kv))  # a batch of requests like it
            rows.append((loc.prefill_s(t.prompt - c, c), rem.prefill_s(t.prompt - c, c),
                         m.kv_bytes_per_token * (t.prompt - c) + m.state_bytes(t.prompt),
                         t.output * step * max(1 / batch, kv / pool), t.prompt - c))
    a = np.array(rows, dtype=np.float64)
    return {"local_s": a[:, 0], "remote_s": a[:, 1], "link_bytes": a[:, 2],
            "decode_s": a[:, 3], "new_tokens": a[:, 4]}


def fluid_capacity(dem: dict[str, np.ndarray], kind: str, *, local_prefill: int, decode: int,
                   remote: int, link_bps: float, min_remote_tokens: int = 0) -> float:
    """Requests/s the deployment could carry if work were fluid (see the module docstring);
    ``selective`` sends remote only prompts with at least ``min_remote_tokens`` not cached."""
    n = len(dem["local_s"])
    dec = decode / dem["decode_s"].mean()
    if kind == "homogeneous":
        return min(local_prefill / dem["local_s"].mean(), dec)
    if kind == "naive":
        return min(remote / dem["remote_s"].mean(), link_bps / dem["link_bytes"].mean(), dec)
    eligible = dem["new_tokens"] >= min_remote_tokens
    order = np.argsort(-dem["new_tokens"], kind="stable")  # longest first to the remote
    order = order[:int(eligible.sum())]  # what the router may send there
    r_s = np.r_[0.0, np.cumsum(dem["remote_s"][order])] / n
    r_b = np.r_[0.0, np.cumsum(dem["link_bytes"][order])] / n
    l_s = (dem["local_s"].sum() - np.r_[0.0, np.cumsum(dem["local_s"][order])]) / n
    with np.errstate(divide="ignore"):
        caps = np.minimum.reduce([np.where(r_s > 0, remote / r_s, np.inf),
                                  np.where(r_b > 0, link_bps / r_b, np.inf),
                                  np.where(l_s > 0, local_prefill / l_s, np.inf)])
    return float(min(caps.max(), dec))


def plan_split(cfg: PlanConfig, kind: str, dem: dict[str, np.ndarray]) -> tuple[int, float]:
    """(local prefill instances, fluid capacity in requests/s) for deployment ``kind``."""
    total = cfg.homogeneous_instances if kind == "homogeneous" else cfg.local_instances
    choices = [0] if kind == "naive" else range(1, total)
    least = min_offload_tokens(cfg) if kind == "selective" else 0
    best = max((fluid_capacity(dem, kind, local_prefill=p, decode=total - p,
                               remote=cfg.remote_instances, link_bps=cfg.link.bandwidth_bps,
                               min_remote_tokens=least), -p) for p in choices)
    return -best[1], best[0]


def deployment(cfg: PlanConfig, kind: str, local_prefill: int) -> Deployment:
    m = model(cfg.model)
    return Deployment(
        kind=kind, model=m, local_hw=accelerator(cfg.local_hw),
        local_instances=cfg.homogeneous_instances if kind == "homogeneous"
        else cfg.local_instances, local_prefill=local_prefill,
        remote_hw=None if kind == "homogeneous" else accelerator(cfg.remote_hw),
        remote_instances=0 if kind == "homogeneous" else cfg.remote_instances,
        link=None if kind == "homogeneous" else cfg.link, knowledge=cfg.knowledge,
        event_delay_s=cfg.event_delay_s, max_index_entries=cfg.max_index_entries,
        cache_bytes=cfg.cache_bytes,
        min_offload_tokens=min_offload_tokens(cfg) if kind == "selective" else 0)


def min_offload_tokens(cfg: PlanConfig) -> int:
    """The shortest uncached prompt worth sending remote: below it the remote instance plus
    the link at its nominal bandwidth is slower than a local instance even when both are idle
    (searched in steps of 25% up to the model's window)."""
    m = model(cfg.model)
    loc = Instance(model=m, hw=accelerator(cfg.local_hw))
    rem = Instance(model=m, hw=accelerator(cfg.remote_hw))
    bw = cfg.link.bandwidth_bps
    n = 16
    while n < m.context_window:
        nbytes = m.kv_bytes(n)
        remote = max(rem.prefill_s(n, 0) + nbytes / m.layers / bw, nbytes / bw) \
            + cfg.link.latency_s
        if remote < loc.prefill_s(n, 0) + m.kv_bytes(n) / 400e9:
            return n
        n = n * 5 // 4
    return m.context_window


def summarize(res: SimResult, *, warmup: float) -> dict[str, object]:
    """TTFT percentiles, hits, link and instance use of one simulation."""
    reqs = sorted(res.requests, key=lambda r: r.arrival_s)
    measured = reqs[int(warmup * len(reqs)):]
    ttft = np.array([r.ttft_s for r in measured])
    d = res.deployment
    block = d.block_tokens
    prefixed = [r for r in measured if r.turn and min(r.shared, r.prompt - 1) >= block]
    arr = [r.arrival_s for r in reqs]
    lo, hi = arr[len(arr) // 10], arr[(len(arr) * 9) // 10]  # the middle 80% of arrivals
    pf = res.prefillers
    out: dict[str, object] = {
        "requests": len(reqs), "measured": len(measured),
        "offered_rps": ((len(arr) * 9) // 10 - len(arr) // 10) / max(hi - lo, 1e-9),
        "ttft_s": {"p50": float(np.percentile(ttft, 50)), "p90": float(np.percentile(ttft, 90)),
                   "p99": float(np.percentile(ttft, 99)), "mean": float(ttft.mean())},
        "hit_rate": float(np.mean([r.cached > 0 for r in prefixed])) if prefixed else None,
        "token_reuse": sum(r.cached for r in prefixed) / max(1, sum(
            min(r.shared, r.prompt - 1) // block * block for r in prefixed)),
        "router_wrong": float(np.mean([r.believed != r.cached for r in measured])),
        "remote_share": float(np.mean([r.remote for r in measured])),
        "local_prefill_busy": _busy([p for p in pf if not p.remote], res.makespan_s),
        "remote_prefill_busy": _busy([p for p in pf if p.remote], res.makespan_s),
        "makespan_s": res.makespan_s, "events": res.view_stats,
    }
    if res.link is not None:
        out["link"] = {"bytes": res.link.bytes_sent, "transfers": res.link.transfers,
                       "utilisation": res.link.utilisation(res.makespan_s),
                       "mean_gbps": res.link.trace.mean(0.0, res.makespan_s) / GBIT}
    return out


def _busy(ps: list, span: float) -> float | None:
    return sum(p.busy_s for p in ps) / (len(ps) * span) if ps and span > 0 else None


def simulate(d: Deployment, workload: Workload, *, warmup: float) -> dict[str, object]:
    return summarize(Simulation(d, workload).run(), warmup=warmup)


def max_rate(d: Deployment, workload: Workload, objective_s: float, *, guess_rps: float,
             warmup: float, steps: int, max_doublings: int = 10) -> dict[str, object]:
    """The highest session rate whose P90 TTFT meets ``objective_s`` (see the module
    docstring), starting from the rate that offers about ``guess_rps`` requests/s. If the
    objective is still met after ``max_doublings`` doublings the answer is that rate, marked
    ``bounded: False``."""
    tried: list[dict[str, float]] = []

    def point(rate: float) -> tuple[bool, dict]:
        s = simulate(d, workload.at_rate(rate), warmup=warmup)
        p90 = s["ttft_s"]["p90"]  # type: ignore[index]
        tried.append({"session_rate": rate, "offered_rps": s["offered_rps"], "p90_s": p90})
        return p90 <= objective_s, s

    rate = max(workload.rate_for(guess_rps), 1e-9)
    good, s = point(rate)
    lo, hi, best, bounded = None, None, None, True
    if good:
        lo, best = rate, s
        for _ in range(max_doublings):
            good, s = point(lo * 2)
            if not good:
                hi = lo * 2
                break
            lo, best = lo * 2, s
        else:
            bounded = False
    else:
        hi = rate
        for _ in range(max_doublings):
            good, s = point(hi / 2)
            if good:
                lo, best = hi / 2, s
                break
            hi /= 2
    if best is None:
        return {"reached": False, "objective_s": objective_s, "tried": tried}
    for _ in range(steps if bounded else 0):
        mid = math.sqrt(lo * hi)
        good, s = point(mid)
        if good:
            lo, best = mid, s
        else:
            hi = mid
    return {"reached": True, "bounded": bounded, "objective_s": objective_s,
            "session_rate": lo, "rps": best["offered_rps"], "at_max": best, "tried": tried}


def objective(cfg: PlanConfig, workload: Workload, dem: dict[str, np.ndarray]) -> float:
    if cfg.ttft_p90_s is not None:
        return cfg.ttft_p90_s
    p, cap = plan_split(cfg, "homogeneous", dem)
    light = workload.at_rate(workload.rate_for(0.1 * cap))
    s = simulate(deployment(cfg, "homogeneous", p), light, warmup=cfg.warmup)
    return max(cfg.slo_factor * s["ttft_s"]["p90"], cfg.min_ttft_p90_s)  # type: ignore[index]


def compare(cfg: PlanConfig, workload: Workload) -> dict[str, object]:
    """Throughput at the objective of each deployment, and P90 TTFT of each at the
    homogeneous deployment's throughput, where each also runs with the other knowledge
    (global if ``cfg.knowledge`` is events): hit rates of placement by events and by global
    knowledge side by side."""
    dem = demands(cfg, workload)
    obj = objective(cfg, workload, dem)
    out: dict[str, object] = {"objective_p90_s": obj, "deployments": {}}
    for kind in ("homogeneous", "naive", "selective"):
        p, cap = plan_split(cfg, kind, dem)
        d = deployment(cfg, kind, p)
        res = max_rate(d, workload, obj, guess_rps=cap, warmup=cfg.warmup, steps=cfg.steps)
        out["deployments"][kind] = {"local_prefill": p, "decode": d.decode_instances,
                                    "remote_prefill": d.remote, "fluid_rps": cap,
                                    "min_offload_tokens": d.min_offload_tokens, **res}
    deps = out["deployments"]
    base = deps["homogeneous"]
    if base["reached"]:
        load = base["session_rate"]
        other = "global" if cfg.knowledge == "events" else "events"
        for kind, v in deps.items():
            at = workload.at_rate(load)
            v["at_homogeneous_load"] = simulate(deployment(cfg, kind, v["local_prefill"]), at,
                                                warmup=cfg.warmup)
            o = simulate(deployment(replace(cfg, knowledge=other), kind, v["local_prefill"]),
                         at, warmup=cfg.warmup)
            v[f"with_{other}_knowledge"] = {k: o[k] for k in ("hit_rate", "token_reuse",
                                                             "ttft_s", "remote_share")}
        p90_base = deps["homogeneous"]["at_homogeneous_load"]["ttft_s"]["p90"]
        for v in deps.values():
            v["throughput_vs_homogeneous"] = v["rps"] / base["rps"] - 1 if v["reached"] \
                else None
            v["p90_vs_homogeneous"] = v["at_homogeneous_load"]["ttft_s"]["p90"] / p90_base - 1
    return out


def crossover(cfg: PlanConfig, workload: Workload, bandwidths_gbps: list[float], *,
              objective_s: float, homogeneous_rps: float) -> dict[str, object]:
    """Throughput at the objective of the selective and naive deployments per link
    bandwidth, and the bandwidth from which each beats the homogeneous deployment's
    ``homogeneous_rps``."""
    points = []
    for gbps in sorted(bandwidths_gbps):
        c = replace(cfg, link=cfg.link.with_bandwidth(gbps * GBIT))
        dem = demands(c, workload)
        row: dict[str, object] = {"gbps": gbps}
        for kind in ("selective", "naive"):
            p, cap = plan_split(c, kind, dem)
            r = max_rate(deployment(c, kind, p), workload, objective_s, guess_rps=cap,
                         warmup=c.warmup, steps=max(3, c.steps - 2))
            row[kind] = r["rps"] if r["reached"] else 0.0
            row[f"{kind}_vs_homogeneous"] = row[kind] / homogeneous_rps - 1
            row[f"{kind}_link_utilisation"] = r["at_max"]["link"]["utilisation"] \
                if r["reached"] else None
        points.append(row)
    return {"points": points, "homogeneous_rps": homogeneous_rps,
            "selective_crossover_gbps": _cross(points, "selective", homogeneous_rps),
            "naive_crossover_gbps": _cross(points, "naive", homogeneous_rps)}


def _cross(points: list[dict], kind: str, base: float) -> float | None:
    """The lowest bandwidth from which ``kind`` beats ``base`` (log-interpolated between the
    sweep's points); None if it never does, the first point's if it always does."""
    prev = None
    for p in points:
        if p[kind] >= base:
            if prev is None:
                return p["gbps"]
            f = (base - prev[kind]) / (p[kind] - prev[kind])
            return float(math.exp(math.log(prev["gbps"]) + f * (
                math.log(p["gbps"]) - math.log(prev["gbps"]))))
        prev = p
    return None


def config_dict(cfg: PlanConfig) -> dict[str, object]:
    return {**asdict(cfg), "model_shape": asdict(model(cfg.model)),
            "local_accelerator": asdict(accelerator(cfg.local_hw)),
            "remote_accelerator": asdict(accelerator(cfg.remote_hw))}
