"""Page-locking host memory for copies to a CUDA device.

A copy from host memory to the GPU runs as DMA, asynchronously and at the link's speed, only
from page-locked (pinned) memory; from pageable memory the driver first copies through its own
staging buffers, synchronously. So the first time a store serves a CUDA output it registers its
DRAM slab with CUDA (``cudaHostRegister``): every DRAM slot is then pinned, and a chunk read from
disk into its DRAM slot is pinned too. Registration locks the slab's pages in physical memory
(it touches every page once); where it is refused (a locked-memory limit), copies run from
pageable memory and ``stats()["hbm"]["dram_pinned"]`` is False, with the reason beside it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
import torch


def pin_host(array: np.ndarray) -> tuple[Callable[[], None] | None, str | None]:
    """Register ``array``'s memory with CUDA (page-locked, mapped for DMA). Returns (a function
    that unregisters it, None) or (None, why it was not registered). The registration is also
    dropped when ``array`` is collected."""
    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    if not array.flags.c_contiguous or array.nbytes == 0:
        return None, "the slab is empty or not contiguous"
    cudart = torch.cuda.cudart()
    ptr, nbytes = array.ctypes.data, array.nbytes
    err = cudart.cudaHostRegister(ptr, nbytes, 0)  # cudaHostRegisterDefault
    if int(err) != 0:
        return None, f"cudaHostRegister of {nbytes} bytes failed: {err}"
    owner = array
    while isinstance(owner.base, np.ndarray):  # the array that owns the memory
        owner = owner.base
    # Called by the store's close, else when the memory's owner is collected (before numpy
    # frees it); a finalize runs once, whichever comes first.
    return weakref.finalize(owner, cudart.cudaHostUnregister, ptr), None
