"""The native decoders of the lossy codecs and the ``int8`` encoder (``native/kvcodec.c``, built
as ``kvstore._kvcodec`` and opened with ctypes), used by :mod:`kvstore.codecs.layer_codec` when
available.

They compute what the numpy/torch decoders compute (float32 code x scale, rounded to the layout
dtype to nearest even) and write the same bytes, several times faster and without the GIL (ctypes
releases it), so the store's two helper threads decode two chunks at once. Without the library
(no compiler at install, or ``KVSTORE_NATIVE=0``) the numpy/torch decoders run. Every argument is
checked here before a pointer reaches C: array kinds, contiguity, each layer's encoded length
against the shape and its offset inside the data, and for :func:`decode_into` the outputs'
shape, item size and overlap and the token range; the C checks the scales it reads (finite,
non-negative) and fp8 codes (no NaN), as the numpy decoders do.

Thread-safety: every function may be called from any number of threads at once.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import numpy as np

from kvstore import native_lib
from kvstore.errors import CorruptData
from kvstore.layout import KV_DTYPES


class LayerShape(Protocol):
    """What is used of :class:`kvstore.codecs.layer_codec.LayerShape` (which imports this
    module)."""

    dtype: str
    num_kv_heads: int
    n_tokens: int
    head_dim: int

    @property
    def raw_bytes(self) -> int: ...

_ABI_VERSION = 5
_I64 = ctypes.c_int64
_P = ctypes.c_void_p
_DTYPES = {name: i for i, name in enumerate(KV_DTYPES)}  # the kernels' dtype numbers
_CODECS = {"int8": 2, "fp8": 3, "int4": 4}  # the ids kvcodec.c knows


_lib, _, UNAVAILABLE_REASON = native_lib.load(
    "kvstore._kvcodec", abi=("kvcodec_abi_version", _ABI_VERSION), functions={
        "kvcodec_decode": (_I64, [ctypes.c_int, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _P,
                                  ctypes.c_int, _P, _I64, ctypes.c_int]),
        "kvcodec_decode_into": (_I64, [ctypes.c_int, _P, _P, _I64, _I64, _I64, _I64, _I64,
                                       _I64, _P, ctypes.c_int, _P, _P, _I64, _I64, _I64,
                                       ctypes.c_int]),
        "kvcodec_encode_int8": (ctypes.c_int, [_P, _I64, _I64, _I64, ctypes.c_int, _P,
                                               ctypes.c_int]),
    })
#: the C decoders are in use (tests and benchmarks may set it to False to force numpy/torch).
AVAILABLE: bool = _lib is not None
#: the vector instructions the C decoders may use, where the CPU has them: 2 the widest
#: (AVX-512F/BW for the int8/fp8 rows), 1 at most F16C/AVX2, 0 none (tests set each level to
#: check every path against the same reference).
SIMD: int = 2
_ERRORS = {1: "holds a negative or non-finite scale", 2: "holds a NaN"}


def decode_layers(name: str, data: np.ndarray, offsets: list[int], shape: LayerShape,
                  encoded_size: int, out: np.ndarray, *, table: np.ndarray | None = None,
                  groups: int = 0, g: int = 0) -> None:
    """Decode ``len(offsets)`` layers of one chunk through codec ``name`` (``int8``, ``fp8``
    with ``table`` = the 256 e4m3 values as float32, or ``int4`` with its ``groups`` of K
    tokens and V channel group size ``g``): layer ``l`` is the ``encoded_size`` bytes of
    ``data`` (uint8) at ``offsets[l]``; its raw bytes go to ``out[l * shape.raw_bytes:]``.
    :class:`CorruptData` naming the layer if a scale is negative or not finite or an fp8 code
    is a NaN (``out`` is then partly written and must not be used); ``ValueError`` for
    arguments that do not fit (nothing reaches C then)."""
    lib, cid, offs = _checked_chunk(name, data, offsets, shape, encoded_size, table, groups, g)
    _check(out, np.uint8, offs.size * shape.raw_bytes, "out")
    if not out.flags.writeable:
        raise ValueError("out must be writeable")
    h, n, d = shape.num_kv_heads, shape.n_tokens, shape.head_dim
    rc = lib.kvcodec_decode(cid, data.ctypes.data, offs.ctypes.data, offs.size, h, n, d, groups,
                            g, None if table is None else table.ctypes.data, _DTYPES[shape.dtype],
                            out.ctypes.data, shape.raw_bytes, int(SIMD))
    _raise_for(rc, name)


def decode_into(name: str, data: np.ndarray, offsets: list[int], shape: LayerShape,
                encoded_size: int, k_out: np.ndarray, v_out: np.ndarray, start: int, use: int,
                *, table: np.ndarray | None = None, groups: int = 0, g: int = 0) -> None:
    """Decode ``len(offsets)`` layers of one chunk as :func:`decode_layers` does (same codecs,
    arguments and errors), but straight into keys and values: token ``t < use`` of layer
    ``l``, head ``h`` goes to ``k_out[l, h, start + t]`` / ``v_out[l, h, start + t]``.
    ``k_out``, ``v_out``: C-contiguous, writeable, non-overlapping ``[len(offsets), H, T, D]``
    arrays of ``shape.dtype``'s item size (any dtype of that size: the bytes are written);
    nothing else of them is written. Every scale (and fp8 code) of the chunk is checked, also
    those of tokens not used. ``ValueError`` for arguments that do not fit (nothing reaches C
    then)."""
    lib, cid, offs = _checked_chunk(name, data, offsets, shape, encoded_size, table, groups, g)
    h, n, d = shape.num_kv_heads, shape.n_tokens, shape.head_dim
    tokens = _check_outputs(k_out, v_out, (offs.size, h, d), shape.raw_bytes // (2 * h * n * d))
    start, use = _index(start, "start"), _index(use, "use")
    if not (0 < use <= n and 0 <= start and start + use <= tokens):
        raise ValueError(f"use={use} tokens at start={start} do not fit a chunk of {n} tokens "
                         f"and {tokens} output tokens")
    rc = lib.kvcodec_decode_into(cid, data.ctypes.data, offs.ctypes.data, offs.size, h, n, d,
                                 groups, g, None if table is None else table.ctypes.data,
                                 _DTYPES[shape.dtype], k_out.ctypes.data, v_out.ctypes.data,
                                 tokens, start, use, int(SIMD))
    _raise_for(rc, name)


def _checked_chunk(name: str, data: np.ndarray, offsets: list[int], shape: LayerShape,
                   encoded_size: int, table: np.ndarray | None, groups: int, g: int
                   ) -> tuple[ctypes.CDLL, int, np.ndarray]:
    """(library, codec id, offsets as int64 [L]) once the codec, shape, encoded size, table
    and every layer's place inside ``data`` are checked; ``ValueError`` otherwise."""
    lib = _lib_or_raise()
    h, n, d = shape.num_kv_heads, shape.n_tokens, shape.head_dim
    cid = _CODECS.get(name)
    if cid is None:
        raise ValueError(f"name must be one of {sorted(_CODECS)}, got {name!r}")
    if shape.dtype not in _DTYPES or min(h, n, d) <= 0:
        raise ValueError(f"shape {shape} has no native decoder")
    if name == "int4":
        if groups != -(-n // 32) or g <= 0 or d % g:
            raise ValueError(f"groups={groups}, g={g} do not fit {shape}")
        need = (h * groups * 32 * d + h * n * d + 1) // 2 + 4 * (h * groups * d + h * n * (d // g))
    else:
        need = 2 * h * n * d + 4 * (h * d + h * n)
    if encoded_size != need:
        raise ValueError(f"encoded_size must be {need} for {name} {shape}, got {encoded_size}")
    if name == "fp8":
        _check(table, np.float32, 256, "table")  # type: ignore[arg-type]
    _check(data, np.uint8, data.size if isinstance(data, np.ndarray) else -1, "data")
    offs = np.asarray(offsets, dtype=np.int64)
    if offs.ndim != 1 or not offs.size or int(offs.min()) < 0 \
            or int(offs.max()) + encoded_size > data.nbytes:
        raise ValueError(f"offsets {offsets!r} do not leave {encoded_size} bytes per layer in "
                         f"{data.nbytes} bytes of data")
    return lib, cid, offs


def _check_outputs(k_out: np.ndarray, v_out: np.ndarray, lhd: tuple[int, int, int],
                   itemsize: int) -> int:
    """The token count T of keys and values [L, H, T, D] (``lhd`` = (L, H, D)) once both are
    checked: C-contiguous writeable arrays of ``itemsize``-byte items, the same shape, not
    overlapping; ``ValueError`` naming the argument otherwise."""
    L, h, d = lhd
    for what, a in (("k_out", k_out), ("v_out", v_out)):
        if not isinstance(a, np.ndarray) or a.ndim != 4 or a.shape[0] != L or a.shape[1] != h \
                or a.shape[3] != d or a.shape[2] <= 0 or a.dtype.itemsize != itemsize:
            raise ValueError(f"{what} must be a [{L}, {h}, T, {d}] array of {itemsize}-byte "
                             f"items, got {getattr(a, 'shape', None)} of "
                             f"{getattr(getattr(a, 'dtype', None), 'itemsize', None)}-byte items")
        if not a.flags.c_contiguous or not a.flags.writeable:
            raise ValueError(f"{what} must be C-contiguous and writeable")
    if k_out.shape != v_out.shape:
        raise ValueError(f"k_out and v_out differ in shape: {k_out.shape} and {v_out.shape}")
    if np.may_share_memory(k_out, v_out):
        raise ValueError("k_out and v_out overlap")
    return int(k_out.shape[2])


def _index(x: object, what: str) -> int:
    """``x`` as a Python int (an int or numpy integer; not a bool); ``ValueError`` otherwise."""
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise ValueError(f"{what} must be an integer, got {type(x).__name__}")
    return int(x)


def _raise_for(rc: int, name: str) -> None:
    """The error a decoder's return code stands for (none for 0)."""
    if rc < 0:
        raise MemoryError("the native codec decoder could not allocate its scales")
    if rc > 0:
        raise CorruptData(f"{name} data of layer {rc // 4} {_ERRORS[rc % 4]}")


def encode_int8(raw: np.ndarray, shape: LayerShape) -> bytes:
    """The ``int8`` encoding of one layer's raw bytes (uint8, ``shape.raw_bytes``): the bytes
    ``kvstore.codecs.layer_codec`` writes. ``ValueError`` if a value is not finite."""
    lib = _lib_or_raise()
    h, n, d = shape.num_kv_heads, shape.n_tokens, shape.head_dim
    if shape.dtype not in _DTYPES or min(h, n, d) <= 0:
        raise ValueError(f"shape {shape} has no native encoder")
    _check(raw, np.uint8, shape.raw_bytes, "raw")
    out = np.empty(2 * h * n * d + 4 * (h * d + h * n), dtype=np.uint8)
    rc = lib.kvcodec_encode_int8(raw.ctypes.data, h, n, d, _DTYPES[shape.dtype],
                                 out.ctypes.data, int(SIMD))
    if rc < 0:
        raise MemoryError("the native int8 encoder could not allocate its buffer")
    if rc:
        raise ValueError("a lossy codec cannot encode non-finite KV values")
    return out.tobytes()


def _check(a: np.ndarray, dtype: type, count: int, what: str) -> None:
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != 1 or a.size != count \
            or not a.flags.c_contiguous:
        raise ValueError(f"{what} must be a contiguous 1-D {np.dtype(dtype).name} array of "
                         f"{count} elements")


def _lib_or_raise() -> ctypes.CDLL:
    if _lib is None:
        raise RuntimeError(f"the native codec decoders are unavailable: {UNAVAILABLE_REASON}")
    return _lib
