"""A get's copies from host memory to a CUDA output.

The host side is a DRAM slot (page-locked once the store serves a CUDA output:
:mod:`kvstore.tiers.pinned`), or a buffer a chunk was read or decoded into. Each chunk extent
([L, 2, H, n, D] raw bytes, contiguous) goes to the device in one copy on a side stream, then a
device-side copy places its keys and values into the output [L, H, T, D]. Before the get lets go
of the host memory it read from (a DRAM slot may be reused once unpinned), :meth:`DeviceCopy.
finish` waits on the copy stream's event; nothing else on the device is synchronised.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from kvstore.format import chunk_extent
from kvstore.layout import KVLayout


class DeviceCopy:
    """A get's copies of chunk extents from host memory into one CUDA output pair.

    Thread-safety: :meth:`extent` may be called from any thread (each call enqueues its copies
    on the one copy stream; pieces own disjoint tokens of the output); :meth:`finish` is called
    once, by the get's thread, after every :meth:`extent` has returned.
    """

    def __init__(self, layout: KVLayout, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        assert k_out.device.type == "cuda" and k_out.device == v_out.device
        self.layout = layout
        self.k_out, self.v_out = k_out, v_out  # [L, H, T, D] on the GPU
        self.device = k_out.device
        # Two streams: the copies from the host on one, keeping the copy engine busy; the
        # placements into the output on the other, each after its extent's copy.
        self.stream = torch.cuda.Stream(device=self.device)
        self.place = torch.cuda.Stream(device=self.device)
        # The output's earlier users (kernels queued on the caller's stream) come first.
        self.place.wait_stream(torch.cuda.current_stream(self.device))

    def extent(self, buf: np.ndarray, n_tokens: int, start: int, use: int) -> None:
        """Copy the ``use`` leading tokens of the raw extent in ``buf`` (uint8, host) to output
        tokens ``start..start+use-1``."""
        lay = self.layout
        L, H, D = lay.num_layers, lay.num_kv_heads, lay.head_dim
        nbytes = chunk_extent.raw_bytes(lay, n_tokens)
        assert buf.dtype == np.uint8 and buf.nbytes >= nbytes and 0 < use <= n_tokens
        src = torch.from_numpy(buf[:nbytes])  # [nbytes] host (pinned where the slab is)
        with torch.cuda.stream(self.stream):
            stage = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            stage.copy_(src, non_blocking=True)
            copied = self.stream.record_event()
        self.place.wait_event(copied)
        with torch.cuda.stream(self.place):
            ext = stage.view(lay.torch_dtype).view(L, 2, H, n_tokens, D)
            self.k_out[:, :, start : start + use].copy_(ext[:, 0, :, :use], non_blocking=True)
            self.v_out[:, :, start : start + use].copy_(ext[:, 1, :, :use], non_blocking=True)
        stage.record_stream(self.place)  # not reused before its placement has run

    def finish(self) -> None:
        """Wait (on the host) until every copy from the host has run: the host memory they
        read may be reused after this. The caller's stream waits (on the device) for the
        placements: work queued on it after the get sees a complete output."""
        self.stream.record_event().synchronize()
        torch.cuda.current_stream(self.device).wait_event(self.place.record_event())


class StridedCopies:
    """Many equal host-to-device copies in one call: ``cudaMemcpy2DAsync`` of the CUDA runtime
    that torch has loaded, called through ctypes (the call runs without the interpreter lock).
    Each copy is one call into the driver, which the launches of the compute thread queue
    behind; a layer-wise load copies layer l of every chunk, and chunks in consecutive DRAM
    slots are rows of one strided copy. ``available`` is False (with ``reason``) where the
    runtime cannot be found: the caller then copies part by part."""

    _HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice

    def __init__(self) -> None:
        self.reason: str | None = None
        self._fn = None
        path = next((ln.split()[-1] for ln in _maps() if "libcudart.so" in ln), None)
        if path is None:
            self.reason = "no libcudart in this process"
            return
        try:
            fn = ctypes.CDLL(path).cudaMemcpy2DAsync
        except (OSError, AttributeError) as err:
            self.reason = f"cannot use {path}: {err}"
            return
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._fn = fn

    @property
    def available(self) -> bool:
        return self._fn is not None

    def rows(self, dst: int, src: int, src_pitch: int, width: int, height: int,
             stream: torch.cuda.Stream) -> None:
        """Queue ``height`` copies of ``width`` bytes on ``stream``: row r from host address
        ``src + r * src_pitch`` to device address ``dst + r * width``."""
        assert self._fn is not None and width <= src_pitch
        err = self._fn(dst, width, src, src_pitch, width, height, self._HOST_TO_DEVICE,
                       stream.cuda_stream)
        if err != 0:
            raise RuntimeError(f"cudaMemcpy2DAsync of {height} x {width} bytes failed: "
                               f"CUDA error {err}")


def _maps() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            return f.readlines()
    except OSError:
        return []


@functools.cache
def strided_copies() -> StridedCopies:
    """The process's :class:`StridedCopies` (looked up once, after CUDA is initialised)."""
    return StridedCopies()
