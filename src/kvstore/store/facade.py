"""The store: the data path of an open store directory (put, match, get, layer-wise loads,
saves, flush, stats), its lifecycle and its lock. What is beside the data path is on handles
the store hands out, each its own module: ``store.retention``
(:mod:`kvstore.store.retention_api`), ``store.indexes`` (:mod:`kvstore.store.index_api`),
``store.shared_docs`` (:mod:`kvstore.store.shared_docs`), ``store.debug``
(:mod:`kvstore.store.debug_hooks`); the old names of their calls on ``Store``:
:mod:`kvstore.store.deprecated_aliases`. Crash safety, step by step:
:mod:`kvstore.format.durable`.

The work lives in parts (see ``docs/store.md``): the catalog (:mod:`kvstore.format.catalog`)
is the truth every process shares; :mod:`kvstore.residency.catch_up` keeps this process's view
of it (the prefix tree, :mod:`kvstore.view.prefix_tree`, and the free slots,
:mod:`kvstore.view.disk_slots`) current; puts run the pipeline of :mod:`kvstore.pipelines.put`,
gets that of :mod:`kvstore.pipelines.get`, layer-wise loads that of
:mod:`kvstore.pipelines.layer_reads`; :mod:`kvstore.residency.lookahead` holds the
scheduler's queue, :mod:`kvstore.pipelines.prefetch` the prefetcher;
:mod:`kvstore.pipelines.saving` the write buffer and the writer thread;
:mod:`kvstore.index.lifecycle` the per-head indexes.
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import Future

import numpy as np
import torch

from kvstore.codecs import layer_codec
from kvstore.errors import FormatError
from kvstore.eviction.jobs import as_jobs
from kvstore.eviction.policies import EvictionPolicy
from kvstore.format import boundary_state, chunk_extent
from kvstore.format.hashing import as_tokens
from kvstore.format.open_lock import DirLock
from kvstore.format.records import ChunkRecord, ContextRecord
from kvstore.index.lifecycle import ContextIndexStore, IndexFiles, check_keys, check_spec
from kvstore.index.spec import IndexSpec
from kvstore.pipelines.get import Reader
from kvstore.pipelines.layer_load import LayerLoad
from kvstore.pipelines.layer_reads import Loads
from kvstore.pipelines.pages import Pages, to_block_end
from kvstore.pipelines.prefetch import Prefetch
from kvstore.pipelines.put import Writer
from kvstore.pipelines.row_reads import RowReader
from kvstore.pipelines.saving import SaveHandle, Saver
from kvstore.pipelines.shared.link import RemoteLink
from kvstore.pipelines.shared.local import LocalTiers
from kvstore.pipelines.shared.tiers import SharedTiers
from kvstore.residency.core import Core
from kvstore.residency.lookahead import PREDICTOR_META, Hints
from kvstore.residency.plans import Plans
from kvstore.store.argument_checks import (
    check_device,
    check_kv,
    check_load_out,
    check_out,
    check_pages,
    check_start,
)
from kvstore.store.debug_hooks import DebugHooks
from kvstore.store.deprecated_aliases import DeprecatedAliases
from kvstore.store.index_api import Indexes
from kvstore.store.retention_api import Retention
from kvstore.store.shared_docs import SharedDocs
from kvstore.tiers.shared.chunk_server import ChunkServer
from kvstore.view import boundaries
from kvstore.view.prefix_tree import Piece, served

_LIVE: weakref.WeakSet[Store] = weakref.WeakSet()  # the stores this process has open
_LIVE_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """``os.register_at_fork``: a child's stores refuse every call (:class:`StoreForked`)."""
    global _LIVE_LOCK
    _LIVE_LOCK = threading.Lock()
    for store in list(_LIVE):
        store._core.forget_after_fork(os.getppid())


os.register_at_fork(after_in_child=_after_fork_in_child)


class Store(DeprecatedAliases):
    """An open store directory. Use :func:`kvstore.open`; close with :meth:`close` or ``with``.

    Thread-safety: every public method may be called from any number of threads at once; each
    states what it waits for. The metadata lock is held only for in-memory work, never during
    disk IO, an fsync or a catalog commit: gets run in parallel with each other and with puts.
    Processes: several may have one directory open at once (see :func:`kvstore.open`); each
    sees the others' committed puts.

    Handles (attributes, built at open): ``retention`` (pins, deletes, listings), ``indexes``
    (per-head indexes), ``shared_docs`` (the remote tier's documents), ``debug`` (test and
    benchmark hooks).
    """

    def __init__(self, core: Core, *, lock: DirLock, policy: EvictionPolicy,
                 files: IndexFiles) -> None:
        # Private: kvstore.open() builds a Store once its parts are settled.
        self._core = core
        self._lock = lock
        self.path = core.path
        self.layout = core.layout
        self.config = core.config
        self.readonly = core.readonly
        self._files = files
        self._hints = Hints(core, policy)
        self._prefetch = Prefetch(core, self._hints, files)
        self._reader = Reader(core, self._hints.chunk_queued, files)
        self._loads = Loads(core, files)
        self._writer = Writer(core, Plans(core, self._hints, policy), files,
                              on_commit=self._prefetch.changed)
        self._indexes = ContextIndexStore(
            core, files, get=lambda toks, ns: self.get(toks, namespace=ns))
        self._saver = Saver(
            capacity_bytes=core.config.write_buffer_bytes,
            write=self._write_saved, release=self._release_held, helpers=core.helpers)
        self._shared = SharedTiers()  # below DRAM and disk: Redis, an object store
        self._events = None  # its own publisher of KV events (kvstore.open(events=...))
        # the calls beside the data path, each a handle of its own module (their old names on
        # Store: kvstore.store.deprecated_aliases)
        self.retention = Retention(core, files=files, shared=self._shared)
        self.indexes = Indexes(core.layout, self._indexes)
        self.shared_docs = SharedDocs(core, self._shared)
        self.debug = DebugHooks(core, self._hints)
        with _LIVE_LOCK:
            _LIVE.add(self)

    def _attach_shared(self, tier: ChunkServer, name: str) -> None:
        """Called by :func:`kvstore.open` with each connected shared tier (``"remote"``:
        Redis, ``"objects"``: an object store), in the order they are tried."""
        self._shared.attach(RemoteLink(self._core, tier, name=name,
                                       local=LocalTiers(self._reader, self._writer)))

    def _write_saved(self, toks: np.ndarray, k: torch.Tensor, v: torch.Tensor,
                     namespace: str | None, base: int) -> bool:
        """The writer thread's put of a save, then its write-through (if it was stored)."""
        stored = self._writer.put(toks, chunk_extent.raw(k), chunk_extent.raw(v), namespace, base)
        if stored:
            self._shared.after_put(toks, namespace)
        return stored

    def restore_policy_state(self) -> None:
        """At open: what the policy learned in processes that closed (the ``learned``
        policy's predictor); a damaged state is a problem (:meth:`problems`), and the policy
        starts afresh. Not thread-safe: the opener calls it before the store is shared."""
        try:
            meta = self._core.catalog.get_meta(PREDICTOR_META)
        except FormatError as e:
            meta = e
        problem = self._hints.restore_policy_state(meta)
        if problem is not None:
            self._core.note_problem(problem)

    @property
    def problems(self) -> list[str]:
        """Integrity problems found when the records were last loaded (what was not loaded)."""
        return self._core.problems

    # ------------------------------------------------------------------ writing
    def put(self, tokens: object, keys: torch.Tensor, values: torch.Tensor, *,
            namespace: str | None = None, index: IndexSpec | None = None,
            state: bytes | np.ndarray | None = None) -> bool:
        """Store the KV of ``tokens``; durable when it returns. Returns True once stored (or
        if it was already), False if the eviction policy's admission refused it (``reuse``,
        ``belady``: it would have had to evict contexts all ranked above it; nothing is
        written or evicted, counted in ``stats()["evictions"]["bypassed_puts"]``; not an
        error, so a refused save does not fail :meth:`flush`).

        ``keys``/``values``: [num_layers, num_kv_heads, T, head_dim] in the layout dtype, keys
        without rotary encoding. Chunks already stored (a shared prefix, by any process) are
        not written again. A stored context that is a strict prefix of ``tokens`` is
        superseded (its KV stays servable through this one, but its indexes go with it). With
        ``index``, per-head indexes of that spec are built over the context's keys (RoPE at
        0..T-1) and stored with it (see ``store.indexes.build``); keys that cannot be indexed
        are refused before anything is stored.

        ``state`` (layouts with sliding-window or recurrent layers, ``KVLayout.layers``): the
        engine's bytes of those layers' state after exactly these tokens (at most
        ``layout.state_bytes``), stored with the KV as the boundary state that lets
        :meth:`match` serve this prefix (:mod:`kvstore.view.boundaries`). Without it such a
        put stores the full-attention KV only, which serves a longer prefix's boundary.

        Thread-safe; puts of several threads and processes run at once. The metadata lock is
        not held while the extents are written and synced or the indexes built.
        """
        lay = self.layout
        toks = as_tokens(tokens)
        keys = check_kv(lay, "keys", keys, len(toks))
        values = check_kv(lay, "values", values, len(toks))
        view = None if state is None else boundary_state.check_state(lay, state)
        if index is not None:
            lay.require_plain("per-head indexes (put(index=...))")
            check_spec(index, "index", lay.head_dim)
            check_keys(keys)
        kr = chunk_extent.raw(keys.detach().to("cpu").contiguous())  # [L, H, T, D]
        vr = chunk_extent.raw(values.detach().to("cpu").contiguous())  # [L, H, T, D]
        if view is not None:
            toks, kr, vr = boundary_state.with_state(lay, self.config.chunk_tokens, toks, kr, vr,
                                                 view)
        if not self._writer.put(toks, kr, vr, namespace):
            return False
        self._shared.after_put(toks, namespace)  # write-through, sent in the background
        if index is not None:
            self._indexes.attach(toks, namespace, keys, index)
        return True

    # ------------------------------------------------------------------ retention hints
    def begin_save(self, tokens: object, *, namespace: str | None = None,
                   max_new_tokens: int = 0, wait: bool = True,
                   state: bool = False) -> SaveHandle:
        """Start saving the context ``tokens`` asynchronously (AttentionStore §3.2.2).

        Give each layer's KV to :meth:`SaveHandle.layer` as soon as it exists (during prefill),
        decode-step KV of up to ``max_new_tokens`` more tokens to :meth:`SaveHandle.append`, then
        :meth:`SaveHandle.finish`: a writer thread stores the context (crash-safe, all or
        nothing) and the returned future completes when it is durable. Only tokens after the
        already stored full chunks are copied (``SaveHandle.base``; when it is ``len(tokens)``
        there is nothing new to store); this process does not evict those chunks until the
        save ends (another process may: the save then fails with a clear error).
        Thread-safe; waits while the write buffer (``write_buffer_bytes``) is full, or with
        ``wait=False`` raises :class:`CapacityError` at once (a caller that must not block
        drops the save).

        ``state=True`` (layouts with sliding-window or recurrent layers): the save ends at the
        boundary ``len(tokens)`` and carries its state, given to
        :meth:`SaveHandle.finish(state=...) <kvstore.SaveHandle.finish>` (no ``append``).
        """
        toks = as_tokens(tokens)
        if not isinstance(state, bool):
            raise TypeError(f"state must be a bool, got {type(state).__name__}")
        if state and not self.layout.boundary_state:
            raise ValueError("begin_save(state=True) is for layouts with sliding-window or "
                             "recurrent layers (KVLayout.layers)")
        if state and max_new_tokens:
            raise ValueError("a save with state=True ends at len(tokens): max_new_tokens "
                             "must be 0")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if not isinstance(wait, bool):
            raise TypeError(f"wait must be a bool, got {type(wait).__name__}")
        core = self._core
        c = core.config.chunk_tokens
        held = core.hold_prefix(toks, namespace)
        base = len(held) * c
        capacity = len(toks) + max_new_tokens - base
        if state:  # the rest of the boundary's chunk, then the largest state's rows
            capacity = boundary_state.data_start(len(toks), c) - base + \
                boundary_state.state_rows(self.layout, self.layout.state_bytes)
        nbytes = capacity * self.layout.token_bytes
        try:
            self._saver.reserve(nbytes, wait=wait)
        except BaseException:
            self._release_held(held)
            raise
        return SaveHandle(self._saver, self.layout, toks, namespace, base, capacity, held,
                          nbytes, core.buffers, state_chunk=c if state else None)

    def _release_held(self, keys: list[bytes]) -> None:
        self._core.release(keys)

    def save_async(self, tokens: object, keys: torch.Tensor, values: torch.Tensor, *,
                   namespace: str | None = None) -> Future[bool]:
        """:meth:`put` on the writer thread: returns once the KV is copied into the write
        buffer; the future completes when it is durable, with put's result (False: the
        policy's admission refused it). Thread-safe."""
        toks = as_tokens(tokens)
        keys = check_kv(self.layout, "keys", keys, len(toks))
        values = check_kv(self.layout, "values", values, len(toks))
        with self.begin_save(toks, namespace=namespace) as save:
            save.layers(keys, values)
            return save.finish()

    def wait_saved(self, tokens: object, *, namespace: str | None = None) -> None:
        """Block until asynchronous saves that may extend what the store serves for
        ``tokens`` are written (so :meth:`match` sees them); raises such a save's error.
        Thread-safe."""
        self._core.check_open()
        self._saver.wait_for(as_tokens(tokens), namespace)

    def flush(self, *, remote: bool = False) -> None:
        """The durability point of asynchronous saves: block until every finished save is
        durable; raise the first error a save met since the last flush. With ``remote=True``,
        then also wait until every chunk queued for write-through so far has been sent to the
        shared tiers, Redis and the object store (or failed to: their failures are counted in
        ``stats()["remote"]`` and ``stats()["objects"]``, never raised). Thread-safe."""
        self._core.check_open()
        if not isinstance(remote, bool):
            raise TypeError(f"remote must be a bool, got {type(remote).__name__}")
        self._saver.flush()
        if remote:
            self._shared.flush()

    def set_prefill_rate(self, tokens_per_s: float | None) -> None:
        """How fast the caller recomputes (prefills) KV, in tokens per second, or None
        (unknown). With a remote tier, :meth:`match` then counts a remote prefix only if
        fetching it is estimated (from the link's measured latency and bandwidth) to end
        sooner than recomputing it. Thread-safe."""
        if tokens_per_s is not None:
            if isinstance(tokens_per_s, bool) or not isinstance(tokens_per_s, int | float) \
                    or not tokens_per_s > 0 or tokens_per_s == float("inf"):
                raise ValueError(f"tokens_per_s must be a positive finite number or None, got "
                                 f"{tokens_per_s!r}")
            tokens_per_s = float(tokens_per_s)
        self._shared.set_prefill_rate(tokens_per_s)

    # ------------------------------------------------------------------ reading
    def match(self, tokens: object, *, namespace: str | None = None,
              exact: bool = False) -> int:
        """How many leading tokens of ``tokens`` the store can serve (from any tier, as
        committed by any process; with boundary states, a hybrid layout's, only a stored
        boundary's length, including one another machine stored in a shared tier: two round
        trips to it, see :mod:`kvstore.pipelines.remote_boundaries`). Thread-safe. Without a
        remote tier it never waits for IO;
        with one, tokens after the local prefix cost one pipelined round trip to Redis (and
        count only if fetching them pays, see :meth:`set_prefill_rate`); a remote failure
        is a shorter match, never an error. ``exact=True``: only what chunks and remote
        values stored without a lossy codec serve (KV bit-identical to what was put: for an
        engine that must give the answers it would compute, whatever codecs other processes
        of the store chose)."""
        toks = as_tokens(tokens)
        if not isinstance(exact, bool):
            raise TypeError(f"exact must be a bool, got {type(exact).__name__}")
        core = self._core
        if self.layout.boundary_state:
            found = self._boundary(toks, namespace)
            n = 0 if found is None else found.position
            if self._shared and n < len(toks):  # one another machine stored, if it pays
                n = self._shared.find_boundary(toks, namespace,
                                               self._resolve(toks, namespace), n)
        else:
            pieces = self._resolve(toks, namespace)
            n = served(pieces)
            lossy = [p.start for p in pieces
                     if layer_codec.NAMES[p.rec.codec] in layer_codec.LOSSY] if exact else []
            if lossy:
                n = min(lossy)
            elif n < len(toks):
                n = self._shared.match(toks, namespace, pieces, n, exact=exact)
        core.count(match_calls=1, matched_tokens=n)
        return n

    def _boundary(self, toks: np.ndarray, namespace: str | None, limit: int | None = None
                  ) -> boundaries.Boundary | None:
        """The longest stored boundary state of ``toks`` (at most ``limit``), after catching
        up with the other processes' commits."""
        return self._core.find_boundary(toks, namespace,
                                        len(toks) if limit is None else limit)

    def state(self, tokens: object, *, namespace: str | None = None) -> bytes:
        """The boundary state stored with exactly ``tokens`` (layouts with sliding-window or
        recurrent layers): the engine's bytes given to :meth:`put` (or a save). KeyError if no
        state is stored at len(tokens) (it was never stored, was evicted, or another process
        evicted it while it was read), :class:`CorruptData` if its bytes fail their checksum
        (the context is then dropped: the next :meth:`match` is shorter). Read from this
        machine's tiers, else from the shared tiers (Redis, an object store), where another
        machine may have stored it: fetched and verified within the tier's deadline (any
        failure there is a KeyError, a miss). Thread-safe."""
        toks = as_tokens(tokens)
        if not self.layout.boundary_state:
            raise ValueError("state() is for layouts with sliding-window or recurrent layers "
                             "(KVLayout.layers)")
        found = self._boundary(toks, namespace)
        if (found is None or found.position != len(toks)) and self._shared:
            return self._shared.state(toks, namespace)
        if found is None or found.position != len(toks):
            raise KeyError(f"no boundary state stored after these {len(toks)} tokens")
        lay = self.layout
        k, v = chunk_extent.empty_kv(lay, found.rows, 2)  # [L, H, m, D] each
        with self._loads.start(found.tokens, namespace, buffer_layers=None, out=(k, v),
                               device=torch.device("cpu"), start=found.rows_at) as load:
            for layer in range(lay.num_layers):
                load.wait(layer)
        rows = np.stack([chunk_extent.raw(k), chunk_extent.raw(v)], axis=1)  # [L, 2, H, m, D]
        return boundary_state.decode(lay, rows)

    def _resolve(self, toks: np.ndarray, namespace: str | None) -> list[Piece]:
        """The stored pieces serving a prefix of ``toks`` here, after catching up with the
        other processes' commits."""
        return self._core.lookup(toks, namespace)

    def _local_tokens(self, toks: np.ndarray, namespace: str | None) -> int:
        return served(self._resolve(toks, namespace))

    def lossy_tokens(self, tokens: object, *, namespace: str | None = None) -> int:
        """How many of the tokens ``match(tokens)`` would serve come from chunks stored through
        a lossy codec (their KV is not bit-identical to a recompute): local chunks, and chunks
        after the local prefix that lossy remote values served to a recent get or load of
        these tokens. Thread-safe; no IO."""
        toks = as_tokens(tokens)
        pieces = self._resolve(toks, namespace)
        n = sum(p.use for p in pieces if layer_codec.NAMES[p.rec.codec] in layer_codec.LOSSY)
        if served(pieces) < len(toks):
            n += self._shared.lossy_tokens(toks, namespace, pieces)
        return n

    def get(self, tokens: object, *, namespace: str | None = None,
            out: tuple[torch.Tensor, torch.Tensor] | None = None,
            device: str | torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of all of ``tokens``: (keys, values), [num_layers, num_kv_heads, T, head_dim].

        Keys are pre-RoPE, in the layout dtype, on CPU unless ``device`` is given; with
        ``out=(k, v)`` the preallocated tensors are filled and returned. Raises KeyError if not
        every token is stored, :class:`CorruptData` if stored bytes fail their checksum (the
        contexts holding them are then dropped, so a retry sees a shorter match).

        A CUDA output (``device="cuda"`` or ``out`` on the GPU) is written after the work
        already queued on the calling thread's current stream, and is complete for the work
        queued on that stream after the get returns (no device-wide synchronisation).

        Thread-safe; gets of several threads run in parallel with each other and with puts
        (a get never waits for a put's fsync).
        """
        toks = as_tokens(tokens)
        dev = None if device is None else check_device(device)
        if out is not None:
            out = check_out(self.layout, out, len(toks))
            if dev is not None and dev != out[0].device:
                raise ValueError(f"device={device!r} disagrees with out tensors on "
                                 f"{out[0].device}")
        if self._shared and self._local_tokens(toks, namespace) < len(toks):
            return self._shared.get(toks, namespace, out, dev)
        return self._reader.get(toks, namespace, out, dev)

    def load_layers(self, tokens: object, *, namespace: str | None = None,
                    buffer_layers: int | None = None,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None,
                    device: str | torch.device | None = None, start: int = 0,
                    pages: Pages | None = None) -> LayerLoad:
        """Start loading the KV of ``tokens`` layer by layer; returns a :class:`LayerLoad`.

        A loader thread fills layer 0, 1, ... of (keys, values) [L, H, T, D] (pre-RoPE) in an
        execution buffer of the hbm tier on ``device`` (default CPU; on CUDA each layer goes
        through pinned host memory and a copy stream), or in ``out`` (contiguous CPU tensors);
        ``wait(l)`` blocks until layer l is ready. With ``buffer_layers=B`` the loader loads at
        most B layers before compute first waits, then stays at most B + 1 layers ahead of the
        layer compute waits for (None: no bound). Layers read from disk are verified one by one
        and are not copied into the DRAM tier. The chunks' disk slots are pinned until the load
        ends (this process does not reuse them; if another process does, ``wait`` raises
        KeyError: a miss). :meth:`LayerLoad.close` gives the execution buffer back. Raises
        KeyError if not every token is stored, CapacityError if the execution buffer does not
        fit ``hbm_bytes``. Thread-safe.

        ``start``: load only positions [start, len(tokens)) of the stored ``tokens`` (T =
        len(tokens) - start; the back of a prefix whose front is recomputed, the Cake-style
        split). Only the chunks covering them are read, each layer verified against its
        checksum as always; the keys stay pre-RoPE (their true positions are start.. on use).
        Tokens served by the remote tier are fetched whole first, then sliced.

        ``pages``: deprecated, use :meth:`load_into_pages` (which this forwards to; a load
        into pages takes neither ``out`` nor ``device``).
        """
        toks = as_tokens(tokens)
        start = check_start(start, len(toks))
        if pages is not None:
            if out is not None or device is not None:
                raise ValueError("a load into pages takes neither out nor device")
            return self.load_into_pages(toks, pages, namespace=namespace, start=start,
                                        buffer_layers=buffer_layers)
        dev = check_device(device) if device is not None else torch.device("cpu")
        if out is not None:
            out = check_load_out(self.layout, out, len(toks) - start, device, dev)
        return self._start_load(toks, namespace, start=start, buffer_layers=buffer_layers,
                                out=out, device=dev, pages=None)

    def load_into_pages(self, tokens: object, pages: Pages, *, namespace: str | None = None,
                        start: int = 0, buffer_layers: int | None = None) -> LayerLoad:
        """Start loading the KV of ``tokens`` layer by layer straight into an engine's paged KV
        cache (:class:`~kvstore.pipelines.pages.Pages`, holding the loaded tokens; ``start``
        and the store's chunks on its block boundaries); returns a :class:`LayerLoad` whose
        ``wait(l)`` returns None once layer l is in the blocks. ``start`` and
        ``buffer_layers`` as in :meth:`load_layers`.

        No execution buffer: a raw chunk on disk is read into the blocks in place and verified
        there, so a load that fails leaves its blocks holding unverified bytes, which the
        caller must not use. Blocks are filled whole: where ``tokens`` end inside the pages'
        last block, the rest of that block comes from the stored chunk holding the last token
        (the KV of whatever that chunk continues with: positions the engine computes itself,
        after the load has filled that block: a block the engine writes while it is loaded
        fails its check); KeyError if this store does not hold that block whole, or not every
        token. Thread-safe.
        """
        toks = as_tokens(tokens)
        start = check_start(start, len(toks))
        pages = check_pages(self.layout, pages, len(toks) - start)
        if pages.num_tokens != len(toks) - start:
            toks = self._to_block_end(toks, namespace, start + pages.num_tokens)
        return self._start_load(toks, namespace, start=start, buffer_layers=buffer_layers,
                                out=None, device=torch.device("cpu"), pages=pages)

    def _start_load(self, toks: np.ndarray, namespace: str | None, *, start: int,
                    buffer_layers: int | None, out: tuple[torch.Tensor, torch.Tensor] | None,
                    device: torch.device, pages: Pages | None) -> LayerLoad:
        """A checked layer-wise load: from this machine's tiers, else through a shared tier
        (the local prefix, then the rest)."""
        if self._shared and self._local_tokens(toks, namespace) < len(toks):
            return self._shared.layer_load(toks, namespace, start=start,
                                           buffer_layers=buffer_layers, out=out, device=device,
                                           hbm=self._loads.hbm, pages=pages)
        return self._loads.start(toks, namespace, buffer_layers=buffer_layers, out=out,
                                 device=device, start=start, pages=pages)

    def _to_block_end(self, toks: np.ndarray, namespace: str | None, end: int) -> np.ndarray:
        """``toks`` continued to ``end`` as the stored chunk holding the last of them
        continues (:func:`~kvstore.pipelines.pages.to_block_end`): a chunk of this machine's,
        else one a shared tier holds (for a hybrid boundary another machine stored, its own
        chunk, whose tokens after it are STATE)."""
        pieces = self._resolve(toks, namespace)
        if served(pieces) < len(toks) and self._shared:
            return self._shared.block_end(toks, namespace, end)
        return to_block_end(toks, pieces, end)

    def rows(self, tokens: object, *, namespace: str | None = None) -> RowReader:
        """A :class:`~kvstore.pipelines.row_reads.RowReader` over the stored context of
        ``tokens``: reads the K/V rows of chosen token positions one layer at a time (offloaded
        sparse decode),
        verified per chunk-layer like every read. KeyError unless every token is stored in
        this machine's tiers (row reads do not go to the remote tier). Thread-safe."""
        toks = as_tokens(tokens)
        if self._shared and self._local_tokens(toks, namespace) < len(toks):
            raise KeyError("row reads serve contexts stored in this machine's tiers only")
        return RowReader(self._core, self._files, toks, namespace, self._hints.chunk_queued)

    def residency(self, tokens: object, *, namespace: str | None = None) -> dict[str, int]:
        """Where the KV of ``tokens`` is: tokens served from this process's DRAM, from disk
        only, and not stored. Counts no access. Thread-safe."""
        return self._core.where(as_tokens(tokens), namespace)

    # ------------------------------------------------------------------ per-head indexes
    # ------------------------------------------------------------------ scheduler hints
    def set_queue(self, jobs: object, *, running: object = ()) -> None:
        """Hand the store the scheduler's waiting jobs, the next to run first (AttentionStore
        §3.3). Each job is its prompt's token ids (or ``(tokens, namespace)``, or a
        :class:`kvstore.Job`). ``running``: jobs executing now (same forms); their stored
        contexts are kept in DRAM ahead of every waiting job's, since they are being read, but
        they do not count in the windows. Replaces the previous queue; call it whenever the
        queue changes.

        With the ``scheduler`` (or ``belady``) policy, a background thread then fetches from
        disk into DRAM the stored contexts of the next ``prefetch_window`` jobs, and eviction
        looks ahead ``eviction_window`` jobs (see :mod:`kvstore.eviction.jobs`; both windows are in
        ``stats()["queue"]``). With ``lru``/``fifo`` the queue is recorded but not used.
        Thread-safe.
        """
        queue = as_jobs(jobs)
        self._prefetch.set_queue(queue, as_jobs(running))
        if queue:
            window = max(1, self._hints.windows.prefetch)
            self._shared.prefetch(queue[:window])

    def wait_prefetched(self, timeout: float | None = None) -> bool:
        """Block until the prefetcher has acted on the latest queue and store changes (False
        on timeout). Re-raises an IO error the prefetcher met. With a remote tier, also
        until queued jobs' KV was fetched from Redis and stored locally. Thread-safe."""
        ok = self._prefetch.thread.wait_idle(timeout)
        ok = self._shared.wait_prefetched(timeout) and ok
        return ok

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, object]:
        """Bytes and chunk counts per tier, hits/misses, evictions, sharing (this process's
        counters; the disk tier as committed by every process). Thread-safe."""
        core = self._core
        out = core.stats(tiers=self._loads.tiers(), hints=self._hints, saver=self._saver,
                         shared=self._shared.stats(), exclusive=self._lock.exclusive)
        if self._events is not None:
            out["events"] = self._events.stats()
        return out

    def contexts(self) -> list[ContextRecord]:
        """Snapshot of the stored contexts (copies). Thread-safe."""
        return self._core.contexts()

    def chunk_records(self) -> list[ChunkRecord]:
        """Snapshot of the chunk records. Thread-safe."""
        return self._core.chunk_records()

    # ------------------------------------------------------------------ KV events
    def attach_event_source(self, *, hasher, block_size: int, extra_keys_of=None, media=None,
                            max_queue_size: int = 100_000, wake=None):
        """A source of this store's KV events in vLLM's format
        (:class:`kvstore.events.source.EventSource`: ``drain()`` returns the events of what
        every tier it reports gained or lost since the last drain, the first one what the
        store holds), its blocks hashed by ``hasher`` in blocks of ``block_size`` (see
        :func:`kvstore.store.kv_events.attach_source`; ``extra_keys_of``: default, a namespace
        hashed as vLLM hashes a ``cache_salt``). For an engine that publishes the events
        itself (vLLM's connector). Thread-safe; the reports never wait."""
        from kvstore.events.hashing import namespace_extra_keys
        from kvstore.store.kv_events import attach_source

        self._core.check_open()
        return attach_source(self._core, hasher=hasher, block_size=block_size,
                             extra_keys_of=extra_keys_of or namespace_extra_keys, media=media,
                             max_queue_size=max_queue_size, wake=wake)

    def detach_event_source(self, source) -> None:
        """Stop feeding ``source`` (from :meth:`attach_event_source`). Thread-safe."""
        self._core.hooks.detach(source)

    def _publish_events(self, cfg) -> None:
        """Called by :func:`kvstore.open` with ``events=``: start the store's own publisher
        (:func:`kvstore.store.kv_events.start_publisher`)."""
        from kvstore.store.kv_events import start_publisher

        self._events = start_publisher(self._core, cfg)

    @property
    def events(self):
        """The store's own publisher of KV events (:class:`kvstore.events.publisher.
        ZmqPublisher`), or None. Thread-safe."""
        return self._events

    # ------------------------------------------------------------------ closing
    def close(self, *, abandon_pending: bool = False) -> None:
        """Finish IO, persist access times, release files and the lock. Idempotent.

        Finished asynchronous saves are written first (with ``abandon_pending``, those not yet
        started are dropped: their futures get :class:`StoreClosed`); either way each context is
        stored whole or not at all. Layer-wise loads still running are cancelled (their waiters
        get an error). No thread of the store outlives close(). Thread-safe.
        """
        core = self._core
        if core.forked_from is not None:  # a child's copy: the parent owns all of it
            core.closed = True
            return
        if not core.begin_closing():  # no new layer-wise loads, saves or prefetches from here on
            return
        self._prefetch.thread.close()
        self._saver.close(abandon=abandon_pending)
        self._shared.close(abandon=abandon_pending)  # sends what write-through queued
        for load in self._loads.running():
            load.close()
        self._writer.wait_idle()  # puts writing without the lock
        if self._events is not None:  # what was reported goes out, then the publisher stops
            self._events.close()
        if not core.mark_closed():
            return
        try:
            if not self.readonly and core.failed is None:
                core.persist_on_close(self._hints.policy_state())
        finally:
            core.close_memory()
            self._files.close()
            if core.owner is not None:
                core.owner.close()
                core.owner.dir.close()
            # The directory lock goes first: while a process holds it, its catalog is open
            # (a joiner relies on it to tell a live lock file from a planted one).
            self._lock.release()
            core.catalog.close()
            core.root.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<kvstore.Store {self.path!r} {self._core.describe()}>"



