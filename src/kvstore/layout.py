"""KVLayout: the shape and numeric format of one model's KV cache, and its key convention.

A layout's fingerprint seeds every chunk address, so KV of one model is never served to another.

Key conventions (``keys``):

* ``"pre_rope"`` (the default): keys are stored before rotary encoding, and RoPE is applied at
  whatever positions the reader chooses. Truncation, re-positioning and the per-head indexes
  need this.
* ``"rotated"``: keys are stored exactly as an inference engine holds them, RoPE applied at
  their positions 0..T-1 (vLLM, llama.cpp). Reuse is bit-exact at the same positions, and only
  there: every feature that re-positions keys refuses such a layout
  (:meth:`KVLayout.require_pre_rope`, :class:`~kvstore.errors.RotatedKeys`). ``engine`` then
  names what produced the bytes (the engine, its version, its packing or attention mode, its
  KV type: whatever changes them), so KV is only served to an engine that would have computed
  those same bytes; both are part of the fingerprint.

Layer kinds (``layers``, for hybrid models): each of the model's layers is full attention
(its KV kept for every token, in the store's chunks: ``num_layers`` counts these), a sliding
window of ``window`` tokens, or a recurrent state of fixed size (Mamba2, gated delta nets,
short convolutions: :class:`StateTensor` shapes and dtypes). Sliding windows and recurrent
states exist only at the position where they were taken: the store keeps them as a *boundary
state* (at most ``state_bytes``, in the engine's own encoding) tied to one exact token count,
and serves a prefix only up to a boundary whose state it holds
(:mod:`kvstore.view.boundaries`). Every kind, window and state shape is in the fingerprint:
a state of one structure is never served to another. Features that need every layer's KV for
every token (truncation, re-positioning, per-head indexes, the runtime's sessions) refuse such
a layout (:meth:`KVLayout.require_plain`, :class:`~kvstore.errors.HybridLayers`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import xxhash

from kvstore.errors import HybridLayers, RotatedKeys

KEY_CONVENTIONS = ("pre_rope", "rotated")
# dtype name -> (torch dtype, numpy dtype used for raw byte views, bytes per element)
_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float16": (torch.float16, np.dtype(np.float16)),
    "bfloat16": (torch.bfloat16, np.dtype(np.uint16)),  # numpy has no bf16: viewed as raw u16
    "float32": (torch.float32, np.dtype(np.float32)),
}
KV_DTYPES = tuple(_DTYPES)  # the KV dtypes, in the order the native kernels number them


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of KV dtype ``name`` (one of :data:`KV_DTYPES`)."""
    return _DTYPES[name][0]


LAYER_KINDS = ("full", "sliding", "recurrent")
# dtypes a recurrent state tensor may have -> bytes per element
STATE_DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
                                "int8": 1, "uint8": 1, "int32": 4, "int64": 8}


@dataclass(frozen=True, kw_only=True)
class StateTensor:
    """One tensor of a recurrent layer's state (a Mamba2 conv or SSM state, a gated delta
    net's recurrent matrix, a short convolution's history): its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"StateTensor.name must be a non-empty str, got {self.name!r}")
        shape = self.shape
        if not isinstance(shape, tuple | list) or not shape or any(
                isinstance(d, bool) or not isinstance(d, int | np.integer) or d <= 0
                for d in shape):
            raise ValueError(f"StateTensor.shape must be a non-empty tuple of positive ints, "
                             f"got {shape!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        if self.dtype not in STATE_DTYPES:
            raise ValueError(f"StateTensor.dtype must be one of {sorted(STATE_DTYPES)}, got "
                             f"{self.dtype!r}")

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * STATE_DTYPES[self.dtype]

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True, kw_only=True)
class LayerKind:
    """What one model layer keeps between tokens: ``"full"`` attention (KV of every token),
    ``"sliding"`` attention over the last ``window`` tokens, or a ``"recurrent"`` state of
    fixed size (``state``: its tensors)."""

    kind: str = "full"
    window: int = 0
    state: tuple[StateTensor, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in LAYER_KINDS:
            raise ValueError(f"LayerKind.kind must be one of {list(LAYER_KINDS)}, got "
                             f"{self.kind!r}")
        w = self.window
        if isinstance(w, bool) or not isinstance(w, int | np.integer):
            raise ValueError(f"LayerKind.window must be an int, got {w!r}")
        if (self.kind == "sliding") != (w > 0) or w < 0:
            raise ValueError(f"LayerKind.window must be > 0 exactly for a sliding layer, got "
                             f"{self.kind} with window {w}")
        object.__setattr__(self, "window", int(w))
        state = tuple(self.state)
        if any(not isinstance(t, StateTensor) for t in state):
            raise ValueError("LayerKind.state must hold StateTensor records")
        if (self.kind == "recurrent") != bool(state):
            raise ValueError(f"LayerKind.state must be given exactly for a recurrent layer, "
                             f"got {self.kind} with {len(state)} state tensors")
        object.__setattr__(self, "state", state)

    @property
    def state_bytes(self) -> int:
        """Bytes of a recurrent layer's state (0 for attention layers)."""
        return sum(t.nbytes for t in self.state)

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {"kind": self.kind}
        if self.window:
            d["window"] = self.window
        if self.state:
            d["state"] = [t.to_dict() for t in self.state]
        return d

    @classmethod
    def from_dict(cls, d: object) -> LayerKind:
        if not isinstance(d, Mapping) or set(d) - {"kind", "window", "state"}:
            raise ValueError(f"a layer kind must be a mapping of kind, window and state, got "
                             f"{d!r}")
        state = d.get("state", ())
        if not isinstance(state, list | tuple) or any(
                not isinstance(t, Mapping) or set(t) != {"name", "shape", "dtype"}
                for t in state):
            raise ValueError(f"a recurrent layer's state must be a list of name/shape/dtype "
                             f"mappings, got {state!r}")
        return cls(kind=d.get("kind", "full"), window=d.get("window", 0),  # type: ignore
                   state=tuple(StateTensor(name=t["name"], shape=tuple(t["shape"]),
                                           dtype=t["dtype"]) for t in state))


@dataclass(frozen=True, kw_only=True)
class KVLayout:
    """Shape and format of a model's KV cache.

    With ``keys="pre_rope"`` (the default) keys are stored before rotary encoding;
    ``rope_theta`` and ``rope_scaling`` describe how to apply it on load. ``rope_scaling`` is an
    optional flat mapping (e.g. ``{"type": "linear", "factor": 2.0}``); it is kept as a sorted
    tuple of pairs so the layout stays hashable. With ``keys="rotated"`` keys are stored as the
    engine named by ``engine`` holds them (see the module docstring).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, object], ...] | Mapping[str, object] | None = None
    model_id: str = ""
    keys: str = "pre_rope"
    engine: str = ""
    layers: tuple[LayerKind, ...] | None = None
    state_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {v!r}")
            object.__setattr__(self, name, int(v))
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"KVLayout.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
            raise ValueError(f"KVLayout.rope_theta must be a positive number, got {theta!r}")
        object.__setattr__(self, "rope_theta", float(theta))
        rs = self.rope_scaling
        if rs is not None:
            items = rs.items() if isinstance(rs, Mapping) else rs
            try:
                pairs = tuple(sorted((str(k), v) for k, v in items))
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"KVLayout.rope_scaling must be a mapping of str to numbers/strings: {e}"
                ) from None
            for k, v in pairs:
                if not isinstance(v, int | float | str) or isinstance(v, bool):
                    raise ValueError(
                        f"KVLayout.rope_scaling[{k!r}] must be a number or string, got {v!r}"
                    )
            object.__setattr__(self, "rope_scaling", pairs or None)
        if not isinstance(self.model_id, str):
            raise ValueError(f"KVLayout.model_id must be a str, got {self.model_id!r}")
        if self.keys not in KEY_CONVENTIONS:
            raise ValueError(f"KVLayout.keys must be one of {list(KEY_CONVENTIONS)}, "
                             f"got {self.keys!r}")
        if not isinstance(self.engine, str):
            raise ValueError(f"KVLayout.engine must be a str, got {self.engine!r}")
        if self.keys == "rotated" and not self.engine:
            raise ValueError("KVLayout.engine must name the engine (and whatever else changes "
                             "its bytes) when keys='rotated': rotated keys are only served to "
                             "an engine that would have computed those same bytes")
        self._check_layers()

    def _check_layers(self) -> None:
        """``layers`` (each model layer's kind) against ``num_layers`` (the full-attention
        layers, whose KV the chunks hold) and ``state_bytes`` (the bound of a boundary
        state). A layout whose layers are all full attention is a plain one (layers None)."""
        layers = self.layers
        if layers is not None:
            try:
                layers = tuple(layers)
            except TypeError:
                raise ValueError(f"KVLayout.layers must be a sequence of LayerKind, got "
                                 f"{self.layers!r}") from None
            if not layers or any(not isinstance(k, LayerKind) for k in layers):
                raise ValueError("KVLayout.layers must be a non-empty sequence of LayerKind")
            full = sum(k.kind == "full" for k in layers)
            if full != self.num_layers:
                raise ValueError(f"KVLayout.num_layers must count the full-attention layers "
                                 f"(whose KV is kept per token), {full} of layers; got "
                                 f"{self.num_layers}")
            if full == len(layers):
                layers = None
            object.__setattr__(self, "layers", layers)
        sb = self.state_bytes
        if isinstance(sb, bool) or not isinstance(sb, int | np.integer) or sb < 0:
            raise ValueError(f"KVLayout.state_bytes must be an int >= 0, got {sb!r}")
        object.__setattr__(self, "state_bytes", int(sb))
        if (layers is None) != (sb == 0):
            raise ValueError("KVLayout.state_bytes (the most bytes one boundary state takes) "
                             "must be > 0 exactly when some layer is sliding-window or "
                             f"recurrent; got {sb} with "
                             f"{'no such layer' if layers is None else 'such layers'}")

    # ---- layer kinds -----------------------------------------------------------------------
    @property
    def boundary_state(self) -> bool:
        """Whether some layer is sliding-window or recurrent: a prefix is then restorable only
        at a boundary whose state is stored."""
        return self.layers is not None

    def require_plain(self, feature: str) -> None:
        """Raise unless every layer keeps the KV of every token, stored before rotary encoding:
        :class:`~kvstore.errors.HybridLayers` (sliding-window or recurrent layers) or
        :class:`~kvstore.errors.RotatedKeys`, naming ``feature``."""
        if self.boundary_state:
            kinds = sorted({k.kind for k in self.layers or () if k.kind != "full"})
            raise HybridLayers(
                f"{feature} needs the KV of every token in every layer; this layout has "
                f"{' and '.join(kinds)} layers, whose state exists only at stored boundaries")
        self.require_pre_rope(feature)

    # ---- key convention ------------------------------------------------------------------
    @property
    def rotated_keys(self) -> bool:
        """Whether keys are stored with RoPE applied (as an engine holds them)."""
        return self.keys == "rotated"

    def require_pre_rope(self, feature: str) -> None:
        """Raise :class:`~kvstore.errors.RotatedKeys` naming ``feature`` unless keys are stored
        before rotary encoding."""
        if self.rotated_keys:
            raise RotatedKeys(
                f"{feature} needs keys stored before rotary encoding (KVLayout keys='pre_rope'); "
                f"this layout holds keys rotated as {self.engine!r} computed them, which are "
                f"only valid at their own positions")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype][0]

    @property
    def np_dtype(self) -> np.dtype:
        """The numpy dtype used to view raw bytes (bf16 is viewed as uint16)."""
        return _DTYPES[self.dtype][1]

    @property
    def itemsize(self) -> int:
        return self.np_dtype.itemsize

    @property
    def head_token_bytes(self) -> int:
        """Bytes of one token's K (or V) for one head of one layer."""
        return self.head_dim * self.itemsize

    @property
    def layer_token_bytes(self) -> int:
        """Bytes of one token's K and V in one layer (all kv-heads)."""
        return 2 * self.num_kv_heads * self.head_token_bytes

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K and V across all layers."""
        return self.num_layers * self.layer_token_bytes

    def chunk_bytes(self, chunk_tokens: int) -> int:
        """Bytes of a chunk of ``chunk_tokens`` tokens."""
        return chunk_tokens * self.token_bytes

    def kv_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        """Shape of the keys (or values) tensor for ``num_tokens`` tokens: [L, H, T, D]."""
        return (self.num_layers, self.num_kv_heads, num_tokens, self.head_dim)

    def check_tensor(self, name: str, t: object) -> torch.Tensor:
        """``t`` as KV of this layout can be given: a dense torch tensor of the layout's dtype
        holding data on a CPU or CUDA device (TypeError/ValueError naming ``name``; the shape
        is the caller's to check). No cast happens anywhere: a float32 tensor is refused."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != self.torch_dtype:
            raise TypeError(f"{name} must have dtype {self.torch_dtype} (the layout's "
                            f"{self.dtype!r}), got {t.dtype}")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} must hold its data on a CPU or CUDA device, got a tensor "
                             f"on {t.device.type!r}")
        if t.layout != torch.strided:
            raise ValueError(f"{name} must be a dense (strided) tensor, got {t.layout}")
        return t

    # ---- identity ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, object]:
        """The canonical fields. ``keys`` and ``engine`` appear only when not the defaults, so
        a pre-RoPE layout has the fingerprint it had before they existed."""
        d: dict[str, object] = {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "model_id": self.model_id,
        }
        if self.keys != "pre_rope":
            d["keys"] = self.keys
        if self.engine:
            d["engine"] = self.engine
        if self.layers is not None:
            d["layers"] = [k.to_dict() for k in self.layers]
            d["state_bytes"] = self.state_bytes
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> KVLayout:
        known = {"num_layers", "num_kv_heads", "head_dim", "dtype", "rope_theta",
                 "rope_scaling", "model_id", "keys", "engine", "layers", "state_bytes"}
        extra = set(d) - known
        if extra:
            raise ValueError(f"unknown KVLayout fields: {sorted(extra)}")
        fields = dict(d)
        if fields.get("layers") is not None:
            kinds = fields["layers"]
            if not isinstance(kinds, list | tuple):
                raise ValueError(f"KVLayout layers must be a list, got {kinds!r}")
            fields["layers"] = tuple(LayerKind.from_dict(k) for k in kinds)
        return cls(**fields)  # type: ignore[arg-type]

    def differences(self, other: KVLayout) -> str:
        """One line naming the fields in which ``other`` differs from this layout, each with
        both values (long ones shortened): for an error a person reads."""
        mine, theirs = self.to_dict(), other.to_dict()

        def show(v: object) -> str:
            text = repr(v)
            return text if len(text) <= 60 else text[:57] + "..."

        parts = [f"{k} {show(mine.get(k))} vs {show(theirs.get(k))}"
                 for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
        return "; ".join(parts) or "nothing"

    @cached_property
    def fingerprint(self) -> bytes:
        """16-byte xxh3_128 digest of the canonical JSON of the layout."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_digest(canon.encode())
