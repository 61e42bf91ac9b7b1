"""Gathering chunk extents into a caller's keys and values: the copy at the heart of a get.

Each piece is ``use`` leading tokens of one extent ([L, 2 (K/V), H, n, D] bytes, see
:mod:`kvstore.format.chunk_extent`) placed at token ``start`` of keys and values [L, H, T, D]. The
C kernel
(``native/kvcopy.c``, built as ``kvstore._kvcopy`` and opened with ctypes) copies a layer range
of every piece in one call, writing each output row front to back, with non-temporal stores
when the output is larger than the caches (measured 25 GB/s on two cores here, against 17.5
for memcpy); large gathers are split by layers over this thread and the store's helpers (ctypes
releases the GIL). Without the library
(no compiler at install, or ``KVSTORE_NATIVE=0``) numpy copies the same bytes. Arguments are
checked before any pointer reaches C.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from kvstore import native_lib
from kvstore.format import chunk_extent
from kvstore.layout import KVLayout
from kvstore.threads.fork_join import PARALLEL_COPY_BYTES, Helpers, copy_all

_ABI_VERSION = 2
STREAM_BYTES = 8 << 20  # larger outputs are written with non-temporal stores (x86-64)
_I64 = ctypes.c_int64
_P = ctypes.c_void_p


_lib, _, UNAVAILABLE_REASON = native_lib.load(
    "kvstore._kvcopy", abi=("kvcopy_abi_version", _ABI_VERSION),
    functions={"kvcopy_gather": (ctypes.c_int, [_P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P,
                                                _I64, _I64, ctypes.c_int])})
#: the C gather is in use (tests and benchmarks may set it to False to force numpy).
AVAILABLE: bool = _lib is not None


def gather(layout: KVLayout, k_out: np.ndarray, v_out: np.ndarray,
           pieces: list[tuple[np.ndarray, int, int, int]], helpers: Helpers | None = None,
           *, native: bool | None = None) -> None:
    """Copy every piece ``(buf, n_tokens, start, use)`` into ``k_out``/``v_out``: raw integer
    views [L, H, T, D] of the outputs; ``buf`` a uint8 array holding an extent of ``n_tokens``
    tokens, of which the first ``use`` go to output tokens ``start..start+use-1``."""
    L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
    if k_out.shape != v_out.shape or k_out.ndim != 4 or k_out.shape[0] != L \
            or k_out.shape[1] != H or k_out.shape[3] != D:
        raise ValueError(f"outputs must be [L={L}, H={H}, T, D={D}], got {k_out.shape} and "
                         f"{v_out.shape}")
    T = k_out.shape[2]
    for buf, n, start, use in pieces:
        if not (0 < use <= n and 0 <= start and start + use <= T):
            raise ValueError(f"a piece of {use} of {n} tokens at {start} does not fit {T} tokens")
        if buf.dtype != np.uint8 or buf.ndim != 1 \
                or buf.nbytes < chunk_extent.raw_bytes(layout, n):
            raise ValueError("an extent buffer is not a uint8 array holding its extent")
    use_c = (_lib is not None and AVAILABLE) if native is None else native
    if not use_c or not all(a.flags.c_contiguous and a.dtype.itemsize == layout.itemsize
                            for a in (k_out, v_out)) \
            or not all(b.flags.c_contiguous for b, _, _, _ in pieces):
        pairs = []
        for buf, n, start, use in pieces:
            ext = chunk_extent.view(layout, buf, n)  # [L, 2, H, n, D]
            pairs.append((k_out[:, :, start : start + use], ext[:, 0, :, :use]))
            pairs.append((v_out[:, :, start : start + use], ext[:, 1, :, :use]))
        copy_all(helpers, pairs)
        return
    if _lib is None:
        raise RuntimeError(f"the native gather is unavailable: {UNAVAILABLE_REASON}")
    n = len(pieces)
    ptrs = np.fromiter((b.ctypes.data for b, _, _, _ in pieces), dtype=np.int64, count=n)
    ntok = np.fromiter((p[1] for p in pieces), dtype=np.int64, count=n)
    start = np.fromiter((p[2] for p in pieces), dtype=np.int64, count=n)
    use = np.fromiter((p[3] for p in pieces), dtype=np.int64, count=n)
    row = D * layout.itemsize
    args = (k_out.ctypes.data, v_out.ctypes.data, H, T, row, n, ptrs.ctypes.data,
            ntok.ctypes.data, start.ctypes.data, use.ctypes.data)

    total = 2 * int(use.sum()) * L * H * row
    stream = int(total >= STREAM_BYTES)

    def layers(lo: int, hi: int):
        return lambda: _lib.kvcopy_gather(*args, lo, hi, stream)  # type: ignore[union-attr]

    if helpers is None or total < PARALLEL_COPY_BYTES:
        layers(0, L)()
        return
    with helpers.split_work() as alone:
        ways = min(1 + helpers.n, os.cpu_count() or 1) if alone else 1
        step = -(-L // ways)
        helpers.run_all([layers(lo, min(lo + step, L)) for lo in range(0, L, step)])
