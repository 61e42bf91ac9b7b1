"""A chunk's extent: its byte layout and its checksums.

An extent of ``n`` tokens holds, for each layer l, K of every kv-head [H, n, D] then V [H, n, D]
(``layer_token_bytes * n`` bytes per layer), so one layer of a chunk is one contiguous read.
Each layer has its own xxh3_64 checksum (``ChunkRecord.checksums``), so a layer-wise read is
verified layer by layer. :func:`verify` is the one comparison every read path uses.

A chunk stored through a codec (``ChunkRecord.codec`` != 0) holds each layer's encoded bytes
instead, back to back (``ChunkRecord.lengths``), and its checksums cover those encoded bytes:
:func:`encode_layers` makes them, :func:`kvstore.pipelines.chunk_reads.read_stored` reads and
verifies them,
:func:`decode_extent` and :func:`decode_into` decode them.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from kvstore.codecs import layer_codec
from kvstore.errors import CorruptData
from kvstore.format.records import ChunkRecord
from kvstore.layout import KVLayout

_INT_VIEW = {2: torch.int16, 4: torch.int32}
_NP_INT = {2: np.int16, 4: np.int32}


def raw(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a same-shape numpy integer view of its bytes (works for bf16 too)."""
    return t.view(_INT_VIEW[t.element_size()]).numpy()


def int_dtype(layout: KVLayout) -> type[np.integer]:
    """The numpy integer type of the layout's element size (raw views of KV bytes)."""
    return _NP_INT[layout.itemsize]


def empty_kv(layout: KVLayout, n_tokens: int, count: int = 1) -> list[torch.Tensor]:
    """``count`` new CPU tensors [L, H, n, D] in the layout dtype, allocated through numpy:
    numpy's large allocations get transparent huge pages (``madvise`` mode), so their first
    touch runs ~5-7x faster here than ``torch.empty`` memory's."""
    shape = layout.kv_shape(n_tokens)
    out = []
    for _ in range(count):
        arr = np.empty(shape, dtype=_NP_INT[layout.itemsize])
        out.append(torch.from_numpy(arr).view(layout.torch_dtype))
    return out


def raw_bytes(layout: KVLayout, n_tokens: int) -> int:
    return n_tokens * layout.token_bytes


def view(layout: KVLayout, buf: np.ndarray, n_tokens: int) -> np.ndarray:
    """The first extent bytes of a uint8 buffer as a raw integer view [L, 2 (K/V), H, n, D]."""
    nbytes = raw_bytes(layout, n_tokens)
    return buf[:nbytes].view(_NP_INT[layout.itemsize]).reshape(
        layout.num_layers, 2, layout.num_kv_heads, n_tokens, layout.head_dim)


def pieces(k: np.ndarray, v: np.ndarray, t0: int, n: int,
           layers: range | None = None) -> list[np.ndarray]:
    """Contiguous pieces of tokens [t0, t0+n) of raw K/V views [L, H, T, D], in extent order:
    for each layer, K of every head, then V of every head (each piece [n, D])."""
    L, H = k.shape[0], k.shape[1]
    out = []
    for layer in layers if layers is not None else range(L):
        out += [k[layer, h, t0 : t0 + n] for h in range(H)]
        out += [v[layer, h, t0 : t0 + n] for h in range(H)]
    return out


def checksums(extent: np.ndarray, num_layers: int) -> np.ndarray:
    """xxh3_64 of each layer's bytes of a contiguous extent ([num_layers * layer_bytes] uint8)."""
    per = len(extent) // num_layers
    return np.fromiter(
        (xxhash.xxh3_64_intdigest(extent[i * per : (i + 1) * per]) for i in range(num_layers)),
        dtype=np.uint64, count=num_layers,
    )


def piece_checksums(parts: list[np.ndarray], num_layers: int) -> np.ndarray:
    """The same checksums as :func:`checksums`, streamed over an extent given as pieces in
    extent order (each layer's pieces are consecutive and equally many)."""
    per = len(parts) // num_layers
    out = np.empty(num_layers, dtype=np.uint64)
    for layer in range(num_layers):
        h = xxhash.xxh3_64()
        for p in parts[layer * per : (layer + 1) * per]:
            h.update(p)
        out[layer] = h.intdigest()
    return out


def verify(rec: ChunkRecord, sums: np.ndarray, first_layer: int = 0) -> None:
    """Compare checksums of layers ``first_layer..`` of ``rec`` with the stored ones;
    :class:`CorruptData` naming the first bad layer otherwise."""
    want = rec.checksums[first_layer : first_layer + len(sums)]
    if sums.tobytes() != want.tobytes():  # (np.array_equal costs more than the hash here)
        bad = first_layer + int(np.flatnonzero(sums != want)[0])
        raise CorruptData(
            f"chunk {rec.key.hex()} (disk slot {rec.slot}) failed its checksum at layer {bad}")


def layer_shape(layout: KVLayout, n_tokens: int) -> layer_codec.LayerShape:
    return layer_codec.LayerShape(layout.dtype, layout.num_kv_heads, n_tokens, layout.head_dim)


def encode_layers(layout: KVLayout, codec: str, parts: list[np.ndarray], n_tokens: int,
                  capacity: int) -> list[bytes] | None:
    """Each layer of an extent given as pieces (:func:`pieces`) through ``codec``; None when
    the chunk is better stored raw: it holds values a lossy codec cannot encode (non-finite),
    or its encoded layers would not fit ``capacity`` bytes (a slot)."""
    shape = layer_shape(layout, n_tokens)
    per = len(parts) // layout.num_layers
    out = []
    for layer in range(layout.num_layers):
        raw_layer = np.concatenate([p.reshape(-1) for p in parts[layer * per:(layer + 1) * per]])
        try:
            out.append(layer_codec.encode(codec, raw_layer.view(np.uint8), shape))
        except ValueError:
            return None
    if sum(len(b) for b in out) > capacity:
        return None
    return out


def check_stored(rec: ChunkRecord, layout: KVLayout, capacity: int) -> int:
    """Stored bytes of ``rec``'s extent; :class:`CorruptData` if its record claims more than a
    slot holds or names no codec (a damaged or hostile catalog)."""
    nbytes = rec.stored_bytes(rec.n_tokens * layout.layer_token_bytes)
    if nbytes > capacity or len(rec.checksums) != layout.num_layers:
        raise CorruptData(f"chunk {rec.key.hex()} claims {nbytes} stored bytes; a slot holds "
                          f"{capacity}")
    layer_codec.codec_name(rec.codec)
    return nbytes


def stored_checksums(rec: ChunkRecord, stored: np.ndarray, raw_layer_bytes: int) -> np.ndarray:
    """Per-layer checksums of a chunk's stored bytes as read from its slot."""
    out = np.empty(len(rec.checksums), dtype=np.uint64)
    for layer in range(len(out)):
        off, n = rec.layer_span(layer, raw_layer_bytes)
        out[layer] = xxhash.xxh3_64_intdigest(stored[off : off + n])
    return out


def checksums_of(layout: KVLayout, rec: ChunkRecord, stored: np.ndarray) -> np.ndarray:
    """Per-layer checksums of ``rec``'s bytes as stored in its slot (its raw extent, or its
    coded layers back to back): what :func:`verify` compares with the record's."""
    if rec.codec == 0:
        return checksums(stored, layout.num_layers)
    return stored_checksums(rec, stored, rec.n_tokens * layout.layer_token_bytes)


def decode_layer(layout: KVLayout, rec: ChunkRecord, layer: int, data: np.ndarray,
                 out: np.ndarray | None = None) -> np.ndarray:
    """Raw bytes of layer ``layer`` of ``rec`` from its verified stored bytes ``data``
    (CorruptData naming the chunk and the layer if they do not decode)."""
    try:
        return layer_codec.decode(layer_codec.codec_name(rec.codec), data,
                             layer_shape(layout, rec.n_tokens), out)
    except CorruptData as err:
        raise CorruptData(f"chunk {rec.key.hex()}, layer {layer}: {err}") from None


def decode_extent(layout: KVLayout, rec: ChunkRecord, stored: np.ndarray,
                  out: np.ndarray) -> None:
    """Decode every layer of a verified coded extent into ``out`` (raw extent bytes)."""
    lb = rec.n_tokens * layout.layer_token_bytes
    layer_codec.decode_layers(layer_codec.codec_name(rec.codec), stored,
                         [rec.layer_span(layer, lb) for layer in range(layout.num_layers)],
                         layer_shape(layout, rec.n_tokens), out[: layout.num_layers * lb])


def decode_into(layout: KVLayout, rec: ChunkRecord, stored: np.ndarray, k_out: np.ndarray,
                v_out: np.ndarray, start: int, use: int) -> None:
    """Decode the ``use`` leading tokens of every layer of a verified coded extent straight
    into raw keys and values [L, H, T, D] at token ``start`` (CorruptData if it does not
    decode)."""
    lb = rec.n_tokens * layout.layer_token_bytes
    layer_codec.decode_into(layer_codec.codec_name(rec.codec), stored,
                       [rec.layer_span(layer, lb) for layer in range(layout.num_layers)],
                       layer_shape(layout, rec.n_tokens), k_out, v_out, start, use)
