"""Cost model of prefill across datacenters: model shapes (dense and hybrid), accelerators, and
what one serving instance of a model on an accelerator costs.

A :class:`ModelShape` holds the published shape of a model; its KV bytes follow from it:
full-attention layers keep ``2 * kv_heads * head_dim`` values per token each (keys and values),
a sliding-window layer the same for at most ``window`` tokens, a linear-attention layer a
recurrent state of fixed size. So a request's KV is ``kv_bytes_per_token * tokens +
state_bytes(tokens)``: the per-token part of the full-attention layers plus a part that stops
growing (linear states, windows). Prefill FLOPs are ``2 * active_params`` per token (every
weight matmul, MoE counted by its activated parameters), plus ``4 * q_heads * head_dim`` per
(query, key) pair of each full-attention layer (QK^T and AV), the pairs of a window layer
limited to ``window`` keys, plus each linear-attention layer's state update and read-out
(``4 * value_heads * key_dim * value_dim`` per token). An :class:`Accelerator` instance
(``gpus`` GPUs) runs prefill at ``mfu`` of its dense BF16 peak, as the replay's other presets
do (engine.replay.costs: 50%), and a decode step reads the weights and the batch's KV from HBM
at ``hbm_efficiency`` of its bandwidth.

Where each number comes from is in :data:`MODELS` / :data:`ACCELERATORS` (``source``) and in
docs/replay.md, "Prefill across datacenters".

Thread-safety: immutable values (derived sizes cached on first use, idempotently).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

GB = 10**9


def _positive(obj: object, *names: str, integer: bool = False, zero: bool = False) -> None:
    for name in names:
        v = getattr(obj, name)
        ok = (isinstance(v, int) and not isinstance(v, bool)) if integer else (
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v))
        if not ok or v < 0 or (v == 0 and not zero):
            raise ValueError(f"{name} must be a {'non-negative' if zero else 'positive'} "
                             f"{'int' if integer else 'number'}, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A model's shape as far as prefill, decode and KV bytes go (see the module docstring)."""

    name: str
    source: str  # where the numbers come from
    active_params: float  # parameters each token goes through (MoE: the activated ones)
    total_params: float  # parameters a decode step reads (every expert, at a large batch)
    full_layers: int  # full-attention layers
    swa_layers: int = 0  # sliding-window attention layers
    window: int = 0  # their window (tokens)
    linear_layers: int = 0  # linear-attention (recurrent) layers
    q_heads: int  # query heads of the attention layers
    kv_heads: int
    head_dim: int
    linear_state_elems: int = 0  # per linear-attention layer: recurrent + convolution state
    linear_flops_per_token: float = 0.0  # per linear-attention layer: state update + read-out
    kv_dtype_bytes: int = 2  # KV cache and states (bf16)
    weight_bytes_per_param: float = 2.0  # bf16; 1 for FP8 weights
    context_window: int

    def __post_init__(self) -> None:
        _positive(self, "active_params", "total_params", "weight_bytes_per_param")
        _positive(self, "full_layers", "q_heads", "kv_heads", "head_dim", "kv_dtype_bytes",
                  "context_window", integer=True)
        _positive(self, "swa_layers", "window", "linear_layers", "linear_state_elems",
                  integer=True, zero=True)
        _positive(self, "linear_flops_per_token", zero=True)
        if (self.swa_layers > 0) != (self.window > 0):
            raise ValueError(f"window must be > 0 exactly when swa_layers > 0, got "
                             f"swa_layers={self.swa_layers}, window={self.window}")
        if (self.linear_layers > 0) != (self.linear_state_elems > 0):
            raise ValueError("linear_state_elems must be > 0 exactly when linear_layers > 0")
        if self.active_params > self.total_params:
            raise ValueError(f"active_params ({self.active_params}) exceeds total_params "
                             f"({self.total_params})")

    @property
    def layers(self) -> int:
        return self.full_layers + self.swa_layers + self.linear_layers

    @property
    def hybrid(self) -> bool:
        """A match of a cached prefix ends only where a fixed-size state was kept."""
        return self.swa_layers > 0 or self.linear_layers > 0

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """Full-attention KV of one token, all full-attention layers (keys and values)."""
        return 2 * self.full_layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes

    @cached_property
    def swa_bytes_per_token(self) -> int:
        return 2 * self.swa_layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def weight_bytes(self) -> int:
        return int(self.total_params * self.weight_bytes_per_param)

    @cached_property
    def linear_state_bytes(self) -> int:
        """Every linear layer's recurrent state, together."""
        return self.linear_layers * self.linear_state_elems * self.kv_dtype_bytes

    def state_bytes(self, tokens: int) -> int:
        """The part of a ``tokens``-long context that stops growing: every linear layer's
        state and every window layer's last ``window`` tokens."""
        if self.swa_layers:
            return self.linear_state_bytes + self.swa_bytes_per_token * min(tokens, self.window)
        return self.linear_state_bytes

    def kv_bytes(self, tokens: int) -> int:
        """Everything a decode needs of a ``tokens``-long context."""
        return self.kv_bytes_per_token * tokens + self.state_bytes(tokens)

    def prefill_flops(self, new: int, cached: int) -> float:
        """FLOPs of prefilling ``new`` tokens after ``cached`` ones (causal)."""
        full_pairs = new * cached + new * (new + 1) / 2
        swa_pairs = _window_pairs(cached + new, self.window) - _window_pairs(cached, self.window)
        attn = 4 * self.q_heads * self.head_dim * (self.full_layers * full_pairs
                                                   + self.swa_layers * swa_pairs)
        return new * (2 * self.active_params + self.linear_layers * self.linear_flops_per_token) \
            + attn


def _window_pairs(n: int, window: int) -> float:
    """Sum over positions ``p < n`` of ``min(p + 1, window)``: the (query, key) pairs of a
    sliding-window layer over the first ``n`` tokens."""
    if window <= 0:
        return 0.0
    if n <= window:
        return n * (n + 1) / 2
    return window * (window + 1) / 2 + (n - window) * window


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """One serving instance's hardware: ``gpus`` GPUs of one kind (tensor/expert parallel)."""

    name: str
    source: str
    bf16_flops: float  # dense BF16 peak per GPU
    hbm_bytes: int  # per GPU
    hbm_bps: float  # per GPU
    gpus: int = 8
    mfu: float = 0.5  # prefill utilisation of the peak (the replay's presets' 50%)
    hbm_efficiency: float = 0.8  # decode's share of the HBM bandwidth
    hbm_usable: float = 0.9  # share of HBM for weights and KV (the rest: activations, runtime)

    def __post_init__(self) -> None:
        _positive(self, "bf16_flops", "hbm_bps")
        _positive(self, "hbm_bytes", "gpus", integer=True)
        for name in ("mfu", "hbm_efficiency", "hbm_usable"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")

    @cached_property
    def prefill_flops_per_s(self) -> float:
        return self.bf16_flops * self.gpus * self.mfu


@dataclass(frozen=True, kw_only=True)
class Instance:
    """A model served on one instance of an accelerator: prefill and decode times, the KV pool
    a decode batch lives in. Thread-safety: an immutable value."""

    model: ModelShape
    hw: Accelerator
    max_batch: int = 256  # decode batch at most

    def __post_init__(self) -> None:
        _positive(self, "max_batch", integer=True)
        if self.kv_pool_bytes <= 0:
            raise ValueError(f"{self.model.name} ({self.model.weight_bytes / GB:.0f} GB of "
                             f"weights) does not fit one {self.hw.gpus}x{self.hw.name} instance")

    @cached_property
    def kv_pool_bytes(self) -> int:
        """HBM left for the running requests' KV once the weights are loaded."""
        return int(self.hw.hbm_bytes * self.hw.gpus * self.hw.hbm_usable) \
            - self.model.weight_bytes

    def prefill_s(self, new: int, cached: int) -> float:
        """Seconds to prefill ``new`` tokens on top of ``cached`` ones (compute-bound)."""
        return self.model.prefill_flops(new, cached) / self.hw.prefill_flops_per_s

    def decode_step_for(self, kv_bytes: int) -> float:
        """One decode iteration of a batch holding ``kv_bytes`` of KV: the weights and that
        KV read from HBM."""
        return (self.model.weight_bytes + min(kv_bytes, self.kv_pool_bytes)) / (
            self.hw.hbm_bps * self.hw.gpus * self.hw.hbm_efficiency)

    def kv_per_s(self, tokens: int) -> float:
        """Bytes/s of KV this instance produces prefilling ``tokens``-long prompts back to
        back: what a link must carry to keep up with it."""
        return self.model.kv_bytes(tokens) / self.prefill_s(tokens, 0)


# Qwen3-Next's gated delta net: per linear layer, 32 value heads x (128 x 128) recurrent state
# plus the short convolution's state (kernel 4: 3 steps) over the q, k, v channels
# (16 x 128 x 2 + 32 x 128 = 8192).
_QWEN3_NEXT_STATE = 32 * 128 * 128 + 3 * (16 * 128 * 2 + 32 * 128)

MODELS: dict[str, ModelShape] = {
    "qwen3-30b-a3b": ModelShape(
        name="qwen3-30b-a3b",
        source="Qwen3 technical report (arXiv 2505.09388) Table 2 and the model's config.json: "
               "48 layers, 32 query / 4 KV heads, head_dim 128, 30.5B parameters, 3.3B "
               "activated, 32K context",
        active_params=3.3e9, total_params=30.5e9, full_layers=48, q_heads=32, kv_heads=4,
        head_dim=128, context_window=32768),
    "qwen3-next-80b-a3b": ModelShape(
        name="qwen3-next-80b-a3b",
        source="config.json of Qwen/Qwen3-Next-80B-A3B-Instruct (transformers' "
               "Qwen3NextConfig defaults): 48 layers, full attention every 4th (12), 16 query "
               "/ 2 KV heads of 256; 36 gated-delta-net layers of 16 key / 32 value heads of "
               "128, conv kernel 4; 80B parameters, 3B activated",
        active_params=3e9, total_params=80e9, full_layers=12, linear_layers=36, q_heads=16,
        kv_heads=2, head_dim=256, linear_state_elems=_QWEN3_NEXT_STATE,
        linear_flops_per_token=4 * 32 * 128 * 128, context_window=262144),
    "gemma3-27b": ModelShape(
        name="gemma3-27b",
        source="Gemma 3 technical report (arXiv 2503.19786: 5 local layers per global one, "
               "local window 1024) and config.json of google/gemma-3-27b-it: 62 layers "
               "(10 global, 52 sliding), 32 query / 16 KV heads of 128; 27B parameters",
        active_params=27e9, total_params=27e9, full_layers=10, swa_layers=52, window=1024,
        q_heads=32, kv_heads=16, head_dim=128, context_window=131072),
    "minimax-text-01": ModelShape(
        name="minimax-text-01",
        source="MiniMax-01 report (arXiv 2501.08313) and config.json of "
               "MiniMaxAI/MiniMax-Text-01: 80 layers, one softmax-attention layer after every "
               "7 lightning-attention layers (10 and 70), 64 query heads of 128, GQA groups "
               "of 8 (8 KV heads); 456B parameters, 45.9B activated. Weights in FP8 here "
               "(1 byte per parameter) so that it fits one 8-GPU H20 instance",
        active_params=45.9e9, total_params=456e9, full_layers=10, linear_layers=70,
        q_heads=64, kv_heads=8, head_dim=128, linear_state_elems=64 * 128 * 128,
        linear_flops_per_token=4 * 64 * 128 * 128, weight_bytes_per_param=1.0,
        context_window=1_000_000),
}

ACCELERATORS: dict[str, Accelerator] = {
    "h20": Accelerator(name="h20", source="NVIDIA H20 (HGX): 148 TFLOPS dense BF16, 96 GB "
                       "HBM3 at 4.0 TB/s per GPU", bf16_flops=148e12, hbm_bytes=96 * GB,
                       hbm_bps=4.0e12),
    "h200": Accelerator(name="h200", source="NVIDIA H200 SXM datasheet: 989 TFLOPS dense BF16 "
                        "(1,979 with sparsity), 141 GB HBM3e at 4.8 TB/s per GPU",
                        bf16_flops=989e12, hbm_bytes=141 * GB, hbm_bps=4.8e12),
}


def model(name: str) -> ModelShape:
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    return MODELS[name]


def accelerator(name: str) -> Accelerator:
    if name not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {sorted(ACCELERATORS)}, got {name!r}")
    return ACCELERATORS[name]
