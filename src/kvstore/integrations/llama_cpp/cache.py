"""``KVStoreLlamaCache``: llama-cpp-python's prompt cache on top of the store.

``llm.set_cache(KVStoreLlamaCache(DIR))`` is all a user does. llama-cpp-python then asks the
cache before each completion (``cache[prompt]``) and hands it the context after (``cache[prompt
+ completion] = llm.save_state()``):

* **Lookup** is the store's ``match``: the longest stored prefix of the prompt, in one tree
  walk (no scan of stored keys), from any process that shares the directory. At most
  ``len(prompt) - 2`` tokens are served, and only if that is more than the context holds
  already: llama-cpp-python re-evaluates the last prompt token alone when a whole prompt is
  served, and a one-token batch gives other logits than the batched run; with two or more
  tokens left they are evaluated as one batch and the output stays the same as without a cache.
* **Restore** reads the prefix's chunks straight into a llama.cpp sequence state and loads it
  with ``llama_state_seq_set_data`` (:mod:`.context`): no 100 MB ``scores`` copy.
* **Save** parses the whole-context state llama-cpp-python gives (:mod:`.state`, every field
  checked) and puts it: only chunks the store does not hold yet are written (a shared system
  prompt is stored once), durable before the completion returns.
* **Identity** (:mod:`.identity`): a directory stores the KV of one GGUF file under one
  llama.cpp build and context setup. A Llama whose KV differs (another GGUF, build, attention
  mode or KV type) gets no KV from it and stores none in it (counted in :meth:`stats` as
  ``unsupported``, with the reason logged); models the codec does not understand likewise.
* **Hybrid models** (sliding-window or recurrent layers, :mod:`.boundary`): a prefix is
  restored only at a boundary whose state the store holds, the context is never truncated,
  and boundaries are taken when a completion ends and, on lookups, at the prompt's end and
  where it leaves a prefix stored for another context.
* **Tenants** (:mod:`.tenants`): a completion run :func:`~.tenants.in_namespace` (``kvstore
  serve`` runs each request in its key's namespace) matches, restores, stores and pins in that
  namespace only. llama-cpp-python also reuses, by itself, the common prefix of the prompt
  and of what the Llama's context holds from the request before: a lookup whose namespace is
  not that of the KV the context holds empties the context first (``namespace_clears`` in
  :meth:`stats`), so one tenant's request never continues from another's KV. A Llama the
  cache has not seen yet holds KV of the default namespace.
* **Failures** never reach the completion: a damaged store, a full disk, a state llama.cpp
  refuses, KV evicted by another process between match and read: each is a miss or a skipped
  save, counted by cause in :meth:`stats` and logged, and the prompt is computed as without
  a cache. Wrong bytes are never served: every chunk is checksummed by the store, and the
  layout fingerprint in every chunk address keeps other builds' KV apart.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvstore.errors import CapacityError, KVStoreError, LayoutMismatch
from kvstore.events.config import EventsConfig
from kvstore.format.hashing import as_tokens
from kvstore.integrations import retention
from kvstore.integrations.llama_cpp import boundary, compat, context, tenants
from kvstore.integrations.llama_cpp.identity import Identity, Unsupported, identify
from kvstore.integrations.llama_cpp.state import StateError
from kvstore.integrations.shared import Lease, acquire
from kvstore.store.facade import Store
from kvstore.tiers.objects.config import ObjectsConfig

log = logging.getLogger("kvstore.integrations.llama_cpp")

KEEP_UNSERVED = 2  # prompt tokens always evaluated, as one batch (see the module docstring)
STORE_ERRORS = (KVStoreError, OSError)  # what a store call may raise that is not a bug


@dataclass(slots=True)
class CacheCounters:
    """This cache object's counters (one process)."""

    lookups: int = 0  # cache[prompt] calls
    hits: int = 0  # lookups that restored a stored prefix
    restored_tokens: int = 0
    misses: int = 0  # lookups that restored nothing (failures also count under their cause)
    saves: int = 0  # contexts put (their new chunks written)
    saved_tokens: int = 0
    already_stored: int = 0  # contexts handed over that the store served whole already
    unsupported: int = 0  # calls for a Llama whose KV this cache does not store
    not_from_llama: int = 0  # calls not made by a llama_cpp.Llama (nothing to bind to)
    store_errors: int = 0  # match, get or put failed (damaged store, full disk, IO error)
    raced_misses: int = 0  # the prefix was evicted (by any process) between match and get
    state_errors: int = 0  # states the codec refused (see state.StateError)
    refused_restores: int = 0  # states llama.cpp refused to load (prompt then recomputed)
    checkpoints: int = 0  # boundaries a lookup evaluated to and queued for saving (hybrids)
    cleared_contexts: int = 0  # contexts emptied, not truncated (hybrids: their state exists
    # only where it was taken)
    pins: int = 0  # saved contexts pinned by their request's retention hint
    pins_refused: int = 0  # ... that the store refused to pin (over a cap)
    held_tokens: int = 0  # prompt tokens the context held at lookups that restored nothing
    # (llama-cpp-python continues after them)
    namespace_clears: int = 0  # contexts emptied at a lookup: they held another namespace's KV
    namespace_mismatches: int = 0  # saves skipped: the context's KV is not of the request's
    # namespace (a save without the lookup before it)


@dataclass(eq=False)
class _Binding:
    """What the cache knows about one Llama: its identity and store, or why it has none."""

    identity: Identity | None = None
    store: Store | None = None
    refused: str | None = None


class KVStoreLlamaCache:
    """A drop-in for ``Llama.set_cache(...)`` whose prompt cache lives in a kvstore directory.

    ``store`` is a directory (created on first use; opened through
    :func:`kvstore.integrations.shared.acquire`, so other parts of this process share it) or
    an open :class:`kvstore.Store` (its layout must be the Llama's, see :mod:`.identity`).
    ``dram_bytes`` / ``disk_bytes`` size a directory's store as :func:`kvstore.open` does;
    ``objects`` (an ``s3://`` URL or :class:`kvstore.ObjectsConfig`) gives it the object tier
    that other machines share; ``events`` (a :class:`kvstore.EventsConfig` or a ZMQ endpoint)
    makes the store publish its KV events (docs/store.md, "KV events").
    Several processes may use one directory at once; each sees the others' KV.

    Thread-safety: every method may be called from any thread; llama-cpp-python calls the
    cache from the thread running the completion, under its own lock for that Llama.
    """

    def __init__(self, store: str | os.PathLike[str] | Store, *, dram_bytes: int | None = None,
                 disk_bytes: int | None = None,
                 objects: str | ObjectsConfig | None = None,
                 events: EventsConfig | str | None = None) -> None:
        if isinstance(store, Store):
            if dram_bytes is not None or disk_bytes is not None or objects is not None \
                    or events is not None:
                raise ValueError("dram_bytes/disk_bytes/objects/events configure a store the "
                                 "cache opens; an open Store was given as store")
            self._path: str | None = None
        elif isinstance(store, str | os.PathLike):
            self._path = os.path.expanduser(os.fspath(store))
            if not self._path:
                raise ValueError("store must be a store directory path or an open "
                                 "kvstore.Store, got an empty path")
        else:
            raise TypeError(f"store must be a store directory path or an open kvstore.Store, "
                            f"got {type(store).__name__}")
        if objects is not None:
            objects = ObjectsConfig.of(objects)  # checks it now, connects at first use
        if events is not None:
            events = EventsConfig.of(events)  # checks it now, publishes once the store opens
        self._options = {k: v for k, v in (("dram_bytes", dram_bytes),
                                           ("disk_bytes", disk_bytes),
                                           ("objects", objects), ("events", events))
                         if v is not None}
        self._given = store if isinstance(store, Store) else None
        self._lease: Lease | None = None
        self._lock = threading.Lock()
        self._bindings: dict[int, _Binding] = {}
        self._held_ns: dict[int, str | None] = {}  # the namespace of the KV each Llama holds
        self._counters = CacheCounters()
        self._errors: dict[str, int] = {}
        self._last_error: str | None = None
        self._closed = False
        if "llama_cpp" in sys.modules:  # else checked when a Llama first calls the cache
            compat.check()  # UnsupportedEngine: a llama-cpp-python without what it needs

    # ------------------------------------------------------------------ llama-cpp-python
    def __getitem__(self, key: object) -> RestoredPrefix:
        """Restore the longest stored prefix of the prompt ``key`` (at most ``len(key) - 2``
        tokens) into the calling Llama's context, if longer than what it holds; KeyError
        otherwise (llama-cpp-python's miss). Looks in the request's namespace
        (:data:`.tenants.NAMESPACE`), after emptying a context that holds another namespace's
        KV. Never raises anything else for a store or state problem. Thread-safe."""
        llm = compat.calling_llama()
        self._count("lookups")
        ns = tenants.NAMESPACE.get()
        if llm is not None:
            self._isolate(llm, ns)
        binding = self._binding(llm)
        if binding is None:
            raise KeyError("no stored KV for this Llama (see KVStoreLlamaCache.stats())")
        assert llm is not None and binding.store is not None and binding.identity is not None
        toks = as_tokens(key, "key").astype(np.int64)
        if binding.identity.partial is not None:
            return self._lookup_boundary(llm, binding, toks, ns)
        limit = len(toks) - KEEP_UNSERVED
        held = context.held_tokens(llm, toks)
        n = 0
        if limit > held:
            try:
                n = min(binding.store.match(toks, namespace=ns, exact=True), limit)
            except STORE_ERRORS as e:
                self._failed("store_errors", "match", e)
        if n <= held:
            with self._lock:
                self._counters.misses += 1
                self._counters.held_tokens += held
            raise KeyError(f"no stored prefix longer than the {held} tokens the context holds")
        # the sequence state, headers written; state.keys / state.values are [L, H, n, D]
        # views of its K rows and V rows (or V transposed), filled by the get in place
        state = binding.identity.format.seq_buffer(n, seq_id=context.SEQ_ID)
        try:
            binding.store.get(toks[:n], namespace=ns, out=(state.keys, state.values))
        except KeyError as e:
            self._failed("raced_misses", "get", e)
            self._count("misses")
            raise KeyError("the stored prefix went away before it was read") from None
        except STORE_ERRORS as e:
            self._failed("store_errors", "get", e)
            self._count("misses")
            raise KeyError("the stored prefix could not be read") from None
        if not context.restore(llm, state, toks[:n]):
            self._failed("refused_restores", "restore",
                         StateError(f"llama.cpp refused a sequence state of {n} tokens"))
            self._count("misses")
            raise KeyError("llama.cpp refused the stored state")
        with self._lock:
            self._counters.hits += 1
            self._counters.restored_tokens += n
        return RestoredPrefix(input_ids=toks[:n].astype(np.intc), n_tokens=n)

    def __setitem__(self, key: object, value: Any) -> None:
        """Store the context of a finished completion: ``key`` is prompt + completion,
        ``value`` the calling Llama's ``save_state()``. Only the tokens its context holds
        (``value.n_tokens``) are stored, in the request's namespace, and only chunks the store
        lacks are written; durable when this returns. Never raises for a store or state
        problem (counted, logged). Thread-safe."""
        llm = compat.calling_llama()
        binding = self._binding(llm)
        if binding is None:
            return
        assert llm is not None
        ns = tenants.NAMESPACE.get()
        if not self._holds(llm, ns):  # never stored under another namespace than its own
            self._count("namespace_mismatches")
            log.warning("KVStoreLlamaCache(%s): save skipped: the context holds KV of "
                        "another namespace than the request's", self._where())
            return
        assert binding.store is not None and binding.identity is not None
        n = int(value.n_tokens)
        toks = as_tokens(key, "key").astype(np.int64)
        ids = np.asarray(value.input_ids[:n], dtype=np.int64)
        if n == 0 or n > len(toks) or not np.array_equal(ids, toks[:n]):
            self._failed("state_errors", "save", StateError(
                f"the state holds {n} tokens that are not the first tokens of the key"))
            return
        store = binding.store
        try:
            if store.match(ids, namespace=ns) >= n:
                self._count("already_stored")
                self._retain(store, ids, ns)
                return
        except STORE_ERRORS as e:
            self._failed("store_errors", "match", e)
            return
        part = None
        try:
            if binding.identity.partial is not None:  # from the context, at the boundary
                if int(llm.n_tokens) != n:
                    raise StateError(f"the context holds {llm.n_tokens} tokens, the state {n}")
                kv, part = boundary.read_boundary(llm, binding.identity)
            else:
                kv = binding.identity.format.parse_context(value.llama_state)  # [L, H, n, D]
            if kv.num_tokens != n:
                raise StateError(f"the state holds {kv.num_tokens} cells for {n} tokens")
        except StateError as e:
            self._failed("state_errors", "save", e)
            return
        try:
            stored = store.put(ids, kv.keys, kv.values, namespace=ns, state=part)
        except STORE_ERRORS as e:
            self._failed("store_errors", "put", e)
            return
        if stored:
            with self._lock:
                self._counters.saves += 1
                self._counters.saved_tokens += n
            self._retain(store, ids, ns)

    def _retain(self, store: Store, ids: np.ndarray, ns: str | None) -> None:
        """Apply the retention hint of the request being served, if its server gave one
        (:data:`kvstore.integrations.retention.REQUEST`), to the context just saved in
        namespace ``ns``."""
        req = retention.REQUEST.get()
        if req is None:
            return
        req.outcome = retention.apply(store, ids, ns, req.hint)
        self._count("pins" if req.outcome == "pinned" else "pins_refused")

    def _lookup_boundary(self, llm: Any, binding: _Binding, toks: np.ndarray,
                         ns: str | None) -> RestoredPrefix:
        """:meth:`__getitem__` of a hybrid model (:mod:`.boundary`): restore the longest
        stored boundary of the prompt if the context does not hold a longer prefix of it,
        empty the context rather than let it be truncated, then evaluate up to the lookup's
        checkpoints, saving each (all in namespace ``ns``). The context then holds exactly the
        prefix returned."""
        store, ident = binding.store, binding.identity
        assert store is not None and ident is not None
        limit = len(toks) - KEEP_UNSERVED
        n_ctx = int(llm.n_tokens)
        at = n_ctx if context.held_tokens(llm, toks) == n_ctx <= limit else 0
        found = run = 0
        if limit > 0:
            try:  # this process's checkpoints of the prompt still on the writer thread
                store.wait_saved(toks[:limit], namespace=ns)
            except STORE_ERRORS as e:
                self._failed("store_errors", "checkpoint", e)
            try:
                found = store.match(toks[:limit], namespace=ns)
                run = limit - store.residency(toks[:limit], namespace=ns)["missing"]
            except STORE_ERRORS as e:
                self._failed("store_errors", "match", e)
        restored = 0
        if found > at:
            restored = self._restore_boundary(llm, binding, toks[:found], ns)
            if restored:
                at = restored
            elif int(llm.n_tokens) != n_ctx:  # llama.cpp refused it and emptied the context
                at = 0
        if at == 0 and int(llm.n_tokens) > 0:
            context.clear(llm)  # never truncated: its state exists only where it was taken
            self._count("cleared_contexts")
        for point in boundary.checkpoints(start=at, stored_run=run, limit=limit,
                                          chunk=store.config.chunk_tokens):
            llm.eval(toks[at:point].tolist())
            at = point
            self._checkpoint(llm, binding, toks[:point], ns)
        if not restored:
            with self._lock:
                self._counters.misses += 1
                self._counters.held_tokens += at
            if at == 0:
                raise KeyError("no stored boundary of this prompt")
        return RestoredPrefix(input_ids=toks[:at].astype(np.intc), n_tokens=at)

    def _restore_boundary(self, llm: Any, binding: _Binding, toks: np.ndarray,
                          ns: str | None) -> int:
        """Restore the stored boundary of exactly ``toks`` in namespace ``ns``: how many tokens
        the context then holds (0 on any failure, counted; the context is then empty)."""
        assert binding.store is not None and binding.identity is not None
        try:
            ok = boundary.restore(llm, binding.store, binding.identity, toks, namespace=ns)
        except KeyError as e:
            self._failed("raced_misses", "get", e)
            return 0
        except STORE_ERRORS as e:
            self._failed("store_errors", "get", e)
            return 0
        except StateError as e:
            self._failed("state_errors", "restore", e)
            return 0
        if not ok:
            self._failed("refused_restores", "restore",
                         StateError(f"llama.cpp refused a sequence state of {len(toks)} tokens"))
            return 0
        with self._lock:
            self._counters.hits += 1
            self._counters.restored_tokens += len(toks)
        return len(toks)

    def _checkpoint(self, llm: Any, binding: _Binding, toks: np.ndarray,
                    ns: str | None) -> None:
        """Queue the boundary the context holds now (exactly ``toks``) for saving in namespace
        ``ns``, unless the store holds it already (a full write buffer skips it)."""
        assert binding.store is not None and binding.identity is not None
        try:
            if binding.store.match(toks, namespace=ns) == len(toks):
                return
            boundary.save_async(llm, binding.store, binding.identity, toks, namespace=ns)
        except CapacityError:
            return
        except STORE_ERRORS as e:
            self._failed("store_errors", "checkpoint", e)
            return
        except StateError as e:
            self._failed("state_errors", "checkpoint", e)
            return
        self._count("checkpoints")

    def __contains__(self, key: object) -> bool:
        """Whether a lookup of ``key`` by the calling Llama would restore something (no IO
        but the store's match). Thread-safe."""
        llm = compat.calling_llama()
        binding = self._binding(llm, count=False)
        if binding is None or binding.store is None:
            return False
        toks = as_tokens(key, "key").astype(np.int64)
        limit = len(toks) - KEEP_UNSERVED
        ns = tenants.NAMESPACE.get()
        held = context.held_tokens(llm, toks) if self._holds(llm, ns) else 0
        try:
            return min(binding.store.match(toks, namespace=ns, exact=True), limit) > held
        except STORE_ERRORS as e:
            self._failed("store_errors", "match", e)
            return False

    @property
    def cache_size(self) -> int:
        """Bytes of KV the store holds on disk (0 before the store is open). Thread-safe."""
        store = self._open_store()
        return 0 if store is None else int(store.stats()["disk"]["bytes"])

    @property
    def capacity_bytes(self) -> int:
        """The store's disk budget (0 before the store is open). Thread-safe."""
        store = self._open_store()
        return 0 if store is None else int(store.config.disk_bytes)

    # ------------------------------------------------------------------ the rest
    def stats(self) -> dict[str, object]:
        """This cache's counters (see :class:`CacheCounters`), store errors by class, the
        last error, and the reasons Llamas were refused. Thread-safe."""
        with self._lock:
            out: dict[str, object] = asdict(self._counters)
            out["errors"] = dict(self._errors)
            out["last_error"] = self._last_error
            out["refused"] = sorted({b.refused for b in self._bindings.values() if b.refused})
        return out

    @property
    def store(self) -> Store | None:
        """The store in use (None until a Llama first used a directory). Thread-safe."""
        return self._open_store()

    def store_for(self, llm: Any) -> Store | None:
        """The store this cache keeps ``llm``'s KV in (a ``llama_cpp.Llama``), opened now if
        no completion of it opened it yet; None if its KV is not cached (the reason is in
        :meth:`stats`). Thread-safe."""
        b = self._binding(llm, count=False)
        return None if b is None else b.store

    def close(self) -> None:
        """Let go of the store opened for a directory (an open Store given stays open).
        Idempotent; thread-safe. A closed cache misses and stores nothing."""
        with self._lock:
            self._closed = True
            lease, self._lease = self._lease, None
            self._bindings.clear()
        if lease is not None:
            lease.close()

    def __enter__(self) -> KVStoreLlamaCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self._path if self._path is not None else repr(self._given)
        return f"KVStoreLlamaCache({where!r})"

    # ------------------------------------------------------------------ internals
    def _open_store(self) -> Store | None:
        with self._lock:
            if self._given is not None:
                return self._given
            return None if self._lease is None else self._lease.store

    def _binding(self, llm: Any | None, *, count: bool = True) -> _Binding | None:
        """The calling Llama's binding if its KV is served (None otherwise, counted)."""
        if llm is None:
            if count:
                self._count("not_from_llama")
            return None
        with self._lock:
            if self._closed:
                return None
            b = self._bindings.get(id(llm))
        if b is None:
            b = self._bind(llm)
        if b.refused is not None:
            if count:
                self._count("unsupported")
            return None
        return b

    def _bind(self, llm: Any) -> _Binding:
        compat.check()  # once per process: raises UnsupportedEngine, naming what is missing
        b = _Binding()
        try:
            b.identity = identify(llm)
        except Unsupported as e:
            b.refused = str(e)
        except OSError as e:  # the GGUF file cannot be read to hash it
            b.refused = f"cannot hash the model file: {e}"
        if b.refused is None:
            assert b.identity is not None
            b.store, b.refused = self._store_for(b.identity)
        if b.refused is not None:
            log.warning("KVStoreLlamaCache(%s): not caching for %s: %s", self._where(),
                        getattr(llm, "model_path", "this Llama"), b.refused)
        with self._lock:
            if self._closed:
                b = _Binding(refused="the cache is closed")
            else:
                self._bindings[id(llm)] = b
                weakref.finalize(llm, self._forget, id(llm))
        return b

    def _store_for(self, ident: Identity) -> tuple[Store | None, str | None]:
        """The store for a Llama of identity ``ident``, or the reason there is none."""
        mismatch = ("the store holds KV of another model, llama.cpp build or context setup "
                    "(use another directory for this one)")
        if self._given is not None:
            if self._given.layout != ident.layout:
                return None, mismatch
            return self._given, None
        with self._lock:
            lease = self._lease
        if lease is None:
            assert self._path is not None
            try:
                lease = acquire(self._path, layout=ident.layout, **self._options)
            except LayoutMismatch:
                return None, mismatch
            except STORE_ERRORS as e:
                return None, f"cannot open the store: {type(e).__name__}: {e}"
            except ValueError as e:  # open in this process by another user with other options
                return None, str(e)
            with self._lock:
                if self._lease is None and not self._closed:
                    self._lease, lease = lease, None
            if lease is not None:  # another thread won the race, or the cache closed
                lease.close()
            with self._lock:
                lease = self._lease
            if lease is None:
                return None, "the cache is closed"
        if lease.store.layout != ident.layout:
            return None, mismatch
        return lease.store, None

    def _isolate(self, llm: Any, ns: str | None) -> None:
        """Empty ``llm``'s context if it holds KV of another namespace than ``ns`` (else
        llama-cpp-python would continue from it), and record that it now holds ``ns``'s."""
        if self._holds(llm, ns):
            return
        if int(llm.n_tokens) > 0:
            context.clear(llm)
            self._count("namespace_clears")
        with self._lock:
            self._held_ns[id(llm)] = ns

    def _holds(self, llm: Any, ns: str | None) -> bool:
        """Whether ``llm``'s context holds KV of namespace ``ns`` (or nothing yet seen)."""
        with self._lock:
            if id(llm) in self._held_ns:
                return self._held_ns[id(llm)] == ns
            self._held_ns[id(llm)] = None  # not seen yet: the default namespace's
            weakref.finalize(llm, self._forget, id(llm))
        return ns is None

    def _forget(self, key: int) -> None:
        with self._lock:
            self._bindings.pop(key, None)
            self._held_ns.pop(key, None)

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self._counters, name, getattr(self._counters, name) + 1)

    def _failed(self, counter: str, what: str, e: BaseException) -> None:
        """Count and log a failure the completion goes on without."""
        msg = f"{what}: {type(e).__name__}: {e}"
        with self._lock:
            setattr(self._counters, counter, getattr(self._counters, counter) + 1)
            self._errors[type(e).__name__] = self._errors.get(type(e).__name__, 0) + 1
            self._last_error = msg
        log.warning("KVStoreLlamaCache(%s): %s; the prompt is computed without it",
                    self._where(), msg)

    def _where(self) -> str:
        return self._path if self._path is not None else str(getattr(self._given, "path", ""))


@dataclass(frozen=True)
class RestoredPrefix:
    """What a lookup restored into the asking Llama: its tokens (``input_ids``, as a
    ``LlamaState`` has them) and their count. The KV is in the Llama's context already, so
    llama-cpp-python, finding the prefix no longer than what the context holds, loads no
    state of its own on top."""

    input_ids: np.ndarray
    n_tokens: int
