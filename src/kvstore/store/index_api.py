"""``store.indexes``: per-head vector indexes kept with stored contexts, built, read, listed and
checked (docs/indexes.md). The work is :mod:`kvstore.index.lifecycle`'s; this handle checks
the calls' arguments and the layout, and holds only the parts it needs."""

from __future__ import annotations

from kvstore.format.hashing import as_tokens
from kvstore.index.context_dir import ContextIndexes
from kvstore.index.lifecycle import ContextIndexStore, check_spec
from kvstore.index.spec import IndexSpec
from kvstore.layout import KVLayout


class Indexes:
    """The per-head indexes of one open store (``store.indexes``).

    ``store.indexes(tokens)`` (calling the handle) is the deprecated spelling of
    :meth:`read`, kept for callers of the method it was.

    Thread-safety: every method may be called from any thread; builds and reads run without
    the store's metadata lock.
    """

    def __init__(self, layout: KVLayout, contexts: ContextIndexStore) -> None:
        # Private: the store builds its handle when it opens.
        self._layout = layout
        self._contexts = contexts

    def build(self, tokens: object, spec: IndexSpec, *, namespace: str | None = None) -> bool:
        """Build and store per-(layer, kv-head) indexes for the stored context of exactly
        ``tokens`` (late materialization, AlayaDB §7.2: a context is indexed once it is
        stored). Keys are indexed with RoPE at positions 0..T-1. The files live in the store
        directory under the context, checksummed, and are removed when the context is (delete,
        eviction, a longer put that supersedes it). Existing indexes are replaced. Returns
        False if no context of exactly these tokens is stored (or it left meanwhile).
        Thread-safe; the build runs without the metadata lock."""
        self._layout.require_plain("per-head indexes (build_indexes)")
        check_spec(spec, "spec", self._layout.head_dim)
        return self._contexts.build(as_tokens(tokens), namespace, spec)

    def read(self, tokens: object, *, namespace: str | None = None) -> ContextIndexes | None:
        """The stored indexes covering ``tokens``: those of the stored context of exactly these
        tokens, or of a longer stored context that starts with them (query it with
        ``limit=len(tokens)``, the prefix filter). None if no such context has indexes.

        Every file is checked: a head whose file is corrupt or missing is rebuilt from the
        stored keys (and rewritten, in a writable store; counted in ``stats()["indexes"]``);
        if the manifest itself is bad, the context's indexes are dropped and counted as
        corrupt, and None is returned; if the stored keys cannot be read for a rebuild (a
        corrupt chunk), None is returned too. Thread-safe: files are read and heads rebuilt
        without the metadata lock.

        The index files hold no keys: the returned indexes read the context's keys through
        this store's get path on their first query that needs them (re-ranking, the graph
        walk). If the context was evicted or a chunk failed its checksum since this call, that
        query raises ``KeyError`` or :class:`CorruptData` (a miss: recompute).
        """
        self._layout.require_plain("per-head indexes (indexes)")
        return self._contexts.read(as_tokens(tokens), namespace)

    def __call__(self, tokens: object, *, namespace: str | None = None
                 ) -> ContextIndexes | None:
        """Deprecated: use ``store.indexes.read(tokens)``. Thread-safe."""
        return self.read(tokens, namespace=namespace)

    def dirs(self) -> dict[bytes, str]:
        """Context key -> directory of the contexts that have indexes. Thread-safe."""
        return self._contexts.dirs()

    def check(self) -> dict[bytes, str | None]:
        """Context key -> None if its index directory reads back whole (manifest and every
        file's checksums), else what is wrong. Reads only; repairs nothing. Thread-safe."""
        return self._contexts.check_all()
