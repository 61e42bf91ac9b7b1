"""Cost model of the simulated mode: compute and transfer times, capacities and prices.

Presets follow AttentionStore §4.1: four A100s (312 TFLOPS bf16, 2 TB/s HBM each) over PCIe Gen4
(26 GB/s effective), 128 GB DRAM and 2 or 10 TB of SSD, AWS on-demand prices. KV bytes per token
are the models' own (LLaMA-13B 0.78 MiB, LLaMA-65B 2.5 MiB, LLaMA-70B 0.31 MiB with GQA,
Falcon-40B 0.12 MiB with 8 KV heads). Prefill time is FLOP-bound at a fixed utilisation; a
decode step reads the weights and every running job's KV from HBM. ``smollm2-cpu`` is this
machine running SmolLM2 on 2 cores, calibrated from real mode (bench/replay_calibration.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

GB = 10**9
TB = 10**12
MiB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Times in seconds, sizes in bytes, prices in dollars per hour."""

    name: str
    num_layers: int
    token_bytes: int  # KV bytes per token (keys + values, all layers)
    context_window: int
    prefill_s_per_token: float  # linear part of prefill (weights' FLOPs)
    prefill_s_per_pair: float  # attention part: per (new token, context token) pair
    prefill_s_fixed: float = 0.0  # per job (framework overhead; matters on a CPU)
    decode_step_s: float  # one decode iteration's fixed cost (weights read from HBM)
    decode_s_per_token: float  # per token of KV each running job attends over in a step
    dram_to_hbm_bps: float  # bytes/s
    disk_to_dram_bps: float  # bytes/s (also the background prefetch rate)
    hbm_kv_bytes: int  # HBM left for the running jobs' KV (bounds the decode batch)
    max_batch: int  # running jobs at most (continuous batching)
    max_prefill_tokens: int  # tokens computed per prefill iteration (at least one job)
    dram_bytes: int
    disk_bytes: int
    gpus: int
    gpu_price_h: float = 5.0  # per GPU
    dram_price_gb_h: float = 0.0088
    disk_price_gb_h: float = 0.000082
    # A shared remote tier (engine.replay.multi): its link's bandwidth and per-fetch latency.
    remote_bps: float = 12.5e9  # 100 Gbit/s (RDMA-class, as Mooncake's transfer engine)
    remote_latency_s: float = 0.0005

    def __post_init__(self) -> None:
        for name in ("num_layers", "token_bytes", "context_window", "max_batch",
                     "max_prefill_tokens", "gpus"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("dram_bytes", "disk_bytes", "hbm_kv_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        for name in ("prefill_s_per_token", "prefill_s_per_pair", "prefill_s_fixed",
                     "decode_step_s",
                     "decode_s_per_token", "gpu_price_h", "dram_price_gb_h", "disk_price_gb_h"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not (isinstance(self.remote_latency_s, int | float)
                and math.isfinite(self.remote_latency_s) and self.remote_latency_s >= 0):
            raise ValueError(f"remote_latency_s must be a finite number >= 0, "
                             f"got {self.remote_latency_s!r}")
        for name in ("dram_to_hbm_bps", "disk_to_dram_bps", "remote_bps"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and v > 0):
                raise ValueError(f"{name} must be positive, got {v!r}")

    # -------------------------------------------------------------- derived
    def prefill_s(self, new: int, context: int) -> float:
        """Compute time of prefilling ``new`` tokens on top of ``context`` cached ones."""
        pairs = new * context + new * (new + 1) / 2  # causal attention
        return (self.prefill_s_fixed + new * self.prefill_s_per_token
                + pairs * self.prefill_s_per_pair)

    def load_s(self, tokens: int, tier: str) -> float:
        """Time to bring the KV of ``tokens`` to the accelerator from ``tier``."""
        lat = self.load_latency_s(tier) if tokens > 0 else 0.0
        return lat + tokens * self.token_bytes / self.tier_bps(tier)

    def load_s_per_token(self, tier: str) -> float:
        """Seconds per token of KV from ``tier`` (no fixed latency)."""
        return self.token_bytes / self.tier_bps(tier)

    def tier_bps(self, tier: str) -> float:
        """Bytes/s of KV from ``tier`` to the accelerator: ``dram`` over PCIe; ``disk`` -> DRAM
        -> HBM and ``remote`` -> DRAM -> HBM are pipelined, so the slower link bounds them."""
        if tier == "dram":
            return self.dram_to_hbm_bps
        if tier == "disk":
            return min(self.disk_to_dram_bps, self.dram_to_hbm_bps)
        if tier == "remote":
            return min(self.remote_bps, self.dram_to_hbm_bps)
        raise ValueError(f"tier must be 'dram', 'disk' or 'remote', got {tier!r}")

    def load_latency_s(self, tier: str) -> float:
        """Fixed time of one load from ``tier`` (the remote round trip; 0 for local tiers)."""
        self.tier_bps(tier)  # validates the name
        return self.remote_latency_s if tier == "remote" else 0.0

    def exposed_load_s(self, load_s: float, compute_s: float) -> float:
        """Load time left visible by layer-wise pre-loading: the first layer always waits; the
        rest overlaps the prefill of the previous layers (AttentionStore §3.2.1)."""
        first = load_s / self.num_layers
        return first + max(0.0, load_s - first - compute_s)

    def split(self, reused: int, new: int, tier: str, *, head_start_s: float = 0.0
              ) -> tuple[int, float]:
        """Load or compute, per request (Cake: "Compute or Load KV Cache? Why not both?").

        Of a stored prefix of ``reused`` tokens, the first ``m`` are computed from the front
        while the other ``reused - m`` load from ``tier`` from the back; then the ``new`` tokens
        are prefilled over all of them, layer by layer behind the load. The load may have begun
        ``head_start_s`` before the job starts (negative: it can begin only that much after).
        Returns ``(m, seconds from the job's start to its first token)``, ``m`` minimizing
        that time: 0 is load-all, ``reused`` is recompute-all, and in between the two streams
        meet at :meth:`meeting_point`. Never slower than either pure strategy."""
        cn = self.prefill_s(new, reused) if new else self.prefill_s_fixed
        tail = cn / self.num_layers

        def done(m: int) -> float:
            front = self.front_s(m)
            load = self.load_s(reused - m, tier) - head_start_s if m < reused else 0.0
            return max(front + cn, load + tail)

        cands = {0, reused}
        m_star = self.meeting_point(
            reused, tier, budget_s=tail - cn - head_start_s + self.load_latency_s(tier))
        cands.update(x for x in (math.floor(m_star), math.ceil(m_star)) if 0 <= x <= reused)
        best = min(sorted(cands), key=done)
        return best, done(best)

    def front_s(self, m: float) -> float:
        """Compute time of the first ``m`` tokens of a prefix, no fixed cost (inside a job)."""
        return m * self.prefill_s_per_token + m * (m + 1) / 2 * self.prefill_s_per_pair

    def meeting_point(self, reused: int, tier: str, *, budget_s: float = 0.0) -> float:
        """Where compute from the front and load from the back cross (real-valued, clamped to
        ``[0, reused]``): ``front(m) = load(reused - m) + budget_s`` with ``front(m) = a m +
        b m (m + 1) / 2`` (the preset's per-token and per-pair prefill costs) and
        ``load(k) = k * beta`` (seconds per token from ``tier``; a fixed latency belongs in
        ``budget_s``). With ``b = 0`` it is
        ``(reused * beta + budget_s) / (a + beta)``."""
        a, b = self.prefill_s_per_token, self.prefill_s_per_pair
        beta = self.load_s_per_token(tier)
        rhs = reused * beta + budget_s
        lin = a + b / 2 + beta
        m = rhs / lin if b == 0 else (-lin + math.sqrt(max(0.0, lin * lin + 2 * b * rhs))) / b
        return min(max(m, 0.0), float(reused))

    def decode_s(self, steps: int, contexts: int, batch: int) -> float:
        """``steps`` decode iterations of ``batch`` jobs whose KV totals ``contexts`` tokens at
        the start (each step adds one token per job)."""
        mean_ctx = contexts + batch * (steps - 1) / 2
        return steps * (self.decode_step_s + mean_ctx * self.decode_s_per_token)

    def with_capacity(self, *, dram_bytes: int | None = None,
                      disk_bytes: int | None = None) -> CostModel:
        return replace(self, dram_bytes=self.dram_bytes if dram_bytes is None else dram_bytes,
                       disk_bytes=self.disk_bytes if disk_bytes is None else disk_bytes)

    def cost(self, *, gpu_s: float, wall_s: float, cache: bool) -> dict[str, float]:
        """Dollars: accelerator busy time, plus DRAM and disk for the whole run when caching."""
        gpu = gpu_s / 3600 * self.gpus * self.gpu_price_h
        dram = self.dram_bytes / GB * wall_s / 3600 * self.dram_price_gb_h if cache else 0.0
        disk = self.disk_bytes / GB * wall_s / 3600 * self.disk_price_gb_h if cache else 0.0
        return {"gpu": gpu, "dram": dram, "disk": disk, "total": gpu + dram + disk}


def _a100x4(name: str, *, params: float, layers: int, d_model: int, kv_dim: int,
            window: int) -> CostModel:
    """A preset for four A100-80GB at 50% of peak FLOPs and 80% of HBM bandwidth."""
    flops = 4 * 312e12 * 0.5
    hbm = 4 * 2.0e12 * 0.8
    weights = 2 * params  # bf16
    token_bytes = 2 * layers * kv_dim * 2  # K and V, bf16
    return CostModel(
        name=name, num_layers=layers, token_bytes=token_bytes, context_window=window,
        prefill_s_per_token=2 * params / flops,
        prefill_s_per_pair=4 * layers * d_model / flops,
        decode_step_s=weights / hbm, decode_s_per_token=token_bytes / hbm,
        dram_to_hbm_bps=26e9, disk_to_dram_bps=10e9,
        hbm_kv_bytes=int(4 * 80 * GB * 0.9 - weights), max_batch=64, max_prefill_tokens=8192,
        dram_bytes=128 * GB, disk_bytes=10 * TB, gpus=4,
    )


PRESETS: dict[str, CostModel] = {
    "llama-13b": _a100x4("llama-13b", params=13e9, layers=40, d_model=5120, kv_dim=5120,
                         window=4096),
    "llama-65b": _a100x4("llama-65b", params=65e9, layers=80, d_model=8192, kv_dim=8192,
                         window=2048),
    "llama-70b": _a100x4("llama-70b", params=70e9, layers=80, d_model=8192, kv_dim=1024,
                         window=4096),
    "falcon-40b": _a100x4("falcon-40b", params=40e9, layers=60, d_model=8192, kv_dim=512,
                          window=2048),
    # SmolLM2-135M on this 2-core machine: fitted by bench/replay_calibration.py from a real-mode
    # replay (docs/benchmarks.md). One job at a time (the CPU runtime does not batch).
    "smollm2-cpu": CostModel(
        name="smollm2-cpu", num_layers=30, token_bytes=30 * 2 * 3 * 64 * 2, context_window=8192,
        prefill_s_per_token=1.72e-3, prefill_s_per_pair=6.2e-7, prefill_s_fixed=0.123,
        decode_step_s=2.7e-3,
        decode_s_per_token=0.0, dram_to_hbm_bps=5e9, disk_to_dram_bps=1e9,
        hbm_kv_bytes=1 << 30, max_batch=1, max_prefill_tokens=8192,
        dram_bytes=1 << 30, disk_bytes=64 << 30, gpus=1, gpu_price_h=0.1,
    ),
}


def preset(name: str) -> CostModel:
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]


def parse_bytes(text: str) -> int:
    """``"128GB"``, ``"2TB"``, ``"512MiB"``, ``"0"`` -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": GB, "TB": TB,
             "KIB": 1 << 10, "MIB": MiB, "GIB": 1 << 30, "TIB": 1 << 40}
    s = text.strip().upper()
    num = s.rstrip("KMGTIB")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 128GB, 2TB, 512MiB)") from None
    if unit not in units or value < 0:
        raise ValueError(f"not a size: {text!r} (e.g. 128GB, 2TB, 512MiB)")
    return int(value * units[unit])
