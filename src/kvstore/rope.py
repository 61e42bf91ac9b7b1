"""Rotary position encoding at arbitrary positions (and its inverse).

The store keeps keys *before* RoPE, so a context can be re-positioned (truncated, shifted,
reused at another offset) by applying RoPE at the new positions when it is loaded; which tokens
a truncation keeps is :mod:`engine.truncation`'s rule. Convention: half-split ("rotate_half",
as HF Llama), angles ``pos * theta ** (-2i / D)`` computed in float64 so that any position is
exact to float32, then the rotation in float32 (or float64).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.layout import KVLayout


def inv_freq(layout: KVLayout) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float64), with the layout's rope_scaling applied.

    Supported ``rope_scaling``: none, ``{"type"|"rope_type": "linear", "factor": f}`` (positions
    divided by f), and ``"llama3"`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``).
    """
    layout.require_plain("rotary encoding at chosen positions")
    d = layout.head_dim
    if d % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {d}")
    inv = 1.0 / (layout.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))  # [D/2]
    sc = dict(layout.rope_scaling or ())
    kind = sc.get("rope_type", sc.get("type"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "llama3":
        factor = float(sc["factor"])
        low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * torch.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (none, linear, llama3)")


def cos_sin(layout: KVLayout, positions: torch.Tensor,
            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [T, head_dim] at integer ``positions`` [T]."""
    inv = inv_freq(layout).to(positions.device)  # [D/2] float64
    ang = positions.to(torch.float64).reshape(-1, 1) * inv.reshape(1, -1)  # [T, D/2]
    emb = torch.cat([ang, ang], dim=-1)  # [T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] on the last dim."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE with precomputed tables: x [..., T, D], cos/sin [T, D] (see :func:`cos_sin`)."""
    return x * cos + rotate_half(x) * sin


def _positions(positions: torch.Tensor | Sequence[int] | int, n: int,
               device: torch.device) -> torch.Tensor:
    if isinstance(positions, int):
        return torch.arange(positions, positions + n, device=device)  # an offset
    pos = torch.as_tensor(positions, device=device)
    if pos.dim() != 1 or pos.numel() != n:
        raise ValueError(f"positions must be 1-D with one entry per token ({n}), "
                         f"got shape {tuple(pos.shape)}")
    if pos.dtype.is_floating_point:
        raise TypeError(f"positions must be integers, got {pos.dtype}")
    return pos


def apply_rope(x: torch.Tensor, positions: torch.Tensor | Sequence[int] | int,
               layout: KVLayout, *, inverse: bool = False) -> torch.Tensor:
    """Rotate ``x`` [..., T, head_dim] to ``positions`` (a [T] tensor/sequence, or an int
    offset meaning ``offset .. offset+T-1``). ``inverse=True`` removes the rotation.

    Computes in float32 (float64 if x is float64) and returns that dtype.
    """
    assert x.shape[-1] == layout.head_dim, "last dim of x must be the layout's head_dim"
    pos = _positions(positions, x.shape[-2], x.device)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = cos_sin(layout, pos, dtype=work)
    cos, sin = cos.to(x.device), sin.to(x.device)
    return rotate(x.to(work), cos, -sin if inverse else sin)


def remove_rope(x: torch.Tensor, positions: torch.Tensor | Sequence[int] | int,
                layout: KVLayout) -> torch.Tensor:
    """Undo :func:`apply_rope` (keys as HF caches them -> keys as the store keeps them)."""
    return apply_rope(x, positions, layout, inverse=True)
