"""Checks of a store call's tensor and device arguments (errors name the argument)."""

from __future__ import annotations

import numpy as np
import torch

from kvstore.format import chunk_extent
from kvstore.layout import KVLayout


def check_kv(layout: KVLayout, name: str, t: object, n_tokens: int) -> torch.Tensor:
    t = layout.check_tensor(name, t)
    want = layout.kv_shape(n_tokens)
    if tuple(t.shape) != want:
        raise ValueError(f"{name} must have shape [num_layers, num_kv_heads, T, head_dim] = "
                         f"{list(want)} for {n_tokens} tokens, got {list(t.shape)}")
    return t


def check_device(device: object) -> torch.device:
    """``device`` as a torch device this store can load to (CPU, or CUDA when available)."""
    try:
        dev = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must name a torch device, got {device!r} ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CPU or CUDA device, got {device!r}")
    return dev


def check_out(layout: KVLayout, out: object, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate an ``out=(keys, values)`` pair for ``n_tokens`` tokens."""
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise TypeError("out must be a (keys, values) pair of tensors")
    k_out = check_kv(layout, "out[0]", out[0], n_tokens)
    v_out = check_kv(layout, "out[1]", out[1], n_tokens)
    if k_out.device != v_out.device:
        raise ValueError(f"out tensors must be on one device, got {k_out.device} and "
                         f"{v_out.device}")
    if k_out.device.type not in ("cpu", "cuda"):
        raise ValueError(f"out tensors must be on a CPU or CUDA device, got {k_out.device}")
    if k_out.untyped_storage().data_ptr() == v_out.untyped_storage().data_ptr() or (
            k_out.device.type == "cpu"
            and np.shares_memory(chunk_extent.raw(k_out), chunk_extent.raw(v_out))):
        raise ValueError("out[0] and out[1] must not share memory")
    return k_out, v_out
