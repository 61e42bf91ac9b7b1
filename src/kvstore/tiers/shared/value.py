"""The bytes of one chunk in the remote tier: a self-describing, checksummed value.

A value is a header then the payload of every layer::

    magic "KVR1" | version u16 | codec u16 | n_tokens u32 | num_layers u32
    | raw_layer_bytes u64 | chunk key (16 bytes) | token ids (n_tokens x u32)
    | per layer: payload offset u64, payload length u64, xxh3_64 of the payload
    | xxh3_64 of everything before it

The raw bytes of layer ``l`` are the layer's part of the chunk's extent (K of every head, then V;
see :mod:`kvstore.format.chunk_extent`). ``codec`` names how each layer's payload encodes them: the
id of a
:mod:`kvstore.codecs.layer_codec` codec (0 = ``none``: the payload is the raw bytes, and its
checksum the
one the disk tier keeps for a raw chunk). Checksums cover the payload as stored (the encoded
bytes), so a reader verifies what it received before decoding it. Offsets in the table let a
layer-wise load fetch one layer of a chunk with one ``GETRANGE``. The header's size depends only
on ``n_tokens`` and ``num_layers``, so a reader that knows what it asks for can fetch exactly
the header.

Nothing read from a server is trusted: :func:`parse_header` checks magic, version, codec, sizes
(each payload's length against what its codec produces for the layout), the header checksum,
the key and the token ids against what was asked for; :func:`decode_layer` checks each layer's
checksum, then decodes it (:func:`kvstore.codecs.layer_codec.decode`, whose own checks refuse bytes
that do
not decode). Every failure is :class:`BadValue` (the tier counts it and treats the chunk as a
miss: a value that does not decode is never served). Values whose codec is lossy say so
(:attr:`Header.lossy`); the store counts the tokens they serve.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.codecs import layer_codec
from kvstore.codecs.layer_codec import LayerShape
from kvstore.errors import CorruptData
from kvstore.layout import KVLayout

MAGIC = b"KVR1"
VERSION = 1
_FIXED = struct.Struct("<4sHHIIQ16s")  # magic, version, codec, n_tokens, num_layers, raw, key
_TABLE = np.dtype([("offset", "<u8"), ("length", "<u8"), ("checksum", "<u8")])
KEY_BYTES = 16
MAX_LAYERS = 4096
MAX_TOKENS = 1 << 24


class BadValue(Exception):
    """A remote value that must not be used (wrong type, truncated, corrupt, foreign)."""


# codec name -> the id a value stores: the kvstore.codecs.layer_codec ids, as chunk records use them
CODEC_IDS = {name: layer_codec.codec_id(name) for name in layer_codec.NAMES}
_ZSTD_SLACK = 1 << 12  # a zstd payload may exceed its raw bytes by a frame's overhead


def layer_shape(layout: KVLayout, n_tokens: int) -> LayerShape:
    return LayerShape(layout.dtype, layout.num_kv_heads, n_tokens, layout.head_dim)


def header_size(n_tokens: int, num_layers: int) -> int:
    return _FIXED.size + 4 * n_tokens + _TABLE.itemsize * num_layers + 8


def max_value_bytes(n_tokens: int, layout: KVLayout) -> int:
    """The most bytes a valid value of ``n_tokens`` can have under any codec (a zstd payload
    may exceed its raw bytes by a frame's overhead; the others do not exceed them): what a
    reader fetches at most."""
    return header_size(n_tokens, layout.num_layers) + layout.num_layers * (
        n_tokens * layout.layer_token_bytes + _ZSTD_SLACK)


@dataclass(frozen=True, slots=True)
class Header:
    """A verified header: what the value holds and where each layer's payload is."""

    key: bytes
    codec: int
    n_tokens: int
    num_layers: int
    raw_layer_bytes: int
    tokens: np.ndarray  # uint32 [n_tokens]
    offsets: np.ndarray  # uint64 [num_layers], from the start of the value
    lengths: np.ndarray  # uint64 [num_layers]
    checksums: np.ndarray  # uint64 [num_layers], of each payload (the encoded bytes)
    size: int  # header bytes
    shape: LayerShape | None = None  # one layer's shape (known when the reader gave a layout)

    @property
    def codec_name(self) -> str:
        return layer_codec.NAMES[self.codec]

    @property
    def lossy(self) -> bool:
        """Whether the value went through a lossy codec (its KV is not a recompute's)."""
        return self.codec_name in layer_codec.LOSSY

    @property
    def value_bytes(self) -> int:
        return int(self.offsets[-1] + self.lengths[-1]) if self.num_layers else self.size

    def layer_range(self, layer: int) -> tuple[int, int]:
        """(start, end inclusive) of layer ``layer``'s payload: the arguments of GETRANGE."""
        a = int(self.offsets[layer])
        return a, a + int(self.lengths[layer]) - 1


def encode(key: bytes, tokens: np.ndarray, extent: np.ndarray, num_layers: int, *,
           checksums: np.ndarray | None = None, codec: str = "none",
           layout: KVLayout | None = None) -> list[bytes | memoryview]:
    """The value of a chunk as pieces to concatenate (header first): ``extent`` is its raw
    bytes (uint8, ``num_layers`` equal layers), ``checksums`` their per-layer xxh3_64 if
    already known (used with codec ``none`` only). A codec other than ``none`` needs the
    ``layout``; a lossy codec raises ``ValueError`` for non-finite KV (the caller then sends
    the chunk with ``none``)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
    if codec not in CODEC_IDS:
        raise ValueError(f"codec must be one of {sorted(CODEC_IDS)}, got {codec!r}")
    cid = CODEC_IDS[codec]
    toks = np.ascontiguousarray(tokens, dtype="<u4")
    ext = np.ascontiguousarray(extent).view(np.uint8).reshape(-1)
    if num_layers <= 0 or len(ext) % num_layers:
        raise ValueError(f"extent of {len(ext)} bytes does not split into {num_layers} layers")
    per = len(ext) // num_layers
    mv = memoryview(ext)
    raws = [mv[i * per:(i + 1) * per] for i in range(num_layers)]
    payloads: list[bytes | memoryview]
    if cid == 0:
        payloads = list(raws)
    else:
        if layout is None or layout.num_layers != num_layers \
                or per % layout.layer_token_bytes or len(toks) != per // layout.layer_token_bytes:
            raise ValueError(f"codec {codec!r} needs the layout of a {len(toks)}-token extent")
        shape = layer_shape(layout, len(toks))
        payloads = [layer_codec.encode(codec, r, shape) for r in raws]
        checksums = None
    if checksums is None:
        checksums = np.array([xxhash.xxh3_64_intdigest(p) for p in payloads], dtype=np.uint64)
    hsize = header_size(len(toks), num_layers)
    table = np.zeros(num_layers, dtype=_TABLE)
    lengths = np.array([len(p) for p in payloads], dtype=np.uint64)
    table["length"] = lengths
    table["offset"] = hsize + np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.uint64)
    table["checksum"] = checksums
    head = (_FIXED.pack(MAGIC, VERSION, cid, len(toks), num_layers, per, key)
            + toks.tobytes() + table.tobytes())
    head += struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
    return [head, *payloads]


def encode_bytes(*args: object, **kw: object) -> bytes:
    """:func:`encode` joined into one bytes object."""
    return b"".join(encode(*args, **kw))  # type: ignore[arg-type]


def parse_header(data: object, *, key: bytes, tokens: np.ndarray | None,
                 num_layers: int, raw_layer_bytes_per_token: int,
                 layout: KVLayout | None = None) -> Header:
    """Check and parse the header at the start of ``data`` (a value or its first bytes).

    ``key`` and ``num_layers`` must be what the value says; ``tokens`` (if given) must equal its
    token ids; each layer must hold ``n_tokens * raw_layer_bytes_per_token`` raw bytes, and its
    payload as many bytes as its codec makes of that. A value stored through a codec other than
    ``none`` can only be read with the ``layout``. Raises :class:`BadValue` otherwise."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise BadValue(f"expected bytes, got {type(data).__name__}")
    mv = memoryview(data)
    if len(mv) < _FIXED.size:
        raise BadValue(f"value of {len(mv)} bytes is shorter than a header")
    magic, version, codec, n_tok, n_lay, per, vkey = _FIXED.unpack_from(mv)
    if magic != MAGIC:
        raise BadValue("not a kvstore value (bad magic)")
    if version != VERSION:
        raise BadValue(f"value format version {version} is not supported")
    if not 0 <= codec < len(layer_codec.NAMES):
        raise BadValue(f"unknown codec id {codec}")
    if codec != 0 and layout is None:
        raise BadValue(f"value stored through codec {layer_codec.NAMES[codec]!r}: no layout to "
                       f"decode it with")
    if n_lay != num_layers or not 0 < n_tok <= MAX_TOKENS:
        raise BadValue(f"value has {n_lay} layers and {n_tok} tokens, expected {num_layers} "
                       f"layers")
    if per != n_tok * raw_layer_bytes_per_token:
        raise BadValue(f"value has {per} bytes per layer for {n_tok} tokens")
    hsize = header_size(n_tok, n_lay)
    if len(mv) < hsize:
        raise BadValue(f"value of {len(mv)} bytes is shorter than its header ({hsize})")
    (want,) = struct.unpack_from("<Q", mv, hsize - 8)
    if xxhash.xxh3_64_intdigest(mv[: hsize - 8]) != want:
        raise BadValue("header checksum mismatch")
    if vkey != key:
        raise BadValue("value belongs to another chunk key")
    toks = np.frombuffer(mv, dtype="<u4", count=n_tok, offset=_FIXED.size).copy()
    if tokens is not None and not np.array_equal(toks, tokens):
        raise BadValue("value holds other token ids than asked for")
    table = np.frombuffer(mv, dtype=_TABLE, count=n_lay, offset=_FIXED.size + 4 * n_tok)
    offsets = table["offset"].astype(np.uint64)
    lengths = table["length"].astype(np.uint64)
    ends = np.concatenate(([hsize], (offsets + lengths)[:-1]))
    if not np.array_equal(offsets, ends.astype(np.uint64)):
        raise BadValue("layer table is not contiguous")
    shape = None if layout is None else layer_shape(layout, n_tok)
    if shape is not None and shape.raw_bytes != per:
        raise BadValue(f"value has {per} bytes per layer; the layout makes {shape.raw_bytes}")
    fixed = per if codec == 0 else layer_codec.encoded_size(layer_codec.NAMES[codec], shape)  # type: ignore
    if fixed is not None and not np.all(lengths == fixed):
        raise BadValue(f"{layer_codec.NAMES[codec]} layer lengths disagree with the header")
    if fixed is None and not np.all((lengths > 0) & (lengths <= per + _ZSTD_SLACK)):
        raise BadValue(f"{layer_codec.NAMES[codec]} layer lengths out of range")
    return Header(key=vkey, codec=codec, n_tokens=n_tok, num_layers=n_lay,
                  raw_layer_bytes=per, tokens=toks, offsets=offsets, lengths=lengths,
                  checksums=table["checksum"].astype(np.uint64), size=hsize, shape=shape)


def checked_header(head: object, nbytes: int, key: bytes, tokens: np.ndarray | None,
                   layout: KVLayout) -> Header:
    """The checked header of chunk ``key``'s value (``head``: its first bytes, ``nbytes``: its
    whole length, as the server reports it); :class:`BadValue` if it is not that chunk's
    value of ``tokens`` (any tokens if None) in ``layout``, or its length disagrees."""
    h = parse_header(head, key=key, tokens=tokens, num_layers=layout.num_layers,
                     raw_layer_bytes_per_token=layout.layer_token_bytes, layout=layout)
    if nbytes != h.value_bytes:
        raise BadValue(f"value of {nbytes} bytes, its header says {h.value_bytes}")
    return h


def decode_layer(h: Header, layer: int, payload: object, out: np.ndarray | None = None
                 ) -> np.ndarray:
    """The verified raw bytes of ``layer`` from its payload (uint8; written into ``out`` if
    given). :class:`BadValue` if the payload is short, fails its checksum or does not
    decode."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise BadValue(f"expected bytes, got {type(payload).__name__}")
    mv = memoryview(payload)
    if len(mv) != int(h.lengths[layer]):
        raise BadValue(f"layer {layer}: {len(mv)} payload bytes, expected {int(h.lengths[layer])}")
    if xxhash.xxh3_64_intdigest(mv) != int(h.checksums[layer]):
        raise BadValue(f"layer {layer} failed its checksum")
    if h.codec != 0:
        if out is not None and (out.dtype != np.uint8 or out.nbytes != h.raw_layer_bytes):
            raise ValueError(f"out must be uint8 of {h.raw_layer_bytes} bytes")
        try:
            return layer_codec.decode(h.codec_name, mv, h.shape, out)  # type: ignore[arg-type]
        except CorruptData as e:
            raise BadValue(f"layer {layer} does not decode: {e}") from None
    arr = np.frombuffer(mv, dtype=np.uint8)
    if out is not None:
        np.copyto(out, arr)
        return out
    return arr


def decode(h: Header, value: object, out: np.ndarray | None = None) -> np.ndarray:
    """The verified raw extent (all layers) of a whole value; into ``out`` (uint8) if given."""
    if not isinstance(value, bytes | bytearray | memoryview):
        raise BadValue(f"expected bytes, got {type(value).__name__}")
    mv = memoryview(value)
    if len(mv) != h.value_bytes:
        raise BadValue(f"value of {len(mv)} bytes, expected {h.value_bytes}")
    per = h.raw_layer_bytes
    if out is None and h.codec == 0:  # the payload is the extent: verify it in place
        for layer in range(h.num_layers):
            a, b = h.layer_range(layer)
            if xxhash.xxh3_64_intdigest(mv[a:b + 1]) != int(h.checksums[layer]):
                raise BadValue(f"layer {layer} failed its checksum")
        return np.frombuffer(mv, dtype=np.uint8, offset=h.size)
    if out is None:
        out = np.empty(per * h.num_layers, dtype=np.uint8)
    if h.codec == 0:
        for layer in range(h.num_layers):
            a, b = h.layer_range(layer)
            decode_layer(h, layer, mv[a:b + 1], out[layer * per:(layer + 1) * per])
        return out
    spans = []
    for layer in range(h.num_layers):  # every payload verified before any is decoded
        a, b = h.layer_range(layer)
        if xxhash.xxh3_64_intdigest(mv[a:b + 1]) != int(h.checksums[layer]):
            raise BadValue(f"layer {layer} failed its checksum")
        spans.append((a, b + 1 - a))
    try:
        layer_codec.decode_layers(h.codec_name, np.frombuffer(mv, dtype=np.uint8), spans,
                             h.shape, out[: per * h.num_layers])  # type: ignore[arg-type]
    except CorruptData as e:
        raise BadValue(f"value does not decode: {e}") from None
    return out
