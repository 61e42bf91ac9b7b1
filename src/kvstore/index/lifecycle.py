"""Per-head indexes kept with stored contexts: building, publishing, reading, removing.

A context's indexes live in a directory ``indexes/<context key hex>-<tag>`` (see
:mod:`kvstore.index.context_dir`), and the catalog holds an entry per indexed context naming its
tag (:class:`kvstore.format.records.IndexEntry`). Every build gets a new tag: its directory is
renamed
into place under a name nothing references, then its entry is committed; a directory is removed
only after the commit that dropped its entry. So a crash at any instant leaves every entry's
directory whole, and processes that build and drop the indexes of one context never touch one
another's directories. Directories with no entry (a crash between a rename and a commit, or
between a commit and a removal) and staging leftovers are collected by a process that opens the
store alone.
"""

from __future__ import annotations

import os
import secrets
import stat
import threading
from collections.abc import Callable

import numpy as np
import torch

from kvstore.errors import CorruptData
from kvstore.format.directory import TEMP_MARK, Dir, UnsafePath
from kvstore.format.records import ContextRecord, IndexEntry
from kvstore.index.build import build_index
from kvstore.index.context_dir import (
    ContextIndexes,
    positioned_keys,
    publish,
    read_context_indexes,
)
from kvstore.index.spec import IndexSpec
from kvstore.layout import KVLayout
from kvstore.residency.core import Core
from kvstore.rope import cos_sin


class _KeysUnavailable(Exception):
    """A context's keys could not be read to rebuild one of its index files."""


class StoredKeys:
    """The :class:`~kvstore.index.keys.KeySource` of a stored context: its keys read through
    the store's get path (once, on first use: fp16 pre-RoPE [L, H, T, D], the KV itself, not a
    copy made for the index) and positioned on demand with :mod:`kvstore.rope`'s tables, bit
    for bit the numbers :func:`~kvstore.index.context_dir.positioned_keys` gives (the same float32
    products and sum, in numpy: torch's per-op cost dominates for a few hundred rows).
    ``rows`` positions only the rows asked for; ``dense`` positions a whole head once and
    keeps it (the graph search scores scattered tokens). A get error (KeyError: the context
    left the store; CorruptData: a chunk failed its checksum) is raised by the first index
    query that needs keys. Thread-safety: any thread."""

    def __init__(self, read: Callable[[], torch.Tensor], layout: KVLayout, n_tokens: int
                 ) -> None:
        self._read = read  # -> pre-RoPE keys [L, H, T, D] of the context
        self.layout = layout
        self.n_tokens = n_tokens
        self._keys: np.ndarray | None = None  # [L, H, T, D] in the cache dtype
        self._cos: np.ndarray | None = None  # [T, D] float32 RoPE tables at 0..T-1
        self._sin: np.ndarray | None = None
        self._dense: dict[tuple[int, int], np.ndarray] = {}
        self._lock = threading.Lock()

    def _all(self) -> np.ndarray:
        with self._lock:
            if self._keys is None:
                k = self._read()
                L, H, D = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim
                if tuple(k.shape) != (L, H, self.n_tokens, D):
                    raise CorruptData(f"the stored keys have shape {tuple(k.shape)}, the "
                                      f"indexes {(L, H, self.n_tokens, D)}")
                cos, sin = cos_sin(self.layout, torch.arange(self.n_tokens))  # [T, D] each
                self._cos, self._sin = cos.numpy(), sin.numpy()
                self._keys = k.detach().to("cpu").numpy()
            return self._keys

    def _position(self, x: np.ndarray, pos: np.ndarray | slice) -> np.ndarray:
        """RoPE at ``pos`` of float32 rows x [r, D]: x * cos + rotate_half(x) * sin."""
        half = x.shape[1] // 2
        rh = np.concatenate([-x[:, half:], x[:, :half]], axis=1)  # [r, D]
        return x * self._cos[pos] + rh * self._sin[pos]

    def head(self, layer: int, kv_head: int) -> _StoredHead:
        return _StoredHead(self, layer, kv_head)

    def rows(self, layer: int, kv_head: int, ids: np.ndarray) -> np.ndarray:
        dense = self._dense.get((layer, kv_head))
        if dense is not None:
            return dense[ids]
        ids = np.asarray(ids, dtype=np.int64)
        x = self._all()[layer, kv_head, ids].astype(np.float32)  # [r, D]
        return self._position(x, ids)

    def dense(self, layer: int, kv_head: int) -> np.ndarray:
        key = (layer, kv_head)
        got = self._dense.get(key)
        if got is None:
            x = self._all()[layer, kv_head].astype(np.float32)  # [T, D]
            got = np.ascontiguousarray(self._position(x, slice(None)))
            with self._lock:
                got = self._dense.setdefault(key, got)
        return got


class _StoredHead:
    """One head of a :class:`StoredKeys` (a :class:`~kvstore.index.keys.HeadKeys`)."""

    def __init__(self, src: StoredKeys, layer: int, kv_head: int) -> None:
        self._src, self._layer, self._head = src, layer, kv_head

    @property
    def n(self) -> int:
        return self._src.n_tokens

    @property
    def dim(self) -> int:
        return self._src.layout.head_dim

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return self._src.rows(self._layer, self._head, ids)

    def dense(self) -> np.ndarray:
        return self._src.dense(self._layer, self._head)


INDEXES = "indexes"


class IndexFiles:
    """The ``indexes/`` directory of a store (created on first use), reached through the
    store's directory descriptor (:mod:`kvstore.format.directory`). Thread-safety: any thread
    (distinct
    names)."""

    def __init__(self, root: Dir, *, readonly: bool) -> None:
        self._root = root
        self.readonly = readonly
        self._lock = threading.Lock()
        self._dir: Dir | None = None
        try:
            self._dir = root.sub(INDEXES)
        except FileNotFoundError:
            pass

    def dir(self, *, create: bool = False) -> Dir | None:
        """The open ``indexes/`` directory; None if it does not exist (and not ``create``)."""
        if self._dir is None and create:
            with self._lock:
                if self._dir is None:
                    self._dir = self._root.sub(INDEXES, create=True)
        return self._dir

    def show(self, key: bytes, entry: IndexEntry) -> str:
        """The path of a context's index directory (for messages and listings)."""
        return os.path.join(self._root.show(INDEXES), entry.dirname(key))

    def open(self, key: bytes, entry: IndexEntry) -> Dir:
        """The context's index directory (:class:`CorruptData` if absent); the caller closes
        it."""
        d = self.dir()
        try:
            if d is None:
                raise FileNotFoundError
            return d.sub(entry.dirname(key))
        except FileNotFoundError:
            raise CorruptData(f"index directory {self.show(key, entry)!r} is missing") from None

    def remove(self, dirs: list[tuple[bytes, IndexEntry]]) -> None:
        """Remove the directories of dropped entries (after the commit that dropped them)."""
        d = self.dir()
        if d is None:
            return
        for key, entry in dirs:
            d.rmtree(entry.dirname(key))

    def collect(self, live: set[str]) -> int:
        """Remove every entry of ``indexes/`` that is not a directory named in ``live`` (only by
        a process holding the store alone; symlinks are removed, never followed). Returns how
        many."""
        d = self.dir()
        if d is None:
            return 0
        n = 0
        for name in sorted(d.listdir()):
            st = d.lstat(name)
            if name in live and st is not None and stat.S_ISDIR(st.st_mode):
                with d.sub(name) as sub:
                    for f in sub.listdir():  # a head rewrite a crash interrupted
                        if TEMP_MARK in f:
                            sub.rmtree(f)
                continue
            d.rmtree(name)
            n += 1
        if n:
            d.fsync()
        return n

    def close(self) -> None:
        if self._dir is not None:
            self._dir.close()


def check_spec(spec: object, name: str, head_dim: int) -> IndexSpec:
    """Refuse a spec that cannot be built over this layout's keys, before anything is
    written."""
    if not isinstance(spec, IndexSpec):
        raise TypeError(f"{name} must be a kvstore.index.IndexSpec, got {type(spec).__name__}")
    if spec.kind == "pq" and head_dim % spec.pq_subspaces:
        raise ValueError(f"{name}.pq_subspaces ({spec.pq_subspaces}) must divide the layout's "
                         f"head_dim ({head_dim})")
    if spec.kind == "graph":
        import hnswlib  # noqa: F401  (ImportError now, not after the KV is stored)
    return spec


def check_keys(keys: torch.Tensor) -> None:
    """Keys an index can be built over: finite (checked before the KV is stored)."""
    if not bool(torch.isfinite(keys).all()):
        raise ValueError("keys must be finite to build indexes over them (index=...)")


class ContextIndexStore:
    """Thread-safety: every method may be called from any thread; builds, loads and rebuilds
    run without the metadata lock."""

    def __init__(self, core: Core, files: IndexFiles,
                 get: Callable[[np.ndarray, str | None], tuple[torch.Tensor, torch.Tensor]]
                 ) -> None:
        self.core = core
        self.files = files
        self._get = get  # the store's get: keys of a stored context (for builds and rebuilds)

    def attach(self, toks: np.ndarray, namespace: str | None, keys: torch.Tensor,
               spec: IndexSpec) -> bool:
        """Build indexes over ``keys`` (pre-RoPE [L, H, T, D]) without the lock, stage their
        files, then publish them under the stored context of exactly ``toks`` if it is still
        stored. Nothing is built when no such context is stored (they are served through a
        longer context, whose indexes :meth:`read` then offers)."""
        core = self.core
        ctx = self._stored(toks, namespace)
        if ctx is None:
            return False
        built = ContextIndexes.build(positioned_keys(keys, core.layout), spec)
        parent = self.files.dir(create=True)
        tmp, nbytes = built.stage(parent)
        entry = IndexEntry(nbytes, secrets.randbits(63) | 1)
        old: list[tuple[bytes, IndexEntry]] = []
        try:
            publish(parent, tmp, entry.dirname(ctx.key))  # a name nothing references yet
            published, prev = core.publish_index(toks, namespace, ctx.key, entry)
            if not published:  # evicted (or superseded) while the indexes were built
                old.append((ctx.key, entry))  # published, never referenced
            elif prev is not None:
                old.append((ctx.key, prev))
            return published
        finally:
            parent.rmtree(tmp)  # absent once published
            self.files.remove(old)

    def _stored(self, toks: np.ndarray, namespace: str | None) -> ContextRecord | None:
        """The stored context of exactly ``toks`` now (writable store), or None."""
        return self.core.exact_context(toks, namespace, writable=True)

    def build(self, toks: np.ndarray, namespace: str | None, spec: IndexSpec) -> bool:
        if self._stored(toks, namespace) is None:
            return False
        try:
            keys, _ = self._get(toks, namespace)  # [L, H, T, D] pre-RoPE
        except KeyError:  # evicted since the check
            return False
        return self.attach(toks, namespace, keys, spec)

    def read(self, toks: np.ndarray, namespace: str | None) -> ContextIndexes | None:
        core = self.core
        found = core.indexed_context(toks, namespace)
        if found is None:
            return None
        s, ctx_toks, entry = found
        source = StoredKeys(lambda: self._get(ctx_toks, namespace)[0], core.layout, s.n_tokens)

        def rebuild(layer: int, head: int, spec: IndexSpec):
            try:
                keys = source.head(layer, head)
                keys.dense()  # the context's keys, read (and checked) once
            except (KeyError, CorruptData) as e:  # evicted, or a chunk failed its checksum
                raise _KeysUnavailable(str(e)) from e
            return build_index(keys, spec)

        try:
            with self.files.open(s.key, entry) as d:
                ci, rebuilt = read_context_indexes(d, source, rebuild=rebuild,
                                                   rewrite=not core.readonly)
            ok = (ci.n_tokens == s.n_tokens and ci.num_layers == core.layout.num_layers
                  and ci.num_kv_heads == core.layout.num_kv_heads)
        except (CorruptData, UnsafePath):
            ok, rebuilt = False, []
        except (_KeysUnavailable, OSError):  # unreadable keys, or the context left meanwhile
            core.count(unavailable_indexes=1)
            return None
        if core.index_entry(s.key) != entry:  # evicted or replaced while loading
            return None
        core.count(rebuilt_index_heads=len(rebuilt), corrupt_indexes=0 if ok else 1)
        if ok:
            return ci
        if not core.readonly:
            self._drop(s.key, entry)
        return None

    def _drop(self, key: bytes, entry: IndexEntry) -> None:
        """Drop a context's indexes (its manifest is bad): entry, then directory."""
        if self.core.drop_index(key, entry):
            self.files.remove([(key, entry)])

    def check_all(self) -> dict[bytes, str | None]:
        entries = self.core.index_entries()
        out: dict[bytes, str | None] = {}
        for key, entry in entries.items():
            try:
                with self.files.open(key, entry) as d:
                    read_context_indexes(d)
                out[key] = None
            except (CorruptData, UnsafePath) as e:
                out[key] = str(e)
        return out

    def dirs(self) -> dict[bytes, str]:
        return {k: self.files.show(k, e) for k, e in self.core.index_entries().items()}
