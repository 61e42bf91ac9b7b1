"""The LMDB catalog: chunk records, session records and store metadata.

The catalog is the only writer of metadata. Records are fixed binary layouts (``struct`` +
raw arrays) — no code-executing serialization format, so an untrusted store is safe to open.
Write transactions are context managers: they commit on success and abort on exception.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import lmdb
import numpy as np

from kvstore.errors import FormatError, StoreLocked
from kvstore.hashing import HASH_BYTES

FORMAT_VERSION = 1

_CHUNK_HDR = struct.Struct("<B16sIII")  # version, parent, n_tokens, slot, num_layers
_SESSION_HDR = struct.Struct("<BQQQI")  # version, n_tokens, created, last_access, n_chunks


@dataclass(slots=True, eq=False)
class ChunkRecord:
    """Metadata of one stored chunk; its payload is one extent in a segment slot.

    ``checksums[l]`` is the xxh3_64 of layer l's bytes (K then V) inside the extent, so a
    layer-wise read is verified too. ``tokens`` are kept to answer partial-chunk matches and to
    rule out hash collisions.
    """

    key: bytes
    parent: bytes
    n_tokens: int
    slot: int
    checksums: np.ndarray  # [num_layers] uint64
    tokens: np.ndarray  # [n_tokens] uint32

    def encode(self) -> bytes:
        hdr = _CHUNK_HDR.pack(1, self.parent, self.n_tokens, self.slot, len(self.checksums))
        return hdr + self.checksums.astype("<u8").tobytes() + self.tokens.astype("<u4").tobytes()

    @classmethod
    def decode(cls, key: bytes, raw: bytes) -> ChunkRecord:
        try:
            ver, parent, n, slot, nl = _CHUNK_HDR.unpack_from(raw)
        except struct.error as e:
            raise FormatError(f"chunk record {key.hex()} is truncated: {e}") from None
        expect = _CHUNK_HDR.size + 8 * nl + 4 * n
        if ver != 1 or len(raw) != expect or len(key) != HASH_BYTES:
            raise FormatError(f"chunk record {key.hex()} is malformed (version {ver})")
        o = _CHUNK_HDR.size
        checks = np.frombuffer(raw, "<u8", nl, o).copy()
        tokens = np.frombuffer(raw, "<u4", n, o + 8 * nl).copy()
        return cls(key, parent, n, slot, checks, tokens)


@dataclass(slots=True, eq=False)
class SessionRecord:
    """A stored context: the ordered chunks of one put, keyed by its last chunk's address."""

    key: bytes
    n_tokens: int
    created: int
    last_access: int
    chunks: tuple[bytes, ...]

    def encode(self) -> bytes:
        hdr = _SESSION_HDR.pack(1, self.n_tokens, self.created, self.last_access, len(self.chunks))
        return hdr + b"".join(self.chunks)

    @classmethod
    def decode(cls, key: bytes, raw: bytes) -> SessionRecord:
        try:
            ver, n, created, last, nc = _SESSION_HDR.unpack_from(raw)
        except struct.error as e:
            raise FormatError(f"session record {key.hex()} is truncated: {e}") from None
        if ver != 1 or len(raw) != _SESSION_HDR.size + HASH_BYTES * nc:
            raise FormatError(f"session record {key.hex()} is malformed (version {ver})")
        o = _SESSION_HDR.size
        chunks = tuple(raw[o + i * HASH_BYTES : o + (i + 1) * HASH_BYTES] for i in range(nc))
        return cls(key, n, created, last, chunks)


class WriteTxn:
    """Typed operations inside one LMDB write transaction."""

    def __init__(self, txn: lmdb.Transaction, dbs: dict[str, object]) -> None:
        self._txn = txn
        self._dbs = dbs

    def put_chunk(self, rec: ChunkRecord) -> None:
        self._txn.put(rec.key, rec.encode(), db=self._dbs["chunks"])

    def delete_chunk(self, key: bytes) -> None:
        self._txn.delete(key, db=self._dbs["chunks"])

    def put_session(self, rec: SessionRecord) -> None:
        self._txn.put(rec.key, rec.encode(), db=self._dbs["sessions"])

    def delete_session(self, key: bytes) -> None:
        self._txn.delete(key, db=self._dbs["sessions"])

    def put_meta(self, name: str, value: object) -> None:
        self._txn.put(name.encode(), json.dumps(value, sort_keys=True).encode(),
                      db=self._dbs["meta"])


class Catalog:
    """LMDB environment of a store. Thread-safety: the store serializes all calls."""

    def __init__(self, path: str, *, readonly: bool, map_size: int = 1 << 34) -> None:
        if not readonly:
            os.makedirs(path, exist_ok=True)
        try:
            self._env = lmdb.open(
                path, subdir=True, readonly=readonly, max_dbs=4, map_size=map_size,
                sync=True, metasync=True, lock=True, create=not readonly,
            )
        except lmdb.Error as e:
            if "already open" in str(e):
                raise StoreLocked(f"the store catalog {path!r} is already open in this process"
                                  ) from None
            raise FormatError(f"cannot open catalog at {path!r}: {e}") from None
        self._dbs = {}
        for name in ("meta", "chunks", "sessions"):
            try:
                self._dbs[name] = self._env.open_db(name.encode(), create=not readonly)
            except lmdb.NotFoundError:
                self._env.close()
                raise FormatError(f"catalog at {path!r} has no {name!r} table") from None

    @contextmanager
    def write(self) -> Iterator[WriteTxn]:
        """A write transaction: commits (durably) on success, aborts on exception."""
        with self._env.begin(write=True) as txn:
            yield WriteTxn(txn, self._dbs)

    def get_meta(self, name: str) -> object | None:
        with self._env.begin() as txn:
            raw = txn.get(name.encode(), db=self._dbs["meta"])
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError as e:
            raise FormatError(f"catalog metadata {name!r} is not valid JSON: {e}") from None

    def load(self) -> tuple[dict[bytes, ChunkRecord], dict[bytes, SessionRecord]]:
        """Every chunk and session record (one read transaction, consistent snapshot)."""
        chunks: dict[bytes, ChunkRecord] = {}
        sessions: dict[bytes, SessionRecord] = {}
        with self._env.begin() as txn:
            for k, v in txn.cursor(db=self._dbs["chunks"]):
                chunks[bytes(k)] = ChunkRecord.decode(bytes(k), bytes(v))
            for k, v in txn.cursor(db=self._dbs["sessions"]):
                sessions[bytes(k)] = SessionRecord.decode(bytes(k), bytes(v))
        return chunks, sessions

    def close(self) -> None:
        self._env.close()
