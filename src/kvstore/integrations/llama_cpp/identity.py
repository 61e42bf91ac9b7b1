"""What computed a llama.cpp context's KV bytes, read from a loaded ``llama_cpp.Llama``: the
:class:`~kvstore.integrations.llama_cpp.state.StateFormat` of its states and the
:class:`~kvstore.KVLayout` its KV is stored under.

The layout's ``model_id`` is the GGUF file's content hash, and its ``engine`` names the
llama.cpp build (llama-cpp-python's version, which pins the llama.cpp source, and the CPU
features it was compiled with), the flash-attention mode, the KV type and every context
setting that changes the bytes (RoPE overrides, metadata overrides): the layout's fingerprint
seeds every chunk address, so stored KV is only ever served to a llama.cpp that would have
computed those same bytes. Keys are stored rotated, as llama.cpp holds them
(``keys="rotated"``).

Hybrid models (:data:`HYBRID_ARCHS`: sliding-window attention beside full attention, or
recurrent layers beside attention) are stored as their full-attention KV plus a boundary state,
the partial part of llama.cpp's sequence state (:mod:`.partial`), whose structure is learned
from a state llama.cpp writes in a scratch context of the same model and settings. The
layout's ``layers`` then lists the full-attention layers, then the sliding or recurrent ones,
as the state's sections hold them (not in model order: the GGUF's hash in ``model_id`` pins
which layer is which).

Models and settings whose KV this codec has not been verified against are refused with
:class:`Unsupported` naming the reason: architectures other than those in
:data:`SUPPORTED_ARCHS` and :data:`HYBRID_ARCHS` (among them purely recurrent models and
models whose every attention layer is sliding: no full-attention KV to key the store by),
M-RoPE and per-layer-embedding models (their cells carry extras), several streams, quantized
KV types, LoRA adapters, embedding contexts, ``logits_all=True`` (a restored prefix has no
prompt logits for logprobs), and a flash-attention mode llama.cpp chooses itself.
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass
from typing import Any

import xxhash

from kvstore.integrations.llama_cpp import compat
from kvstore.integrations.llama_cpp.partial import (
    PartialFormat,
    RecurrentShape,
    SlidingShape,
    learn,
)
from kvstore.integrations.llama_cpp.state import KV_TYPES, StateError, StateFormat, type_name
from kvstore.layout import KVLayout, LayerKind, StateTensor

# architectures whose memory is llama.cpp's plain KV cache, with the state layout verified
SUPPORTED_ARCHS = frozenset({"llama"})
# hybrid architectures whose sequence states are verified here (tests/kvstore/integrations/
# llama_cpp/test_llama_hybrid.py), by what they keep besides full-attention KV
HYBRID_ARCHS = {"gemma3": "sliding", "granitehybrid": "recurrent", "qwen3next": "recurrent",
                "lfm2": "recurrent", "falcon-h1": "recurrent"}
_STATE_DTYPES = {0: "float32", 1: "float16", 30: "bfloat16"}
_ROPE_NORM, _ROPE_NEOX = 0, 2
_FA_DISABLED, _FA_ENABLED = 0, 1
_HASH_BLOCK = 8 << 20


class Unsupported(StateError):
    """A model or context setting whose KV this integration does not store (the message says
    which and why); the Llama then runs without the cache."""


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What llama.cpp reports about a loaded model and its context, as far as it decides the
    KV state's layout and bytes."""

    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd: int
    key_length: int  # head size of K (GGUF ``<arch>.attention.key_length`` or n_embd / n_head)
    value_length: int
    uniform_heads: bool  # one kv-head count for every layer
    n_swa: int
    recurrent: bool
    hybrid: bool
    rope_type: int
    per_layer_embeddings: bool  # ``<arch>.ple.*`` metadata: cells carry the token id
    n_seq_max: int
    kv_unified: bool
    type_k: int
    type_v: int
    flash_attn_type: int  # -1 auto, 0 disabled, 1 enabled
    embeddings: bool
    logits_all: bool
    lora: bool
    settings: tuple[tuple[str, str], ...]  # context settings that change the bytes, as text

    def boundary_kind(self) -> str | None:
        """What the model keeps besides full-attention KV: None (nothing: a plain KV cache),
        ``"sliding"`` or ``"recurrent"``; :class:`Unsupported` for an architecture whose state
        is not verified here."""
        kind = HYBRID_ARCHS.get(self.arch)
        if kind is None and self.arch not in SUPPORTED_ARCHS:
            what = ("a recurrent model (no full-attention layer)" if self.recurrent else
                    f"architecture {self.arch!r}")
            raise Unsupported(f"{what}: its KV state layout is not verified with this codec "
                              f"(supported: {sorted(SUPPORTED_ARCHS | set(HYBRID_ARCHS))})")
        if kind is None and (self.recurrent or self.hybrid or self.n_swa > 0):
            raise Unsupported(f"architecture {self.arch!r} with sliding-window or recurrent "
                              f"layers: its state layout is not verified with this codec")
        if kind == "sliding" and self.n_swa <= 0:
            return None  # configured without a window: every layer is full attention
        if kind == "recurrent" and not self.hybrid:
            raise Unsupported(f"a {self.arch} model without attention layers keeps recurrent "
                              f"state only: no full-attention KV to key the store by")
        return kind

    def state_format(self, *, num_layers: int | None = None,
                     num_kv_heads: int | None = None) -> StateFormat:
        """The format of this context's states (of the full-attention layers: with
        ``num_layers`` and ``num_kv_heads`` learned from a state for a hybrid model);
        :class:`Unsupported` naming the first reason the codec cannot take them."""
        hybrid = num_layers is not None
        if not hybrid:
            self.boundary_kind()
            if not self.uniform_heads:
                raise Unsupported("kv-head counts differ between layers")
        if self.rope_type not in (_ROPE_NORM, _ROPE_NEOX):
            raise Unsupported(f"RoPE type {self.rope_type} (M-RoPE or vision): its cells carry "
                              f"2D positions")
        if self.per_layer_embeddings:
            raise Unsupported("per-layer token embeddings: its cells carry token ids")
        if self.key_length != self.value_length:
            raise Unsupported(f"K and V head sizes differ ({self.key_length} and "
                              f"{self.value_length})")
        if self.n_seq_max != 1 and not self.kv_unified:
            raise Unsupported(f"{self.n_seq_max} sequences in separate streams "
                              f"(kv_unified=False): only one stream is supported")
        if self.embeddings:
            raise Unsupported("an embedding context (embedding=True) computes no reusable KV")
        if self.logits_all:
            raise Unsupported("logits_all=True: a restored prefix would have no logits for "
                              "the prompt's logprobs")
        if self.lora:
            raise Unsupported("a LoRA adapter changes the KV; its content is not part of the "
                              "identity")
        if self.type_k != self.type_v:
            raise Unsupported(f"K and V types differ ({type_name(self.type_k)} and "
                              f"{type_name(self.type_v)})")
        if self.type_k not in KV_TYPES:
            raise Unsupported(f"KV type {type_name(self.type_k)}: only f32, f16 and bf16 KV "
                              f"is stored")
        if self.flash_attn_type not in (_FA_DISABLED, _FA_ENABLED):
            raise Unsupported(f"flash_attn_type={self.flash_attn_type}: llama.cpp chooses the "
                              f"mode itself, and the state layout depends on it")
        return StateFormat(arch=self.arch, num_layers=num_layers or self.n_layer,
                           num_kv_heads=num_kv_heads or self.n_head_kv,
                           head_dim=self.key_length, kv_type=self.type_k,
                           v_trans=self.flash_attn_type == _FA_DISABLED)


@dataclass(frozen=True, kw_only=True)
class Identity:
    """A context's state format (of its full-attention KV), what a boundary keeps besides it
    (``partial``, hybrid models; None otherwise) and the KVLayout it is stored under."""

    format: StateFormat
    layout: KVLayout
    partial: PartialFormat | None = None


def model_facts(llm: Any) -> ModelFacts:
    """The facts of a loaded ``llama_cpp.Llama``. Thread-safety: reads only; call it while
    no other thread closes ``llm``."""
    import llama_cpp

    model, ctx, cp = llm.model, llm.ctx, llm.context_params
    meta: dict[str, str] = dict(llm.metadata)
    arch = meta.get("general.architecture", "")
    n_head = llama_cpp.llama_model_n_head(model)
    n_embd = llama_cpp.llama_model_n_embd(model)
    default = n_embd // n_head if n_head > 0 else 0
    settings = (
        ("rope_scaling_type", str(cp.rope_scaling_type)),
        ("rope_freq_base", repr(cp.rope_freq_base)),
        ("rope_freq_scale", repr(cp.rope_freq_scale)),
        ("yarn_ext_factor", repr(cp.yarn_ext_factor)),
        ("yarn_attn_factor", repr(cp.yarn_attn_factor)),
        ("yarn_beta_fast", repr(cp.yarn_beta_fast)),
        ("yarn_beta_slow", repr(cp.yarn_beta_slow)),
        ("yarn_orig_ctx", str(cp.yarn_orig_ctx)),
        ("attention_type", str(cp.attention_type)),
        ("kv_overrides", repr(sorted((llm.kv_overrides or {}).items()))),
    )
    return ModelFacts(
        arch=arch,
        n_layer=llama_cpp.llama_model_n_layer(model),
        n_head=n_head,
        n_head_kv=llama_cpp.llama_model_n_head_kv(model),
        n_embd=n_embd,
        key_length=_int(meta.get(f"{arch}.attention.key_length"), default),
        value_length=_int(meta.get(f"{arch}.attention.value_length"), default),
        uniform_heads=_is_int(meta.get(f"{arch}.attention.head_count_kv", "0")),
        n_swa=llama_cpp.llama_model_n_swa(model),
        recurrent=bool(llama_cpp.llama_model_is_recurrent(model)),
        hybrid=bool(llama_cpp.llama_model_is_hybrid(model)),
        rope_type=llama_cpp.llama_model_rope_type(model),
        per_layer_embeddings=any(k.startswith(f"{arch}.ple.") for k in meta),
        n_seq_max=llama_cpp.llama_n_seq_max(ctx),
        kv_unified=bool(cp.kv_unified),
        type_k=int(cp.type_k),
        type_v=int(cp.type_v),
        flash_attn_type=int(cp.flash_attn_type),
        embeddings=bool(cp.embeddings),
        logits_all=compat.logits_all(llm),
        lora=llm.lora_path is not None,
        settings=settings,
    )


def identify(llm: Any) -> Identity:
    """The state format and store layout of ``llm``'s context; :class:`Unsupported` if its KV
    is not stored. Hashes the GGUF file once per process (see :func:`gguf_digest`)."""
    import llama_cpp

    facts = model_facts(llm)
    kind = facts.boundary_kind()
    partial = None
    if kind is None:
        fmt = facts.state_format()
    else:
        fmt, partial = _hybrid_formats(llm, facts, kind)
    meta = dict(llm.metadata)
    theta = _float(meta.get(f"{facts.arch}.rope.freq_base"), 10000.0)
    if float(llm.context_params.rope_freq_base) > 0:  # the context overrides the model's
        theta = float(llm.context_params.rope_freq_base)
    system = llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()
    engine = "; ".join([
        f"llama.cpp of llama-cpp-python {llama_cpp.__version__}",
        f"flash_attn={'off' if fmt.v_trans else 'on'}",
        f"kv={type_name(fmt.kv_type)}",
        f"arch={fmt.arch}",
        *(f"{k}={v}" for k, v in facts.settings),
        f"system={system}",
    ])
    layout = KVLayout(num_layers=fmt.num_layers, num_kv_heads=fmt.num_kv_heads,
                      head_dim=fmt.head_dim, dtype=fmt.dtype, rope_theta=theta,
                      model_id=f"gguf-xxh3-128:{gguf_digest(llm.model_path)}",
                      keys="rotated", engine=engine,
                      layers=None if partial is None else _layer_kinds(fmt, partial),
                      state_bytes=0 if partial is None else partial.max_bytes)
    return Identity(format=fmt, layout=layout, partial=partial)


def _hybrid_formats(llm: Any, facts: ModelFacts, kind: str
                    ) -> tuple[StateFormat, PartialFormat]:
    """The full-attention layers' format and the partial format of a hybrid model, from the
    sequence state of one token llama.cpp writes in a scratch context (:func:`.partial.learn`):
    its base section says how many full-attention layers there are and their rows."""
    facts.state_format(num_layers=1, num_kv_heads=1)  # the settings' own checks first
    whole, partial = learn(llm, kind=kind, window=facts.n_swa)
    base = whole[: len(whole) - (partial.max_bytes if kind == "recurrent" else
                                 partial.shape.size(1))]  # type: ignore[union-attr]
    try:
        n_stream, cells = struct.unpack_from("<II", base, 8)
        _, n_layer = struct.unpack_from("<II", base, 16 + 12 * cells)
        k_type, k_row = struct.unpack_from("<iQ", base, 24 + 12 * cells)
    except struct.error:
        raise Unsupported("the sequence state of this model does not parse") from None
    itemsize = KV_TYPES[facts.type_k][1].itemsize if facts.type_k in KV_TYPES else 0
    if n_stream != 1 or cells != 1 or n_layer == 0 or not itemsize \
            or k_row % (facts.key_length * itemsize):
        raise Unsupported(f"the full-attention section of this model's state is not one this "
                          f"codec reads ({n_layer} layers, rows of {k_row} bytes)")
    fmt = facts.state_format(num_layers=n_layer,
                             num_kv_heads=k_row // (facts.key_length * itemsize))
    try:
        fmt.parse_seq(base)  # every full-attention layer alike, as the codec reads them
    except StateError as e:
        raise Unsupported(f"the full-attention layers of this model differ: {e}") from None
    return fmt, partial


def _layer_kinds(fmt: StateFormat, partial: PartialFormat) -> tuple[LayerKind, ...]:
    """The layout's layer kinds of a hybrid: the full-attention layers, then the sliding or
    recurrent ones as the partial section holds them."""
    kinds = [LayerKind()] * fmt.num_layers
    shape = partial.shape
    if isinstance(shape, SlidingShape):
        kinds += [LayerKind(kind="sliding", window=shape.window)] * len(shape.k)
    else:
        assert isinstance(shape, RecurrentShape)
        half = len(shape.rows) // 2
        for r, s in zip(shape.rows[:half], shape.rows[half:], strict=True):
            state = tuple(_tensor(name, f.type, f.row) for name, f in (("r", r), ("s", s))
                          if f.row)  # a short convolution has no S
            kinds.append(LayerKind(kind="recurrent", state=state))
    return tuple(kinds)


def _tensor(name: str, ggml_type: int, nbytes: int) -> StateTensor:
    dtype = _STATE_DTYPES.get(ggml_type, "uint8")
    size = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 1)
    if nbytes % size:
        dtype, size = "uint8", 1
    return StateTensor(name=name, shape=(nbytes // size,), dtype=dtype)


_digests: dict[tuple[int, int, int, int], str] = {}
_digest_lock = threading.Lock()


def gguf_digest(path: str | os.PathLike[str]) -> str:
    """xxh3-128 (hex) of the file's bytes, remembered per (device, inode, size, mtime) for the
    life of the process. Thread-safe."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with _digest_lock:
            known = _digests.get(key)
        if known is not None:
            return known
        h = xxhash.xxh3_128()
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    digest = h.hexdigest()
    with _digest_lock:
        _digests[key] = digest
    return digest


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _int(text: str | None, default: int) -> int:
    return int(text) if text is not None and _is_int(text) else default


def _float(text: str | None, default: float) -> float:
    if text is None:
        return default
    try:
        return float(text)
    except ValueError:
        return default
