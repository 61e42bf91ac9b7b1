"""The catalog's record formats: fixed binary layouts (``struct`` + raw arrays).

No code-executing serialization format, so an untrusted store is safe to open: every decoder
checks version and lengths before building a record and raises :class:`FormatError` otherwise.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from kvstore.codecs.names import NAMES as CODEC_NAMES
from kvstore.errors import FormatError
from kvstore.format.hashing import HASH_BYTES

_CHUNK_V1 = struct.Struct("<B16sIII")  # version 1: parent, n_tokens, slot, num_layers
_CHUNK_V2 = struct.Struct("<B16sIIQI")  # version 2: + gen (the commit that wrote the extent)
_CHUNK_V3 = struct.Struct("<B16sIIQIB")  # version 3: + codec id, then per-layer stored lengths
_CONTEXT = struct.Struct("<BQQQI")  # version, n_tokens, created, last_access, n_chunks
_RESERVATION = struct.Struct("<BII")  # version, n_slots, n_held
_INDEX_V1 = struct.Struct("<BQ")  # version 1: bytes of the context's index directory
_INDEX = struct.Struct("<BQQ")  # version 2: + tag (the directory's unique suffix)
_PIN = struct.Struct("<BBddQQH")  # version, flags, expires, created, nbytes, n_tokens, ns len
_PIN_HAS_NS, _PIN_HAS_EXPIRY = 1, 2
MAX_NAMESPACE_BYTES = 4096  # a pin record's namespace (UTF-8)
OWNER_BYTES = 16
MAX_SLOT = (1 << 32) - 1  # slots are stored as uint32
_U4 = np.dtype("<u4")
_U8 = np.dtype("<u8")


def _id_bytes(tokens: np.ndarray | bytes) -> bytes:
    """Token ids as little-endian uint32 bytes: the bytes object ``tokens`` views if it views
    exactly one, else a copy."""
    if isinstance(tokens, bytes):
        return tokens
    base = tokens.base
    if isinstance(base, bytes) and tokens.dtype == _U4 and len(base) == tokens.nbytes:
        return base
    return np.ascontiguousarray(tokens, dtype=_U4).tobytes()


class ChunkRecord:
    """Metadata of one stored chunk; its payload is one extent in a disk slot.

    ``checksums[l]`` is the xxh3_64 of layer l's bytes (K then V) inside the extent, so a
    layer-wise read is verified too. ``tokens`` are kept to answer partial-chunk matches and to
    rule out hash collisions. ``gen`` is the catalog generation of the commit that made the
    chunk visible: a reader that finds bytes failing their checksum re-checks (slot, gen) to
    tell a slot reused by another process (a miss) from corruption.

    ``codec`` is the id (:data:`kvstore.codecs.layer_codec.NAMES`) of the codec the extent was
    stored
    through; a codec other than ``none`` (0) also records ``lengths[l]``, the stored bytes of
    layer l (layers lie back to back in the slot), and ``checksums`` cover those stored bytes.
    A raw chunk is written as version 2, so stores that never use a codec keep their format;
    version 3 carries the codec. Versions 1 and 2 decode as codec ``none``.

    Compact in memory (a store keeps one per stored chunk resident): the token ids are one
    bytes object (:attr:`token_ids`, which the prefix tree's child index shares), the
    checksums and lengths another; ``tokens``, ``checksums`` and ``lengths`` are read-only
    array views of them made on access (assigning an array replaces the bytes).

    Thread-safety: none; a record is mutated only by its owner (the put building it, or the
    tree with the store's metadata lock held).
    """

    __slots__ = ("key", "parent", "n_tokens", "slot", "gen", "codec", "_sums", "_ids")

    def __init__(self, key: bytes, parent: bytes, n_tokens: int, slot: int, gen: int,
                 checksums: np.ndarray, tokens: np.ndarray | bytes, codec: int = 0,
                 lengths: np.ndarray | None = None) -> None:
        self.key = key
        self.parent = parent
        self.n_tokens = n_tokens
        self.slot = slot
        self.gen = gen
        self.codec = codec
        self._ids = _id_bytes(tokens)
        if (codec == 0) != (lengths is None):
            raise ValueError("a chunk record has per-layer lengths exactly when its codec is "
                             "not none")
        self._sums = b""
        self._set_sums(checksums, lengths)

    def _set_sums(self, checksums: np.ndarray, lengths: np.ndarray | None) -> None:
        sums = np.ascontiguousarray(checksums, dtype=_U8).tobytes()
        if lengths is not None:
            sums += np.ascontiguousarray(lengths, dtype=_U4).tobytes()
        self._sums = sums

    @property
    def num_layers(self) -> int:
        return len(self._sums) // (8 if self.codec == 0 else 12)

    @property
    def checksums(self) -> np.ndarray:  # [num_layers] uint64, read-only
        return np.frombuffer(self._sums, _U8, self.num_layers)

    @checksums.setter
    def checksums(self, value: np.ndarray) -> None:
        self._set_sums(value, self.lengths)

    @property
    def lengths(self) -> np.ndarray | None:  # [num_layers] uint32 when codec != 0
        if self.codec == 0:
            return None
        nl = self.num_layers
        return np.frombuffer(self._sums, _U4, nl, 8 * nl)

    @property
    def tokens(self) -> np.ndarray:  # [n_tokens] uint32, read-only
        return np.frombuffer(self._ids, _U4)

    @tokens.setter
    def tokens(self, value: np.ndarray | bytes) -> None:
        self._ids = _id_bytes(value)

    @property
    def token_ids(self) -> bytes:
        """The token ids as little-endian uint32 bytes (the record's own copy)."""
        return self._ids

    def __repr__(self) -> str:
        return (f"ChunkRecord(key={self.key.hex()}, parent={self.parent.hex()}, "
                f"n_tokens={self.n_tokens}, slot={self.slot}, gen={self.gen}, "
                f"codec={self.codec})")

    def layer_span(self, layer: int, raw_layer_bytes: int) -> tuple[int, int]:
        """(offset in the slot, stored bytes) of layer ``layer``."""
        lengths = self.lengths
        if lengths is None:
            return layer * raw_layer_bytes, raw_layer_bytes
        return int(lengths[:layer].sum()), int(lengths[layer])

    def stored_bytes(self, raw_layer_bytes: int) -> int:
        """Bytes of the extent in its slot."""
        if self.codec == 0:
            return raw_layer_bytes * (len(self._sums) >> 3)
        return int(self.lengths.sum())  # type: ignore[union-attr]

    def encode(self) -> bytes:
        nl = self.num_layers
        if self.codec == 0:
            return _CHUNK_V2.pack(2, self.parent, self.n_tokens, self.slot, self.gen, nl) \
                + self._sums + self._ids
        hdr = _CHUNK_V3.pack(3, self.parent, self.n_tokens, self.slot, self.gen, nl, self.codec)
        return hdr + self._sums + self._ids

    @classmethod
    def decode(cls, key: bytes, raw: bytes) -> ChunkRecord:
        if len(raw) < 1 or raw[0] not in (1, 2, 3):
            raise FormatError(f"chunk record {key.hex()} is malformed (unknown version)")
        codec = 0
        try:
            if raw[0] == 2:
                _, parent, n, slot, gen, nl = _CHUNK_V2.unpack_from(raw)
                o = _CHUNK_V2.size
            elif raw[0] == 1:
                _, parent, n, slot, nl = _CHUNK_V1.unpack_from(raw)
                gen, o = 0, _CHUNK_V1.size
            else:
                _, parent, n, slot, gen, nl, codec = _CHUNK_V3.unpack_from(raw)
                o = _CHUNK_V3.size
        except struct.error as e:
            raise FormatError(f"chunk record {key.hex()} is truncated: {e}") from None
        per_layer = 12 if raw[0] == 3 else 8
        if len(raw) != o + per_layer * nl + 4 * n or len(key) != HASH_BYTES or n == 0 \
                or (raw[0] == 3 and not 0 < codec < len(CODEC_NAMES)):
            raise FormatError(f"chunk record {key.hex()} is malformed (version {raw[0]})")
        rec = cls.__new__(cls)
        rec.key, rec.parent, rec.n_tokens, rec.slot, rec.gen, rec.codec = \
            key, parent, n, slot, gen, codec
        t = o + per_layer * nl
        rec._sums = raw[o:t]
        rec._ids = raw[t:]
        return rec

    @classmethod
    def decode_all(cls, items: Iterable[tuple[bytes, bytes]],
                   malformed: list[tuple[str, bytes, str]]) -> dict[bytes, ChunkRecord]:
        """:meth:`decode` of every (key, raw) into a dict by key, in one loop (a full load
        decodes a million): records that do not decode go to ``malformed`` as ("chunks",
        key, why). The common record (version 2, raw) is decoded inline, others by
        :meth:`decode`."""
        out: dict[bytes, ChunkRecord] = {}
        unpack, head = _CHUNK_V2.unpack_from, _CHUNK_V2.size
        new = cls.__new__
        # Chunks committed together (a put's, a bulk load's) share one generation: one int
        # object for them all, not one each (28 bytes a record; at most _GENS_MAX kept).
        gens: dict[int, int] = {}
        for key, raw in items:
            if raw[:1] == b"\x02" and len(raw) >= head and len(key) == HASH_BYTES:
                _, parent, n, slot, gen, nl = unpack(raw)
                t = head + 8 * nl
                if len(raw) == t + 4 * n and n:
                    shared = gens.get(gen)
                    if shared is not None:
                        gen = shared
                    elif len(gens) < _GENS_MAX:
                        gens[gen] = gen
                    rec = new(cls)
                    rec.key, rec.parent, rec.n_tokens, rec.slot, rec.gen, rec.codec = \
                        key, parent, n, slot, gen, 0
                    rec._sums = raw[head:t]
                    rec._ids = raw[t:]
                    out[key] = rec
                    continue
            try:
                out[key] = cls.decode(key, raw)
            except FormatError as e:
                malformed.append(("chunks", key, str(e)))
        return out


_KEYS: dict[int, struct.Struct] = {}
_GENS_MAX = 1 << 16  # distinct generations shared by one full load's chunk records
_KEY_OF = attrgetter("key")
# Token counts of contexts repeat (a million contexts have far fewer distinct lengths): one
# int object per count (for the first 65,536 counts seen), shared by every record of that
# length.
_COUNTS: dict[int, int] = {}
_COUNTS_MAX = 1 << 16


def _shared_count(n: int) -> int:
    got = _COUNTS.get(n)
    if got is not None:
        return got
    if len(_COUNTS) < _COUNTS_MAX:
        _COUNTS[n] = n
    return n


def _keys(n: int) -> struct.Struct:
    """The format of ``n`` chunk keys back to back (one unpack makes the tuple of keys)."""
    fmt = _KEYS.get(n)
    if fmt is None:
        fmt = struct.Struct(f"{HASH_BYTES}s" * n)
        if n <= 64:
            _KEYS[n] = fmt
    return fmt


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
    def decode(cls, key: bytes, raw: bytes,
               chunks: Mapping[bytes, ChunkRecord] | None = None) -> ContextRecord:
        """The record stored under ``key``. With ``chunks`` (records by key), the keys it
        holds, and its own, are those records' own key objects where they exist (one copy of
        each key in memory, however many records name it)."""
        try:
            ver, n, created, last, nc = _CONTEXT.unpack_from(raw)
        except struct.error as e:
            raise FormatError(f"context record {key.hex()} is truncated: {e}") from None
        if ver != 1 or len(raw) != _CONTEXT.size + HASH_BYTES * nc or nc == 0 \
                or len(key) != HASH_BYTES:
            raise FormatError(f"context record {key.hex()} is malformed (version {ver})")
        keys = (_KEYS.get(nc) or _keys(nc)).unpack_from(raw, _CONTEXT.size)
        if chunks:
            try:
                keys = tuple(map(_KEY_OF, map(chunks.__getitem__, keys)))
            except KeyError:  # one is missing: recovery drops the context
                keys = tuple([c if r is None else r.key
                              for c, r in zip(keys, map(chunks.get, keys), strict=True)])
            if keys[-1] == key:
                key = keys[-1]
        return cls(key, _shared_count(n), created, last, keys)

    @classmethod
    def decode_all(cls, items: Iterable[tuple[bytes, bytes]],
                   chunks: Mapping[bytes, ChunkRecord] | None,
                   malformed: list[tuple[str, bytes, str]]) -> dict[bytes, ContextRecord]:
        """:meth:`decode` of every (key, raw) into a dict by key, in one loop (a full load
        decodes a million): records that do not decode go to ``malformed`` as ("contexts",
        key, why). Well-formed records whose chunks are all in ``chunks`` are decoded inline,
        others by :meth:`decode`."""
        out: dict[bytes, ContextRecord] = {}
        unpack, head = _CONTEXT.unpack_from, _CONTEXT.size
        formats, counts = _KEYS, _COUNTS
        chunk_of = chunks.__getitem__ if chunks else None
        for key, raw in items:
            if chunk_of is not None and len(raw) >= head and len(key) == HASH_BYTES:
                ver, n, created, last, nc = unpack(raw)
                fmt = formats.get(nc)
                if ver == 1 and fmt is not None and len(raw) == head + HASH_BYTES * nc:
                    try:
                        keys = tuple([chunk_of(c).key for c in fmt.unpack_from(raw, head)])
                    except KeyError:  # one is missing: recovery drops the context
                        pass
                    else:
                        if keys[-1] == key:
                            key = keys[-1]
                        if last == created:  # never read since its put: one int object
                            last = created
                        out[key] = cls(key, counts.get(n) or _shared_count(n), created, last,
                                       keys)
                        continue
            try:
                rec = cls.decode(key, raw, chunks)
            except FormatError as e:
                malformed.append(("contexts", key, str(e)))
                continue
            out[rec.key] = rec
        return out


@dataclass(frozen=True, slots=True)
class Reservation:
    """Disk slots a put in progress is writing, and the stored chunks it reuses (held: no
    process may free them until the put commits or aborts). Keyed by (owner, seq); the owner
    is the process (see :mod:`kvstore.format.writer_registry`), so a dead owner's reservations are
    reclaimed."""

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


@dataclass(frozen=True, slots=True)
class PinRecord:
    """A retention hint on one stored context (``Store.pin``), keyed in the catalog by the
    context's key (the chain address of its last chunk, which its namespace seeds).

    ``namespace``: the context's namespace as the caller named it (None: the default one; the
    catalog stores no other record of namespace names). ``expires``: wall-clock seconds since
    the epoch after which the pin no longer holds (None: until ``unpin``). ``nbytes``: the
    disk bytes its chunks take (one disk slot each) when it was pinned; ``n_tokens`` its
    length; ``created`` the wall-clock time of the pin."""

    key: bytes
    namespace: str | None
    expires: float | None
    nbytes: int
    n_tokens: int
    created: float

    def live(self, now: float) -> bool:
        """Whether the pin holds at wall-clock time ``now``."""
        return self.expires is None or now < self.expires

    def encode(self) -> bytes:
        ns = b"" if self.namespace is None else self.namespace.encode("utf-8")
        flags = (_PIN_HAS_NS if self.namespace is not None else 0) | \
            (_PIN_HAS_EXPIRY if self.expires is not None else 0)
        return _PIN.pack(1, flags, 0.0 if self.expires is None else self.expires,
                         self.created, self.nbytes, self.n_tokens, len(ns)) + ns

    @classmethod
    def decode(cls, key: bytes, raw: bytes) -> PinRecord:
        try:
            ver, flags, expires, created, nbytes, n, nl = _PIN.unpack_from(raw)
        except struct.error as e:
            raise FormatError(f"pin record {key.hex()} is truncated: {e}") from None
        if ver != 1 or len(key) != HASH_BYTES or len(raw) != _PIN.size + nl \
                or flags & ~(_PIN_HAS_NS | _PIN_HAS_EXPIRY) or nl > MAX_NAMESPACE_BYTES \
                or (nl and not flags & _PIN_HAS_NS) or n == 0 \
                or not all(map(math.isfinite, (expires, created))):
            raise FormatError(f"pin record {key.hex()} is malformed")
        try:
            ns = raw[_PIN.size:].decode("utf-8") if flags & _PIN_HAS_NS else None
        except UnicodeDecodeError:
            raise FormatError(f"pin record {key.hex()} names no UTF-8 namespace") from None
        return cls(key, ns, expires if flags & _PIN_HAS_EXPIRY else None, nbytes, n, created)
