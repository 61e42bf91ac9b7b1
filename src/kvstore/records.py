"""The catalog's record formats: fixed binary layouts (``struct`` + raw arrays).

No code-executing serialization format, so an untrusted store is safe to open: every decoder
checks version and lengths before building a record and raises :class:`FormatError` otherwise.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from kvstore.codecs import NAMES as CODEC_NAMES
from kvstore.errors import FormatError
from kvstore.hashing import HASH_BYTES

_CHUNK_V1 = struct.Struct("<B16sIII")  # version 1: parent, n_tokens, slot, num_layers
_CHUNK_V2 = struct.Struct("<B16sIIQI")  # version 2: + gen (the commit that wrote the extent)
_CHUNK_V3 = struct.Struct("<B16sIIQIB")  # version 3: + codec id, then per-layer stored lengths
_CONTEXT = struct.Struct("<BQQQI")  # version, n_tokens, created, last_access, n_chunks
_RESERVATION = struct.Struct("<BII")  # version, n_slots, n_held
_INDEX_V1 = struct.Struct("<BQ")  # version 1: bytes of the context's index directory
_INDEX = struct.Struct("<BQQ")  # version 2: + tag (the directory's unique suffix)
OWNER_BYTES = 16
MAX_SLOT = (1 << 32) - 1  # slots are stored as uint32


@dataclass(slots=True, eq=False)
class ChunkRecord:
    """Metadata of one stored chunk; its payload is one extent in a disk slot.

    ``checksums[l]`` is the xxh3_64 of layer l's bytes (K then V) inside the extent, so a
    layer-wise read is verified too. ``tokens`` are kept to answer partial-chunk matches and to
    rule out hash collisions. ``gen`` is the catalog generation of the commit that made the
    chunk visible: a reader that finds bytes failing their checksum re-checks (slot, gen) to
    tell a slot reused by another process (a miss) from corruption.

    ``codec`` is the id (:data:`kvstore.codecs.NAMES`) of the codec the extent was stored
    through; a codec other than ``none`` (0) also records ``lengths[l]``, the stored bytes of
    layer l (layers lie back to back in the slot), and ``checksums`` cover those stored bytes.
    A raw chunk is written as version 2, so stores that never use a codec keep their format;
    version 3 carries the codec. Versions 1 and 2 decode as codec ``none``.
    """

    key: bytes
    parent: bytes
    n_tokens: int
    slot: int
    gen: int
    checksums: np.ndarray  # [num_layers] uint64
    tokens: np.ndarray  # [n_tokens] uint32
    codec: int = 0
    lengths: np.ndarray | None = None  # [num_layers] uint32 when codec != 0

    def layer_span(self, layer: int, raw_layer_bytes: int) -> tuple[int, int]:
        """(offset in the slot, stored bytes) of layer ``layer``."""
        if self.lengths is None:
            return layer * raw_layer_bytes, raw_layer_bytes
        return int(self.lengths[:layer].sum()), int(self.lengths[layer])

    def stored_bytes(self, raw_layer_bytes: int) -> int:
        """Bytes of the extent in its slot."""
        if self.lengths is None:
            return raw_layer_bytes * len(self.checksums)
        return int(self.lengths.sum())

    def encode(self) -> bytes:
        nl = len(self.checksums)
        sums = self.checksums.astype("<u8").tobytes()
        toks = self.tokens.astype("<u4").tobytes()
        if self.codec == 0:
            return _CHUNK_V2.pack(2, self.parent, self.n_tokens, self.slot, self.gen, nl) \
                + sums + toks
        assert self.lengths is not None and len(self.lengths) == nl
        hdr = _CHUNK_V3.pack(3, self.parent, self.n_tokens, self.slot, self.gen, nl, self.codec)
        return hdr + sums + self.lengths.astype("<u4").tobytes() + toks

    @classmethod
    def decode(cls, key: bytes, raw: bytes) -> ChunkRecord:
        if len(raw) < 1 or raw[0] not in (1, 2, 3):
            raise FormatError(f"chunk record {key.hex()} is malformed (unknown version)")
        codec = 0
        try:
            if raw[0] == 1:
                _, parent, n, slot, nl = _CHUNK_V1.unpack_from(raw)
                gen, o = 0, _CHUNK_V1.size
            elif raw[0] == 2:
                _, parent, n, slot, gen, nl = _CHUNK_V2.unpack_from(raw)
                o = _CHUNK_V2.size
            else:
                _, parent, n, slot, gen, nl, codec = _CHUNK_V3.unpack_from(raw)
                o = _CHUNK_V3.size
        except struct.error as e:
            raise FormatError(f"chunk record {key.hex()} is truncated: {e}") from None
        per_layer = 12 if raw[0] == 3 else 8
        if len(raw) != o + per_layer * nl + 4 * n or len(key) != HASH_BYTES or n == 0 \
                or (raw[0] == 3 and not 0 < codec < len(CODEC_NAMES)):
            raise FormatError(f"chunk record {key.hex()} is malformed (version {raw[0]})")
        checks = np.frombuffer(raw, "<u8", nl, o).copy()
        o += 8 * nl
        lengths = None
        if raw[0] == 3:
            lengths = np.frombuffer(raw, "<u4", nl, o).copy()
            o += 4 * nl
        # a view of its own bytes: the prefix tree keeps those bytes as the ids' one copy
        tokens = np.frombuffer(raw[o : o + 4 * n], "<u4")
        return cls(key, parent, n, slot, gen, checks, tokens, codec, lengths)


@dataclass(slots=True, eq=False)
class ContextRecord:
    """A stored context: the ordered chunks of one put, keyed by its last chunk's address."""

    key: bytes
    n_tokens: int
    created: int
    last_access: int
    chunks: tuple[bytes, ...]

    def encode(self) -> bytes:
        hdr = _CONTEXT.pack(1, self.n_tokens, self.created, self.last_access, len(self.chunks))
        return hdr + b"".join(self.chunks)

    @classmethod
    def decode(cls, key: bytes, raw: bytes) -> ContextRecord:
        try:
            ver, n, created, last, nc = _CONTEXT.unpack_from(raw)
        except struct.error as e:
            raise FormatError(f"context record {key.hex()} is truncated: {e}") from None
        if ver != 1 or len(raw) != _CONTEXT.size + HASH_BYTES * nc or nc == 0 \
                or len(key) != HASH_BYTES:
            raise FormatError(f"context record {key.hex()} is malformed (version {ver})")
        o = _CONTEXT.size
        chunks = tuple(raw[o + i * HASH_BYTES : o + (i + 1) * HASH_BYTES] for i in range(nc))
        return cls(key, n, created, last, chunks)


@dataclass(frozen=True, slots=True)
class Reservation:
    """Disk slots a put in progress is writing, and the stored chunks it reuses (held: no
    process may free them until the put commits or aborts). Keyed by (owner, seq); the owner
    is the process (see :mod:`kvstore.owners`), so a dead owner's reservations are reclaimed."""

    owner: bytes
    seq: int
    slots: tuple[int, ...]
    held: tuple[bytes, ...]

    @property
    def key(self) -> bytes:
        return self.owner + self.seq.to_bytes(8, "big")

    def encode(self) -> bytes:
        return (_RESERVATION.pack(1, len(self.slots), len(self.held))
                + np.asarray(self.slots, dtype="<u4").tobytes() + b"".join(self.held))

    @classmethod
    def decode(cls, key: bytes, raw: bytes) -> Reservation:
        try:
            ver, ns, nh = _RESERVATION.unpack_from(raw)
        except struct.error as e:
            raise FormatError(f"reservation record {key.hex()} is truncated: {e}") from None
        o = _RESERVATION.size
        if ver != 1 or len(key) != OWNER_BYTES + 8 or len(raw) != o + 4 * ns + HASH_BYTES * nh:
            raise FormatError(f"reservation record {key.hex()} is malformed")
        slots = tuple(int(s) for s in np.frombuffer(raw, "<u4", ns, o))
        o += 4 * ns
        held = tuple(raw[o + i * HASH_BYTES : o + (i + 1) * HASH_BYTES] for i in range(nh))
        return cls(key[:OWNER_BYTES], int.from_bytes(key[OWNER_BYTES:], "big"), slots, held)


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """A context's indexes: the directory ``indexes/<context hex>-<tag hex>`` (tag 0: a
    directory named by the context alone) holding ``nbytes``. Each build gets a new tag, so a
    directory is only ever written under a name no entry references yet, and removed only once
    the entry that referenced it is gone."""

    nbytes: int
    tag: int

    def dirname(self, key: bytes) -> str:
        return key.hex() if self.tag == 0 else f"{key.hex()}-{self.tag:016x}"

    def encode(self) -> bytes:
        return _INDEX.pack(2, self.nbytes, self.tag)

    @classmethod
    def decode(cls, key: bytes, raw: bytes) -> IndexEntry:
        if len(key) != HASH_BYTES or not raw or raw[0] not in (1, 2):
            raise FormatError(f"index entry {key.hex()} is malformed")
        try:
            if raw[0] == 1:
                _, nbytes = _INDEX_V1.unpack(raw)
                return cls(nbytes, 0)
            _, nbytes, tag = _INDEX.unpack(raw)
        except struct.error:
            raise FormatError(f"index entry {key.hex()} is malformed") from None
        return cls(nbytes, tag)
