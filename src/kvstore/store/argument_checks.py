"""Checks of a store call's tensor and device arguments (errors name the argument)."""

from __future__ import annotations

import numpy as np
import torch

from kvstore.format import chunk_extent
from kvstore.layout import KVLayout
from kvstore.pipelines.pages import Pages


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


def check_start(start: object, n_tokens: int) -> int:
    """A load's ``start``: an int in [0, n_tokens)."""
    if isinstance(start, bool) or not isinstance(start, int | np.integer):
        raise TypeError(f"start must be an int, got {type(start).__name__}")
    if not 0 <= start < n_tokens:
        raise ValueError(f"start must be in [0, {n_tokens}) for {n_tokens} tokens, got {start}")
    return int(start)


def check_load_out(layout: KVLayout, out: object, n_tokens: int, device: object,
                   dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer-wise load's ``out=(keys, values)`` for ``n_tokens`` tokens: contiguous CPU
    tensors, on ``dev`` when a ``device`` was named."""
    k_out, v_out = check_out(layout, out, n_tokens)
    if k_out.device.type != "cpu" or not (k_out.is_contiguous() and v_out.is_contiguous()):
        raise ValueError("out tensors of load_layers must be contiguous CPU tensors")
    if device is not None and dev != k_out.device:
        raise ValueError(f"device={device!r} disagrees with out tensors on {k_out.device}")
    return k_out, v_out


def check_pages(layout: KVLayout, pages: object, n_tokens: int) -> Pages:
    """A load's ``pages`` for ``n_tokens`` tokens: a :class:`Pages` that fits ``layout``
    and whose blocks end in the block holding the last token."""
    if not isinstance(pages, Pages):
        raise TypeError(f"pages must be a kvstore Pages, got {type(pages).__name__}")
    pages.check(layout)
    if not 0 <= pages.num_tokens - n_tokens < pages.block_tokens:
        raise ValueError(f"pages hold {pages.num_tokens} tokens; the load has {n_tokens}")
    return pages
