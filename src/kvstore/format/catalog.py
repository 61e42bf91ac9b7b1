"""The LMDB catalog: chunk and context records, reservations, index entries, pins, store
metadata.

The catalog is the only writer of metadata and the truth every process of a store shares (LMDB
locks it across processes: many readers, one write transaction at a time). Write transactions
are context managers: they commit on success and abort on exception. Every write transaction
that changes records appends the keys it changed to a change log under a new generation number,
so a process catches up with the others' commits by reading only what changed since the
generation it has seen (:meth:`ReadTxn.changes_since`); one that fell further behind than the
log reaches reloads everything.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import lmdb

from kvstore.errors import CapacityError, FormatError, KVStoreError, StoreLocked, StoreTampered
from kvstore.format.catalog_check import check_data_file
from kvstore.format.directory import Dir, UnsafePath
from kvstore.format.hashing import HASH_BYTES
from kvstore.format.range_locks import held_by_other
from kvstore.format.records import (
    ChunkRecord,
    ContextRecord,
    IndexEntry,
    PinRecord,
    Reservation,
)

FORMAT_VERSION = 2
CATALOG = "catalog"
DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
# change-log entries kept (about 70 bytes each); a process further behind reloads everything
LOG_KEEP = 1 << 16
HEADROOM = 256 << 10  # bytes of catalog file kept allocated ahead of use (see Catalog.write)
TABLES = ("meta", "chunks", "contexts", "reservations", "indexes", "log", "pins")
# Tables a store made before them lacks: a read-only open finds none (no records of that kind),
# a writable one creates them.
OPTIONAL_TABLES = ("pins",)
_KINDS = {b"C": "chunks", b"X": "contexts", b"I": "indexes"}
# The catalog directories (device, inode) this process has open. A second open in one process
# is refused before anything touches lock.mdb: closing any descriptor of that file drops the
# POSIX locks this process's environment holds on it (a joiner's check opens one).
_OPEN: set[tuple[int, int]] = set()
_OPEN_LOCK = threading.Lock()


_LIVE: weakref.WeakSet[Catalog] = weakref.WeakSet()  # catalogs open in this process


def _after_fork_in_child() -> None:
    """A forked child has opened nothing itself: it may open any store. Its copies of the
    parent's LMDB environments are closed (LMDB: an environment must not be used across a
    fork; py-lmdb would refuse the child an environment its parent has open): that releases
    only the child's mapping and descriptors, never the parent's locks (fcntl locks are not
    inherited; flock and OFD locks stay with the parent's descriptors)."""
    global _OPEN, _OPEN_LOCK
    _OPEN, _OPEN_LOCK = set(), threading.Lock()
    for cat in list(_LIVE):
        env, cat._env = getattr(cat, "_env", None), None
        if env is not None:
            with contextlib.suppress(lmdb.Error):
                env.close()


os.register_at_fork(after_in_child=_after_fork_in_child)
_KIND_OF = {v: k for k, v in _KINDS.items()}


@dataclass(frozen=True, slots=True)
class Changes:
    """Keys whose records changed (added, replaced or deleted) after some generation."""

    gen: int
    chunks: frozenset[bytes]
    contexts: frozenset[bytes]
    indexes: frozenset[bytes]


def _u64(n: int) -> bytes:
    return n.to_bytes(8, "big")


class ReadTxn:
    """Typed reads inside one LMDB transaction (a consistent snapshot).

    A record that cannot be decoded (damaged) is read as absent and listed in ``malformed``
    (table, key, why): the rest of the store stays usable, and the context it belonged to is
    dropped by recovery like one whose records are missing."""

    def __init__(self, txn: lmdb.Transaction, dbs: dict[str, object]) -> None:
        self._txn = txn
        self._dbs = dbs
        self.malformed: list[tuple[str, bytes, str]] = []

    def _decode(self, table: str, decode, key: bytes, raw: bytes):
        try:
            return decode(key, raw)
        except FormatError as e:
            self.malformed.append((table, key, str(e)))
            return None

    def _get(self, table: str, key: bytes) -> bytes | None:
        raw = self._txn.get(key, db=self._dbs[table])
        return None if raw is None else bytes(raw)

    @property
    def gen(self) -> int:
        """The generation of the last commit that changed records (0 for a new store)."""
        raw = self._get("meta", b"gen")
        if raw is None:
            return 0
        if len(raw) != 8:
            raise FormatError("catalog metadata 'gen' is malformed")
        return int.from_bytes(raw, "big")

    def meta(self, name: str) -> object | None:
        raw = self._get("meta", name.encode())
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError as e:
            raise FormatError(f"catalog metadata {name!r} is not valid JSON: {e}") from None

    def chunk(self, key: bytes) -> ChunkRecord | None:
        raw = self._get("chunks", key)
        return None if raw is None else self._decode("chunks", ChunkRecord.decode, key, raw)

    def context(self, key: bytes) -> ContextRecord | None:
        raw = self._get("contexts", key)
        return None if raw is None else self._decode("contexts", ContextRecord.decode, key, raw)

    def index_entry(self, key: bytes) -> IndexEntry | None:
        raw = self._get("indexes", key)
        return None if raw is None else self._decode("indexes", IndexEntry.decode, key, raw)

    def _items(self, table: str) -> Iterator[tuple[bytes, bytes]]:
        for k, v in self._txn.cursor(db=self._dbs[table]):
            yield bytes(k), bytes(v)

    def chunks(self) -> Iterator[ChunkRecord]:
        for k, v in self._items("chunks"):
            rec = self._decode("chunks", ChunkRecord.decode, k, v)
            if rec is not None:
                yield rec

    def contexts(self) -> Iterator[ContextRecord]:
        for k, v in self._items("contexts"):
            rec = self._decode("contexts", ContextRecord.decode, k, v)
            if rec is not None:
                yield rec

    def chunk_map(self) -> dict[bytes, ChunkRecord]:
        """Every readable chunk record by key (what :meth:`chunks` yields, decoded in one
        loop: a full load reads a million of them)."""
        return ChunkRecord.decode_all(self._txn.cursor(db=self._dbs["chunks"]), self.malformed)

    def context_map(self, chunks: dict[bytes, ChunkRecord] | None = None
                    ) -> dict[bytes, ContextRecord]:
        """Every readable context record by key. With ``chunks`` (:meth:`chunk_map`'s
        dict), the keys a context holds, and its own, are the chunk records' key objects
        where those exist: one copy of each key in memory, however many records name it."""
        return ContextRecord.decode_all(self._txn.cursor(db=self._dbs["contexts"]), chunks,
                                        self.malformed)

    def indexes(self) -> Iterator[tuple[bytes, IndexEntry]]:
        for k, v in self._items("indexes"):
            entry = self._decode("indexes", IndexEntry.decode, k, v)
            if entry is not None:
                yield k, entry

    def pin(self, key: bytes) -> PinRecord | None:
        """The pin of context ``key`` (live or expired), or None."""
        if self._dbs.get("pins") is None:
            return None
        raw = self._get("pins", key)
        return None if raw is None else self._decode("pins", PinRecord.decode, key, raw)

    def pins(self) -> dict[bytes, PinRecord]:
        """Every readable pin record by context key (live or expired; the caller tells)."""
        if self._dbs.get("pins") is None:
            return {}
        out = {}
        for k, v in self._items("pins"):
            rec = self._decode("pins", PinRecord.decode, k, v)
            if rec is not None:
                out[k] = rec
        return out

    def reservations(self) -> list[Reservation]:
        out = []
        for k, v in self._items("reservations"):
            r = self._decode("reservations", Reservation.decode, k, v)
            if r is not None:
                out.append(r)
        return out


    def changes_since(self, gen: int) -> Changes | None:
        """Keys changed by the commits after generation ``gen``; None if the log no longer
        reaches back that far (or holds an entry it cannot read): reload everything."""
        now = self.gen
        if now == gen:
            return Changes(now, frozenset(), frozenset(), frozenset())
        if now < gen:
            return None  # the catalog went back (replaced): reload
        found: dict[str, set[bytes]] = {"chunks": set(), "contexts": set(), "indexes": set()}
        cur = self._txn.cursor(db=self._dbs["log"])
        if not cur.set_key(_u64(gen + 1)):
            return None
        expect = gen + 1
        for k, v in cur:
            if int.from_bytes(k, "big") != expect:
                return None
            raw = bytes(v)
            if len(raw) % (1 + HASH_BYTES):
                return None
            for o in range(0, len(raw), 1 + HASH_BYTES):
                table = _KINDS.get(raw[o : o + 1])
                if table is None:
                    return None
                found[table].add(raw[o + 1 : o + 1 + HASH_BYTES])
            expect += 1
        if expect != now + 1:
            return None
        return Changes(now, frozenset(found["chunks"]), frozenset(found["contexts"]),
                       frozenset(found["indexes"]))


class WriteTxn(ReadTxn):
    """Typed writes inside one LMDB write transaction; record changes are logged at commit."""

    def __init__(self, txn: lmdb.Transaction, dbs: dict[str, object]) -> None:
        super().__init__(txn, dbs)
        self._changed: dict[bytes, None] = {}  # kind + key, in order, deduplicated
        self._base_gen = self.gen
        self._clock: int | None = None

    @property
    def next_gen(self) -> int:
        """The generation this transaction's record changes get when it commits."""
        return self._base_gen + 1

    def _log(self, table: str, key: bytes) -> None:
        self._changed[_KIND_OF[table] + key] = None

    def put_chunk(self, rec: ChunkRecord) -> None:
        self._txn.put(rec.key, rec.encode(), db=self._dbs["chunks"])
        self._log("chunks", rec.key)

    def delete_chunk(self, key: bytes) -> None:
        self._txn.delete(key, db=self._dbs["chunks"])
        self._log("chunks", key)

    def put_context(self, rec: ContextRecord) -> None:
        self._txn.put(rec.key, rec.encode(), db=self._dbs["contexts"])
        self._log("contexts", rec.key)

    def delete_context(self, key: bytes) -> None:
        self._txn.delete(key, db=self._dbs["contexts"])
        self._log("contexts", key)

    def put_index(self, key: bytes, entry: IndexEntry) -> None:
        self._txn.put(key, entry.encode(), db=self._dbs["indexes"])
        self._log("indexes", key)

    def delete_index(self, key: bytes) -> None:
        if self._txn.delete(key, db=self._dbs["indexes"]):
            self._log("indexes", key)

    def put_pin(self, rec: PinRecord) -> None:
        """Pins are read from the catalog where they are used (in the transaction that
        evicts), never mirrored: they are not in the change log."""
        self._txn.put(rec.key, rec.encode(), db=self._dbs["pins"])

    def delete_pin(self, key: bytes) -> bool:
        """Delete context ``key``'s pin; whether there was one."""
        if self._dbs.get("pins") is None:
            return False
        return bool(self._txn.delete(key, db=self._dbs["pins"]))

    def put_reservation(self, res: Reservation) -> None:
        self._txn.put(res.key, res.encode(), db=self._dbs["reservations"])

    def delete_reservation(self, key: bytes) -> None:
        self._txn.delete(key, db=self._dbs["reservations"])

    def delete_malformed(self) -> int:
        """Delete every record this transaction found malformed; returns how many."""
        found, self.malformed = self.malformed, []
        for table, key, _ in found:
            self._txn.delete(key, db=self._dbs[table])
            if table in _KIND_OF:
                self._log(table, key)
        return len(found)

    def put_meta(self, name: str, value: object) -> None:
        self._txn.put(name.encode(), json.dumps(value, sort_keys=True).encode(),
                      db=self._dbs["meta"])

    def advance_clock(self, clock: int) -> None:
        """Record that logical time reached ``clock`` (the stored clock only moves forward)."""
        self._clock = clock if self._clock is None else max(self._clock, clock)

    def _finish(self) -> None:
        if self._clock is not None:
            stored = self.meta("clock")
            if not isinstance(stored, int) or stored < self._clock:
                self.put_meta("clock", self._clock)
        if not self._changed:
            return
        gen = self.next_gen
        self._txn.put(_u64(gen), b"".join(self._changed), db=self._dbs["log"])
        self._txn.put(b"gen", _u64(gen), db=self._dbs["meta"])
        old = gen - LOG_KEEP
        if old > 0:
            cur = self._txn.cursor(db=self._dbs["log"])
            while cur.first() and int.from_bytes(cur.key(), "big") <= old:
                cur.delete()


def _lmdb_error(path: str, e: lmdb.Error) -> KVStoreError:
    if isinstance(e, lmdb.MapFullError):
        return CapacityError(f"the catalog {path!r} is full ({e})")
    if isinstance(e, lmdb.DiskError) or "No space left" in str(e):
        return CapacityError(f"the catalog {path!r} cannot grow: {e}")
    return KVStoreError(f"catalog {path!r}: {type(e).__name__}: {e}")


class Catalog:
    """The LMDB environment of one store in one process.

    Thread-safety: read transactions may run on any thread at once; write transactions are
    serialized by LMDB (across threads and processes), so a writer must never wait for
    something a thread holding a write transaction would need.
    """

    def __init__(self, root: Dir, *, readonly: bool, walk: bool, joining: bool,
                 map_size: int = 1 << 34) -> None:
        """Open the catalog directory of the store ``root``. Its files are checked before LMDB
        maps them (:mod:`kvstore.format.catalog_check`): the meta pages always, every page when
        ``walk`` (an opener that holds the store alone: no commit can run during the walk).

        ``joining``: other processes have the store open (and this opener holds ``OPENING``,
        so each of them has its environment open). Their LMDB environments share one lock
        file, whose writer mutex and transaction id keep their commits apart; a joiner that
        opened another one (``lock.mdb`` deleted or replaced under them: LMDB would create or
        initialize a fresh one) would commit beside them and corrupt the catalog. So a joiner
        first checks that the file named ``lock.mdb`` is locked by a live environment, and
        refuses with :class:`StoreTampered` otherwise, creating nothing.

        Read-only, with no ``lock.mdb`` (a copied store, say), the environment is opened
        without one (``unlocked``: the opener must keep every writer out while it is open),
        so that reading a store never writes a file into it."""
        self.readonly = readonly
        self.unlocked = False
        if readonly:
            try:
                self.dir = root.sub(CATALOG)
            except FileNotFoundError:
                raise FormatError(f"{root.path!r} holds no initialized kvstore (it has no "
                                  f"catalog)") from None
        else:
            self.dir = root.sub(CATALOG, create=True)
        self.path = self.dir.path
        self._ident: tuple[int, int] | None = None
        try:
            st = os.fstat(self.dir.fd)
            with _OPEN_LOCK:
                if (st.st_dev, st.st_ino) in _OPEN:
                    raise StoreLocked(f"the store catalog {self.path!r} is already open in "
                                      f"this process")
                _OPEN.add((st.st_dev, st.st_ino))
                self._ident = (st.st_dev, st.st_ino)
            if not readonly:
                root.fsync()  # the catalog directory's own entry is durable
            if joining:
                self._check_lock_in_use()
            has_lock = self.dir.check_file(LOCK_FILE) is not None
            data = self._check_data(walk=walk)
            if readonly and data is None:
                raise FormatError(f"{root.path!r} holds no initialized kvstore: its catalog "
                                  f"file {self.dir.show(DATA_FILE)!r} is missing or empty")
            self.unlocked = readonly and not has_lock
            try:
                self._env = lmdb.open(
                    self.dir.proc_path, subdir=True, readonly=readonly,
                    max_dbs=len(TABLES) + 1, map_size=map_size, sync=True, metasync=True,
                    lock=not self.unlocked, create=not readonly)
            except lmdb.Error as e:
                if "already open" in str(e):
                    raise StoreLocked(f"the store catalog {self.path!r} is already open in "
                                      f"this process") from None
                raise FormatError(f"cannot open catalog at {self.path!r}: {e}") from None
            _LIVE.add(self)
        except BaseException:
            self._forget()
            self.dir.close()
            raise
        try:
            now = self.dir.check_file(DATA_FILE)
            if now is None or (data is not None and (now.st_dev, now.st_ino) != data):
                raise UnsafePath(f"{self.dir.show(DATA_FILE)!r} was replaced while it was "
                                 f"opened")
            if data is None and not readonly:
                self.dir.fsync()  # LMDB created data.mdb: its entry is durable
            self._env.reader_check()  # reader slots of dead processes pin no old pages
            self._check_ours()
            self._commits = 0
            self._dbs: dict[str, object] = {}
            self._dbs["meta"] = self._open_db("meta")
            self._dbs["sessions"] = self._open_db("sessions", create=False)  # format 1 only
            for name in TABLES[1:]:
                self._dbs[name] = self._open_db(name)
        except BaseException:
            self.close()
            raise
        self.keep_headroom()

    def _check_lock_in_use(self) -> None:
        """:class:`StoreTampered` unless ``lock.mdb`` is there and a live LMDB environment
        holds its lock (see :mod:`kvstore.format.range_locks`)."""
        shown = self.dir.show(LOCK_FILE)
        try:
            fd = self.dir.open(LOCK_FILE, os.O_RDONLY)
        except FileNotFoundError:
            raise StoreTampered(
                f"{shown!r} is missing while other processes have the store open: it was "
                f"deleted under them; opening through a new one would let two writers "
                f"commit at once. Close every process of the store, then open it again (the "
                f"first opener recreates it)") from None
        try:
            live = held_by_other(fd, 0)
        finally:
            os.close(fd)  # before LMDB opens it: no lock of this process is on the file yet
        if not live:
            raise StoreTampered(
                f"{shown!r} is not the lock file the processes that have the store open use "
                f"(no live environment holds it): it was replaced under them; opening "
                f"through it would let two writers commit at once. Close every process of "
                f"the store, then open it again")

    def _check_data(self, *, walk: bool) -> tuple[int, int] | None:
        """(device, inode) of data.mdb after checking it is safe to map; None if absent or
        empty (LMDB initializes it)."""
        try:
            fd = self.dir.open(DATA_FILE, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            check_data_file(fd, self.dir.show(DATA_FILE), walk=walk)
            return None if st.st_size == 0 else (st.st_dev, st.st_ino)
        finally:
            os.close(fd)

    def _check_ours(self) -> None:
        """:class:`FormatError` if the LMDB file holds anything but the catalog's own tables
        (another program's database): nothing is created in it."""
        with self._env.begin() as txn:
            names = [bytes(k) for k, _ in txn.cursor()]
        ours = {t.encode() for t in (*TABLES, "sessions")}
        foreign = [n for n in names if n not in ours]
        if foreign:
            raise FormatError(
                f"{self.dir.show(DATA_FILE)!r} is an LMDB database but not a kvstore catalog "
                f"(it holds {len(foreign)} key(s) that are none of the catalog's tables, e.g. "
                f"{foreign[0][:40]!r}); refusing to use it")

    def _open_db(self, name: str, *, create: bool | None = None) -> object | None:
        create = not self.readonly if create is None else create
        try:
            return self._env.open_db(name.encode(), create=create)
        except lmdb.NotFoundError:
            if name == "sessions" or name in OPTIONAL_TABLES \
                    or (name != "meta" and self._format() == 1):
                return None  # absent in this format (checked by the opener)
            raise FormatError(f"catalog at {self.path!r} has no {name!r} table") from None
        except lmdb.Error as e:
            raise _lmdb_error(self.path, e) from None

    def _format(self) -> object | None:
        with self.read() as txn:
            return txn.meta("format")

    @contextmanager
    def read(self) -> Iterator[ReadTxn]:
        """A read transaction: a consistent snapshot; never blocks on writers."""
        try:
            with self._env.begin(buffers=False) as txn:
                yield ReadTxn(txn, self._dbs)
        except lmdb.Error as e:
            raise _lmdb_error(self.path, e) from None

    @contextmanager
    def write(self) -> Iterator[WriteTxn]:
        """A write transaction: commits (durably) on success, aborts on exception.

        The catalog file is kept allocated ``HEADROOM`` bytes ahead of what LMDB uses, so that
        on a full device commits that free space (deletes, evictions) still find pages."""
        try:
            with self._env.begin(write=True) as txn:
                w = WriteTxn(txn, self._dbs)
                yield w
                w._finish()
        except lmdb.Error as e:
            raise _lmdb_error(self.path, e) from None
        self._commits += 1
        if self._commits % 16 == 0:
            self.keep_headroom()

    def keep_headroom(self) -> None:
        """Allocate the catalog file up to ``HEADROOM`` bytes beyond LMDB's last used page
        (best effort: on a full device it allocates what it can)."""
        if self.readonly:
            return
        info = self._env.info()
        used = (info["last_pgno"] + 1) * self._env.stat()["psize"]
        try:
            fd = self.dir.open(DATA_FILE, os.O_RDWR)
        except OSError:
            return
        try:
            if os.fstat(fd).st_size >= used + HEADROOM // 2:
                return
            os.posix_fallocate(fd, 0, used + HEADROOM)
        except OSError:
            pass  # no room left: commits report it as CapacityError
        finally:
            os.close(fd)

    def gen(self) -> int:
        """The current generation (cheap: one read of one key)."""
        with self.read() as txn:
            return txn.gen

    def get_meta(self, name: str) -> object | None:
        with self.read() as txn:
            return txn.meta(name)

    def migrate_v1(self) -> None:
        """Upgrade a format-1 catalog (contexts in a ``sessions`` table) in one transaction."""
        old = self._dbs.get("sessions")
        with self.write() as txn:
            if old is not None:
                for k, v in list(txn._txn.cursor(db=old)):
                    rec = ContextRecord.decode(bytes(k), bytes(v))
                    txn.put_context(rec)
                txn._txn.drop(old, delete=True)
            txn.put_meta("format", FORMAT_VERSION)
        self._dbs["sessions"] = None

    def _forget(self) -> None:
        with _OPEN_LOCK:
            if self._ident is not None:
                _OPEN.discard(self._ident)
                self._ident = None

    def close(self) -> None:
        env = getattr(self, "_env", None)
        if env is not None:
            env.close()
        self._forget()
        self.dir.close()
