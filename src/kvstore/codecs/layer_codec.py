"""KV codecs: how one layer of one chunk is turned into stored bytes and back.

A codec works on one (chunk, layer) at a time: its input is the layer's raw bytes in the
store's extent order, K of every kv-head ``[H, n, D]`` then V ``[H, n, D]`` in the layout dtype,
and its output is a self-contained byte string (scales travel beside the data), so a layer-wise
load still reads and decodes one layer at a time. The disk and remote tiers call it (each stores
the codec id beside the bytes). ``int8``/``fp8``/``int4`` decode and ``int8`` encode run in C
(:mod:`kvstore.codecs.native_decoders`) where it was built, with the same bytes as the numpy/torch
code
here (``native=False`` forces the latter).

========  =======  ==================================================================
codec     lossy    stored bytes per layer
========  =======  ==================================================================
``none``  no       the raw bytes
``zstd``  no       zstd (level 1) of the bytes shuffled by byte plane (all first bytes
                   of the elements, then all second bytes, ...)
``int8``  yes      K per channel (one scale per head and channel, over the chunk's
                   tokens), V per token (one scale per head and token); symmetric,
                   ``q = round(x / s)``, ``s = max|x| / 127``; int8 data then float32 scales
``fp8``   yes      the same scales with ``s = max|x| / 448``, data as float8 e4m3 (torch)
``int4``  yes      K per channel in groups of 32 tokens, V per token in groups of 32
                   channels (all ``D`` channels if ``D % 32``); ``s = max|x| / 7``, two
                   values per byte; then float32 scales
========  =======  ==================================================================

Error bounds (before the result is rounded to the layout dtype, which adds at most half an ulp
of that dtype): ``int8`` and ``int4`` ``|x - x'| <= s / 2`` for every element with its group's
scale ``s``; ``fp8`` ``|x - x'| <= max(|x| / 16, s / 1024)`` (e4m3: 3 mantissa bits, subnormal
step ``2**-9``). Lossy codecs refuse non-finite input (``ValueError``); the store then keeps that
chunk raw. Decoding bytes that do not fit the codec raises :class:`CorruptData`, never returns
data. Thread-safety: every function may be called from any number of threads at once (each
thread has its own zstd contexts).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from kvstore.codecs import native_decoders
from kvstore.codecs.names import LOSSY, NAMES, check_name, codec_id, codec_name  # noqa: F401
from kvstore.errors import CorruptData
from kvstore.layout import torch_dtype

ZSTD_LEVEL = 1
INT4_GROUP = 32
_FP8_MAX = 448.0
_INT_VIEW = {2: np.int16, 4: np.int32}
_local = threading.local()
# every e4m3 byte's value (NaN at 0x7F and 0xFF): a table lookup decodes ~50x faster than
# torch's elementwise float8 -> float32 conversion on CPU, with the same values
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


@dataclass(frozen=True, slots=True)
class LayerShape:
    """The shape of one (chunk, layer): ``n_tokens`` tokens of ``num_kv_heads`` heads."""

    dtype: str
    num_kv_heads: int
    n_tokens: int
    head_dim: int

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=torch_dtype(self.dtype)).element_size()

    @property
    def raw_bytes(self) -> int:
        return 2 * self.num_kv_heads * self.n_tokens * self.head_dim * self.itemsize


def is_lossy(name: str) -> bool:
    return check_name(name) in LOSSY


def _int4_groups(shape: LayerShape) -> tuple[int, int]:
    """(token groups of K, channel group size of V)."""
    n, d = shape.n_tokens, shape.head_dim
    return -(-n // INT4_GROUP), INT4_GROUP if d % INT4_GROUP == 0 else d


def encoded_size(name: str, shape: LayerShape) -> int | None:
    """Bytes :func:`encode` returns for one layer of ``shape``; None where it depends on the
    data (``zstd``)."""
    h, n, d = shape.num_kv_heads, shape.n_tokens, shape.head_dim
    check_name(name)
    if name == "none":
        return shape.raw_bytes
    if name in ("int8", "fp8"):
        return 2 * h * n * d + 4 * (h * d + h * n)
    if name == "int4":
        groups, g = _int4_groups(shape)
        nibbles = h * groups * INT4_GROUP * d + h * n * d
        return (nibbles + 1) // 2 + 4 * (h * groups * d + h * n * (d // g))
    return None


# ---------------------------------------------------------------------------------- helpers
def _floats(layer: object, shape: LayerShape) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a raw layer as float32 [H, n, D] each."""
    buf = np.frombuffer(layer, dtype=np.uint8)  # type: ignore[call-overload]
    if buf.nbytes != shape.raw_bytes:
        raise ValueError(f"layer must hold {shape.raw_bytes} bytes for {shape}, got {buf.nbytes}")
    ints = buf.view(_INT_VIEW[shape.itemsize])
    x = torch.from_numpy(ints.copy()).view(torch_dtype(shape.dtype)).float()
    x = x.reshape(2, shape.num_kv_heads, shape.n_tokens, shape.head_dim)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("a lossy codec cannot encode non-finite KV values")
    return x[0], x[1]


def _out(shape: LayerShape, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return np.empty(shape.raw_bytes, dtype=np.uint8)
    if out.dtype != np.uint8 or out.ndim != 1 or out.nbytes != shape.raw_bytes:
        raise ValueError(f"out must be a 1-D uint8 array of {shape.raw_bytes} bytes")
    return out


def _store(k: torch.Tensor, v: torch.Tensor, shape: LayerShape, out: np.ndarray | None
           ) -> np.ndarray:
    """Float32 K and V rounded to the layout dtype, as raw bytes (into ``out``)."""
    res = _out(shape, out)
    dst = torch.from_numpy(res.view(_INT_VIEW[shape.itemsize])).view(torch_dtype(shape.dtype))
    dst = dst.view(2, shape.num_kv_heads, shape.n_tokens, shape.head_dim)
    dst[0].copy_(k)
    dst[1].copy_(v)
    return res


def _scale(amax: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored scale, the divisor used: 1 where the scale is 0)."""
    s = amax / qmax
    return s, torch.where(s > 0, s, torch.ones_like(s))


class _Reader:
    """Consecutive typed arrays out of an encoded byte string (CorruptData if it is short)."""

    def __init__(self, data: object, name: str) -> None:
        self.buf = np.frombuffer(data, dtype=np.uint8)  # type: ignore[call-overload]
        self.o = 0
        self.name = name

    def take(self, dtype: str, count: int) -> np.ndarray:
        nbytes = count * np.dtype(dtype).itemsize
        if self.o + nbytes > self.buf.nbytes:
            raise CorruptData(f"{self.name} data is truncated")
        a = self.buf[self.o : self.o + nbytes].view(dtype)
        self.o += nbytes
        return a

    def scales(self, count: int, shape: tuple[int, ...]) -> torch.Tensor:
        # a native-order aligned copy (the C decoders take it as it is)
        a = self.take("<f4", count).astype(np.float32)
        if not bool((np.isfinite(a) & (a >= 0)).all()):
            raise CorruptData(f"{self.name} data holds a negative or non-finite scale")
        return torch.from_numpy(a).reshape(shape)


_NATIVE = frozenset({"int8", "fp8", "int4"})  # codecs kvcodec.c decodes


def _use_native(native: bool | None) -> bool:
    return native_decoders.AVAILABLE if native is None else native


# ---------------------------------------------------------------------------------- codecs
def _enc_scaled(layer: object, shape: LayerShape, name: str) -> bytes:
    k, v = _floats(layer, shape)
    qmax = 127.0 if name == "int8" else _FP8_MAX
    sk, dk = _scale(k.abs().amax(dim=1), qmax)  # [H, D]: per channel
    sv, dv = _scale(v.abs().amax(dim=2), qmax)  # [H, n]: per token
    xk, xv = k / dk[:, None, :], v / dv[:, :, None]
    if name == "int8":
        qk = torch.round(xk).clamp_(-127, 127).to(torch.int8)
        qv = torch.round(xv).clamp_(-127, 127).to(torch.int8)
    else:
        f8 = torch.float8_e4m3fn
        qk = xk.clamp_(-_FP8_MAX, _FP8_MAX).to(f8).view(torch.int8)
        qv = xv.clamp_(-_FP8_MAX, _FP8_MAX).to(f8).view(torch.int8)
    return b"".join((qk.numpy().tobytes(), qv.numpy().tobytes(),
                     sk.numpy().astype("<f4").tobytes(), sv.numpy().astype("<f4").tobytes()))


def _dec_scaled(data: object, shape: LayerShape, name: str, out: np.ndarray | None
                ) -> np.ndarray:
    h, n, d = shape.num_kv_heads, shape.n_tokens, shape.head_dim
    r = _Reader(data, name)
    bk, bv = r.take("u1", h * n * d), r.take("u1", h * n * d)
    sk = r.scales(h * d, (h, d))
    sv = r.scales(h * n, (h, n))
    if name == "fp8":
        if ((bk & 0x7F) == 0x7F).any() or ((bv & 0x7F) == 0x7F).any():  # e4m3's only NaNs
            raise CorruptData("fp8 data holds a NaN")
        fk = torch.from_numpy(_FP8_VALUES[bk]).reshape(h, n, d)
        fv = torch.from_numpy(_FP8_VALUES[bv]).reshape(h, n, d)
    else:
        fk = torch.from_numpy(bk.view(np.int8).copy()).reshape(h, n, d).float()
        fv = torch.from_numpy(bv.view(np.int8).copy()).reshape(h, n, d).float()
    return _store(fk * sk[:, None, :], fv * sv[:, :, None], shape, out)


def _enc_int4(layer: object, shape: LayerShape) -> bytes:
    k, v = _floats(layer, shape)
    h, n, d = shape.num_kv_heads, shape.n_tokens, shape.head_dim
    groups, g = _int4_groups(shape)
    kp = torch.zeros(h, groups * INT4_GROUP, d)
    kp[:, :n] = k
    kg = kp.view(h, groups, INT4_GROUP, d)
    sk, dk = _scale(kg.abs().amax(dim=2), 7.0)  # [H, groups, D]
    qk = torch.round(kg / dk[:, :, None, :]).clamp_(-7, 7)
    vg = v.reshape(h, n, d // g, g)
    sv, dv = _scale(vg.abs().amax(dim=3), 7.0)  # [H, n, D/g]
    qv = torch.round(vg / dv[..., None]).clamp_(-7, 7)
    nib = (torch.cat((qk.flatten(), qv.flatten())) + 8).to(torch.uint8).numpy()
    if len(nib) % 2:
        nib = np.append(nib, np.uint8(8))
    packed = nib[0::2] | (nib[1::2] << 4)
    return b"".join((packed.tobytes(), sk.numpy().astype("<f4").tobytes(),
                     sv.numpy().astype("<f4").tobytes()))


def _dec_int4(data: object, shape: LayerShape, out: np.ndarray | None) -> np.ndarray:
    h, n, d = shape.num_kv_heads, shape.n_tokens, shape.head_dim
    groups, g = _int4_groups(shape)
    nk, nv = h * groups * INT4_GROUP * d, h * n * d
    r = _Reader(data, "int4")
    packed = r.take("u1", (nk + nv + 1) // 2)
    nib = np.empty(2 * len(packed), dtype=np.uint8)
    nib[0::2] = packed & 15
    nib[1::2] = packed >> 4
    q = torch.from_numpy(nib[: nk + nv].astype(np.float32)) - 8.0
    sk = r.scales(h * groups * d, (h, groups, d))
    sv = r.scales(h * n * (d // g), (h, n, d // g))
    k = (q[:nk].view(h, groups, INT4_GROUP, d) * sk[:, :, None, :]).view(h, -1, d)[:, :n]
    v = (q[nk:].view(h, n, d // g, g) * sv[..., None]).view(h, n, d)
    return _store(k, v, shape, out)


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    ctx = getattr(_local, "zstd", None)
    if ctx is None:
        ctx = _local.zstd = (zstandard.ZstdCompressor(level=ZSTD_LEVEL),
                             zstandard.ZstdDecompressor())
    return ctx


def _enc_zstd(layer: object, shape: LayerShape) -> bytes:
    buf = np.frombuffer(layer, dtype=np.uint8)  # type: ignore[call-overload]
    if buf.nbytes != shape.raw_bytes:
        raise ValueError(f"layer must hold {shape.raw_bytes} bytes for {shape}, got {buf.nbytes}")
    if shape.itemsize == 2:  # two planes by shifts: contiguous passes, ~10x a strided transpose
        x = buf.view(np.uint16)
        planes = np.empty(buf.nbytes, dtype=np.uint8)
        np.bitwise_and(x, 0xFF, out=planes[: x.size], casting="unsafe")
        np.right_shift(x, 8, out=planes[x.size :], casting="unsafe")
    else:
        planes = np.ascontiguousarray(buf.reshape(-1, shape.itemsize).T)
    return _zstd()[0].compress(planes)


def _dec_zstd(data: object, shape: LayerShape, out: np.ndarray | None) -> np.ndarray:
    # Bounded by the raw size the layer must have: a frame that declares another content size
    # is refused before anything is allocated (a few KB can declare, and inflate to, hundreds
    # of MB), and one that declares none is decompressed into at most that many bytes.
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise CorruptData(f"zstd data does not decode: {e}") from None
    if declared not in (-1, shape.raw_bytes):
        raise CorruptData(f"zstd frame declares {declared} bytes, not the layer's "
                          f"{shape.raw_bytes}")
    try:
        planes = _zstd()[1].decompress(data, max_output_size=shape.raw_bytes,
                                       allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CorruptData(f"zstd data is not exactly one complete frame of the layer's "
                          f"{shape.raw_bytes} bytes: {e}") from None
    if len(planes) != shape.raw_bytes:
        raise CorruptData(f"zstd data decodes to {len(planes)} bytes, not {shape.raw_bytes}")
    res = _out(shape, out)
    p = np.frombuffer(planes, np.uint8).reshape(shape.itemsize, -1)
    if shape.itemsize == 2:
        o = res.view(np.uint16)
        np.left_shift(p[1], 8, out=o, dtype=np.uint16)
        o |= p[0]
    else:
        res.reshape(-1, shape.itemsize)[:] = p.T
    return res


def encode(name: str, layer: object, shape: LayerShape, *, native: bool | None = None
           ) -> bytes:
    """The stored bytes of one layer (raw bytes, K then V, in ``shape.dtype``) through codec
    ``name``. ``ValueError`` if ``layer`` does not hold ``shape.raw_bytes`` bytes, or holds
    non-finite values and the codec is lossy. ``native``: encode ``int8`` in C (same bytes)
    or with torch; default: C where it was built."""
    check_name(name)
    if name == "int8" and _use_native(native):
        buf = np.frombuffer(layer, dtype=np.uint8)  # type: ignore[call-overload]
        if buf.nbytes != shape.raw_bytes:
            raise ValueError(f"layer must hold {shape.raw_bytes} bytes for {shape}, "
                             f"got {buf.nbytes}")
        return native_decoders.encode_int8(np.ascontiguousarray(buf), shape)
    if name == "none":
        buf = np.frombuffer(layer, dtype=np.uint8)  # type: ignore[call-overload]
        if buf.nbytes != shape.raw_bytes:
            raise ValueError(f"layer must hold {shape.raw_bytes} bytes, got {buf.nbytes}")
        return buf.tobytes()
    if name == "zstd":
        return _enc_zstd(layer, shape)
    if name == "int4":
        return _enc_int4(layer, shape)
    return _enc_scaled(layer, shape, name)


def decode(name: str, data: object, shape: LayerShape, out: np.ndarray | None = None, *,
           native: bool | None = None) -> np.ndarray:
    """The raw layer bytes (uint8 ``[shape.raw_bytes]``, into ``out`` if given) that ``data``
    encodes through codec ``name``. :class:`CorruptData` if ``data`` does not decode to
    exactly one layer of ``shape``. ``native``: decode ``int8``/``fp8``/``int4`` with the C
    decoders (:mod:`kvstore.codecs.native_decoders`; same bytes) or with numpy/torch; default: C
    where
    it was built."""
    check_name(name)
    size = encoded_size(name, shape)
    nbytes = memoryview(data).nbytes  # type: ignore[arg-type]
    if size is not None and nbytes != size:
        raise CorruptData(f"{name} data of {nbytes} bytes; one layer of {shape} takes {size}")
    if name == "none":
        res = _out(shape, out)
        res[:] = np.frombuffer(data, dtype=np.uint8)  # type: ignore[call-overload]
        return res
    if name == "zstd":
        return _dec_zstd(data, shape, out)
    if name in _NATIVE and _use_native(native):
        res = _out(shape, out)
        raw = np.frombuffer(data, dtype=np.uint8)  # type: ignore[call-overload]
        offsets, size, kw = _native_spans(name, raw, [(0, nbytes)], shape)
        native_decoders.decode_layers(name, raw, offsets, shape, size, res, **kw)  # type: ignore
        return res
    if name == "int4":
        return _dec_int4(data, shape, out)
    return _dec_scaled(data, shape, name, out)


def _native_spans(name: str, data: np.ndarray, spans: list[tuple[int, int]],
                  shape: LayerShape) -> tuple[list[int], int, dict[str, object]]:
    """For one native call over the layers ``spans``: their offsets, one layer's encoded size
    and the codec's own arguments (fp8's table, int4's groups), once every span is checked to
    be one layer's encoded size inside ``data`` (:class:`CorruptData` naming the layer
    otherwise)."""
    size = encoded_size(name, shape)
    for i, (off, n) in enumerate(spans):
        if n != size or off < 0 or off + n > data.nbytes:
            raise CorruptData(f"{name} data of layer {i}: {n} bytes at {off} of "
                              f"{data.nbytes}; one layer of {shape} takes {size}")
    groups, g = _int4_groups(shape)
    kw = {"table": _FP8_VALUES if name == "fp8" else None,
          "groups": groups if name == "int4" else 0, "g": g if name == "int4" else 0}
    return [off for off, _ in spans], size, kw  # type: ignore[return-value]


def decode_layers(name: str, data: np.ndarray, spans: list[tuple[int, int]], shape: LayerShape,
                  out: np.ndarray, *, native: bool | None = None) -> None:
    """Decode consecutive layers of one chunk: layer ``i`` is ``data[off:off + n]`` for
    ``(off, n) = spans[i]``, its raw bytes go to ``out[i * shape.raw_bytes:]`` (``out``: uint8,
    ``len(spans) * shape.raw_bytes``). The same bytes and errors as :func:`decode` per layer,
    in one native call where the codec has one (``int8``, ``fp8``, ``int4``)."""
    check_name(name)
    rb = shape.raw_bytes
    if out.dtype != np.uint8 or out.ndim != 1 or out.nbytes != len(spans) * rb:
        raise ValueError(f"out must be a 1-D uint8 array of {len(spans) * rb} bytes")
    if name in _NATIVE and _use_native(native):
        offsets, size, kw = _native_spans(name, data, spans, shape)
        native_decoders.decode_layers(name, data, offsets, shape, size, out, **kw)  # type: ignore
        return
    for i, (off, n) in enumerate(spans):
        decode(name, data[off : off + n], shape, out[i * rb : (i + 1) * rb], native=False)


def decode_into(name: str, data: np.ndarray, spans: list[tuple[int, int]], shape: LayerShape,
                k_out: np.ndarray, v_out: np.ndarray, start: int, use: int, *,
                native: bool | None = None) -> None:
    """Decode consecutive layers of one chunk straight into keys and values: layer ``i`` is
    ``data[off:off + n]`` for ``(off, n) = spans[i]``; its first ``use`` tokens go to
    ``k_out[i, :, start:start + use]`` and ``v_out[i, :, start:start + use]`` (raw integer
    views ``[len(spans), H, T, D]`` in the layout dtype's item size). The bytes written equal
    those :func:`decode_layers` writes for the same tokens, and so do the errors
    (:class:`CorruptData`; the outputs are then partly written and must not be used).
    ``int8``/``fp8``/``int4`` into C-contiguous, non-overlapping outputs decode in one native
    call (:func:`native_decoders.decode_into`) unless ``native`` is False; otherwise each layer is
    decoded into a scratch layer and its tokens copied. Thread-safety: any number of threads
    at once, on disjoint outputs."""
    check_name(name)
    H, n, D = shape.num_kv_heads, shape.n_tokens, shape.head_dim
    item = shape.itemsize
    for what, a in (("k_out", k_out), ("v_out", v_out)):
        if not isinstance(a, np.ndarray) or a.ndim != 4 or a.shape[0] != len(spans) \
                or a.shape[1] != H or a.shape[3] != D or a.dtype.itemsize != item:
            raise ValueError(f"{what} must be a [{len(spans)}, {H}, T, {D}] array of "
                             f"{item}-byte items, got {getattr(a, 'shape', None)}")
    if k_out.shape != v_out.shape:
        raise ValueError(f"k_out and v_out differ in shape: {k_out.shape} and {v_out.shape}")
    if not (0 < use <= n and 0 <= start and start + use <= k_out.shape[2]):
        raise ValueError(f"use={use} tokens at start={start} do not fit a chunk of {n} tokens "
                         f"and {k_out.shape[2]} output tokens")
    if not spans:
        return
    if name in _NATIVE and _use_native(native) and _direct(k_out, v_out):
        _native_into(name, data, spans, shape, k_out, v_out, start, use)
        return
    rb = shape.raw_bytes
    layer = np.empty(rb, dtype=np.uint8)
    for i, (off, nb) in enumerate(spans):
        if off < 0 or off + nb > data.nbytes:
            raise CorruptData(f"{name} data of layer {i}: {nb} bytes at {off} of {data.nbytes}")
        decode(name, data[off : off + nb], shape, layer, native=native)
        kv = layer.view(k_out.dtype).reshape(2, H, n, D)  # [K/V, H, n, D]
        k_out[i, :, start : start + use] = kv[0, :, :use]
        v_out[i, :, start : start + use] = kv[1, :, :use]


def _direct(k_out: np.ndarray, v_out: np.ndarray) -> bool:
    """Whether the native decoder may write the outputs as they are."""
    return all(a.flags.c_contiguous and a.flags.writeable for a in (k_out, v_out)) \
        and not np.may_share_memory(k_out, v_out)


def _native_into(name: str, data: np.ndarray, spans: list[tuple[int, int]], shape: LayerShape,
                 k_out: np.ndarray, v_out: np.ndarray, start: int, use: int) -> None:
    """:func:`decode_into` in one native call; spans checked as :func:`decode_layers` does."""
    offsets, size, kw = _native_spans(name, data, spans, shape)
    native_decoders.decode_into(name, data, offsets, shape, size, k_out, v_out, start, use,
                                **kw)  # type: ignore[arg-type]
