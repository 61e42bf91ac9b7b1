"""The bytes of one chunk in the remote tier: a self-describing, checksummed value.

A value is a header then the payload of every layer::

    magic "KVR1" | version u16 | codec u16 | n_tokens u32 | num_layers u32
    | raw_layer_bytes u64 | chunk key (16 bytes) | token ids (n_tokens x u32)
    | per layer: payload offset u64, payload length u64, xxh3_64 of the raw layer bytes
    | xxh3_64 of everything before it

The raw bytes of layer ``l`` are the layer's part of the chunk's extent (K of every head, then V;
see :mod:`kvstore.extent`), so the checksums are the ones the disk tier keeps. ``codec`` names
how each layer's payload encodes them (0 = ``none``: the raw bytes); a later codec (compression)
only adds an entry to :data:`CODECS`. Offsets in the table let a layer-wise load fetch one
layer of a chunk with one ``GETRANGE``. The header's size depends only on ``n_tokens`` and
``num_layers``, so a reader that knows what it asks for can fetch exactly the header.

Nothing read from a server is trusted: :func:`parse_header` checks magic, version, codec, sizes,
the header checksum, the key and the token ids against what was asked for, and
:func:`decode_layer` checks each layer's checksum after decoding. Every failure is
:class:`BadValue` (the tier counts it and treats the chunk as a miss).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash

MAGIC = b"KVR1"
VERSION = 1
_FIXED = struct.Struct("<4sHHIIQ16s")  # magic, version, codec, n_tokens, num_layers, raw, key
_TABLE = np.dtype([("offset", "<u8"), ("length", "<u8"), ("checksum", "<u8")])
KEY_BYTES = 16
MAX_LAYERS = 4096
MAX_TOKENS = 1 << 24


class BadValue(Exception):
    """A remote value that must not be used (wrong type, truncated, corrupt, foreign)."""


# codec id -> (name, encode(raw layer bytes) -> payload, decode(payload, raw length) -> raw)
Codec = tuple[str, Callable[[memoryview], bytes | memoryview],
              Callable[[memoryview, int], memoryview]]
CODECS: dict[int, Codec] = {
    0: ("none", lambda raw: raw, lambda payload, n: payload),
}
CODEC_IDS = {name: cid for cid, (name, _, _) in CODECS.items()}


def header_size(n_tokens: int, num_layers: int) -> int:
    return _FIXED.size + 4 * n_tokens + _TABLE.itemsize * num_layers + 8


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
    checksums: np.ndarray  # uint64 [num_layers], of the raw (decoded) layer bytes
    size: int  # header bytes

    @property
    def value_bytes(self) -> int:
        return int(self.offsets[-1] + self.lengths[-1]) if self.num_layers else self.size

    def layer_range(self, layer: int) -> tuple[int, int]:
        """(start, end inclusive) of layer ``layer``'s payload: the arguments of GETRANGE."""
        a = int(self.offsets[layer])
        return a, a + int(self.lengths[layer]) - 1


def encode(key: bytes, tokens: np.ndarray, extent: np.ndarray, num_layers: int, *,
           checksums: np.ndarray | None = None, codec: str = "none") -> list[bytes | memoryview]:
    """The value of a chunk as pieces to concatenate (header first): ``extent`` is its raw
    bytes (uint8, ``num_layers`` equal layers), ``checksums`` their per-layer xxh3_64 if
    already known."""
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
    payloads = [CODECS[cid][1](mv[i * per:(i + 1) * per]) for i in range(num_layers)]
    if checksums is None:
        checksums = np.array([xxhash.xxh3_64_intdigest(mv[i * per:(i + 1) * per])
                              for i in range(num_layers)], dtype=np.uint64)
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
                 num_layers: int, raw_layer_bytes_per_token: int) -> Header:
    """Check and parse the header at the start of ``data`` (a value or its first bytes).

    ``key`` and ``num_layers`` must be what the value says; ``tokens`` (if given) must equal its
    token ids; each layer must hold ``n_tokens * raw_layer_bytes_per_token`` raw bytes.
    Raises :class:`BadValue` otherwise."""
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
    if codec not in CODECS:
        raise BadValue(f"unknown codec id {codec}")
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
    if codec == 0 and not np.all(lengths == per):
        raise BadValue("raw layer lengths disagree with the header")
    return Header(key=vkey, codec=codec, n_tokens=n_tok, num_layers=n_lay,
                  raw_layer_bytes=per, tokens=toks, offsets=offsets, lengths=lengths,
                  checksums=table["checksum"].astype(np.uint64), size=hsize)


def decode_layer(h: Header, layer: int, payload: object, out: np.ndarray | None = None
                 ) -> np.ndarray:
    """The verified raw bytes of ``layer`` from its payload (uint8; written into ``out`` if
    given). :class:`BadValue` if the payload is short or fails its checksum."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise BadValue(f"expected bytes, got {type(payload).__name__}")
    mv = memoryview(payload)
    if len(mv) != int(h.lengths[layer]):
        raise BadValue(f"layer {layer}: {len(mv)} payload bytes, expected {int(h.lengths[layer])}")
    try:
        raw = CODECS[h.codec][2](mv, h.raw_layer_bytes)
    except Exception as e:  # a codec's own error on bad input: the value is unusable
        raise BadValue(f"layer {layer} does not decode: {e}") from e
    if len(raw) != h.raw_layer_bytes:
        raise BadValue(f"layer {layer} decodes to {len(raw)} bytes, expected "
                       f"{h.raw_layer_bytes}")
    if xxhash.xxh3_64_intdigest(raw) != int(h.checksums[layer]):
        raise BadValue(f"layer {layer} failed its checksum")
    arr = np.frombuffer(raw, dtype=np.uint8)
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
    for layer in range(h.num_layers):
        a, b = h.layer_range(layer)
        decode_layer(h, layer, mv[a:b + 1], out[layer * per:(layer + 1) * per])
    return out
