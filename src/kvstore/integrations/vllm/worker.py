"""The worker side: fills vLLM's blocks from the store layer by layer, and saves new blocks.

Runs in vLLM's worker process, on its forward thread. Per step (a :class:`StepPlan`):

* before the forward, each load starts a layer-wise load of the store into the request's
  blocks (``Store.load_layers(tokens, start=..., pages=...)``): the store's loader thread
  reads (from disk straight into the blocks) and verifies layer after layer;
  ``wait_for_layer_load(l)``, called by each attention layer before it attends, waits for
  layer l only. A load that ends inside a block (a stored tail) fills that block whole, and
  vLLM's CPU backend writes a layer's new KV into its blocks *before* that layer waits for
  its load: so the last block is loaded apart, every layer of it, before the forward starts
  (one block; the whole blocks before it stay layer-wise);
* each save opens an asynchronous save of the store (``Store.begin_save``, which skips the
  chunks already stored); after layer l has attended, its new blocks are copied into the
  save's write buffer as they are; at the end of the step the save goes to the store's writer
  thread.

The store holds vLLM's pages as vLLM packs them (no conversion either way): the layout's
``engine`` names the packing and the block size (:mod:`~kvstore.integrations.vllm.identity`).
  The forward never waits for the disk: a save that finds the write buffer full is dropped
  (a future miss), never waited for.

A store that fails (a miss since the lookup, a corrupt extent, an IO error, a full disk) is a
miss: the load's blocks are reported to vLLM, which recomputes them; the error is logged and
counted, never raised into the engine.

A hybrid model's load (:mod:`.hybrid`) is asynchronous for vLLM: the worker fills the
full-attention blocks and the boundary state's blocks whole before the forward, then reports
the request done (or failed: vLLM then recomputes it whole, as it requires with several
KV-cache groups) through ``get_transfer_results``. A hybrid request's final save copies its
boundary state out of its blocks beside its full-attention pages. With several KV-cache groups
of full attention alone, each layer's blocks are its own group's (``group_block_ids``), and
loads are whole and asynchronous, as a hybrid's.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import torch

from kvstore.errors import CapacityError, KVStoreError
from kvstore.integrations import retention
from kvstore.integrations.vllm.groups import Groups
from kvstore.integrations.vllm.hybrid import StatePages
from kvstore.integrations.vllm.plan import LoadSpec, SaveSpec, StepPlan, WorkerReport
from kvstore.integrations.vllm.stats import KVStoreConnectorStats
from kvstore.pipelines.layer_load import LayerLoad
from kvstore.pipelines.pages import Pages
from kvstore.pipelines.saving import SaveHandle
from kvstore.store.facade import Store

log = logging.getLogger("vllm.kvstore")

# What a store can fail with: a miss (KeyError), its own errors, the OS's.
STORE_ERRORS = (KeyError, KVStoreError, OSError)


@dataclass(eq=False)
class _Load:
    spec: LoadSpec
    handle: LayerLoad | None  # the whole blocks' layer-wise load (None: a tail block only)
    tiers: dict[str, int]  # where its tokens were when it started
    loaded: int = 0  # layers 0..loaded-1 are in vLLM's blocks


@dataclass(eq=False)
class _Save:
    spec: SaveSpec
    handle: SaveHandle
    pages: Pages | None  # the blocks holding tokens the store does not have (None: none,
    # a hybrid boundary whose every block the store holds: only its state is new)
    given: set[int] = field(default_factory=set)  # layers copied into the write buffer


class WorkerSide:
    """Thread-safety: vLLM calls it from its forward thread only (the store's loader and
    writer threads work behind the store's own handles)."""

    def __init__(self, store: Store | None, *, block_size: int,
                 buffer_layers: int | None, groups: Groups | None = None,
                 durable: str = "disk") -> None:
        self.store = store
        # where a producer's prompt must be durable: "disk", or a shared tier's write-through
        self.durable = durable
        self.block_size = block_size
        self.buffer_layers = buffer_layers
        self.groups = groups if groups is not None and groups.hybrid else None
        self._full = groups.full if groups is not None else ()  # full-attention groups
        self.stats = KVStoreConnectorStats()
        self._caches: tuple[torch.Tensor, ...] = ()  # per layer [NB, H, 2, B*D]
        self._index: dict[str, int] = {}  # layer name -> layer
        self._group_of: tuple[int, ...] = ()  # layer -> its full-attention group (several)
        self._state_pages: StatePages | None = None
        self._recving: set[str] = set()  # hybrid loads done this step (failed ones too)
        self._failed_recving: set[str] = set()
        self._loads: list[_Load] = []
        self._saves: list[_Save] = []
        self._invalid: set[int] = set()  # block ids whose load failed this step
        self._report = WorkerReport()
        self._sent: set[str] = set()  # requests whose final save was copied
        # Outcomes of saves, appended by the store's writer thread, counted on the forward's;
        # and of hybrid boundary saves (req_id, durable), reported to the scheduler side.
        self._written_saves: collections.deque[str] = collections.deque()
        self._boundaries: collections.deque[tuple[str, bool]] = collections.deque()
        # this step's producers' prompts: their saves' futures, and why one is not durable
        self._produce: dict[str, list] = {}
        self._produce_errors: dict[str, str] = {}
        self._produce_later: list[SaveSpec] = []  # found the write buffer full: in end()
        # the shared tiers' failed writes when the last producer's prompt was checked (None:
        # not counted yet; counted from the first step, before any save of this engine's)
        self._failed_writes: int | None = None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's per-layer KV caches, in layer order of their names."""
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        if self.groups is not None:
            names = self.groups.full_layers(extract_layer_index)
            self._state_pages = StatePages(self.groups, kv_caches)
        if len(self._full) > 1:
            self._group_of = tuple(next(i for i, g in enumerate(self._full) if n in g.layers)
                                   for n in names)
        shapes = {tuple(kv_caches[n].shape) for n in names}
        if len(shapes) != 1:
            raise ValueError(f"the KVStoreConnector needs one KV cache shape for every layer, "
                             f"got {sorted(shapes)}")
        if self.store is not None and len(names) != self.store.layout.num_layers:
            raise ValueError(f"vLLM registered {len(names)} KV caches; the layout has "
                             f"{self.store.layout.num_layers} layers")
        self._caches = Pages.of([kv_caches[n] for n in names], (), self.block_size).layers
        self._index = {n: i for i, n in enumerate(names)}

    def _pages(self, block_ids: tuple[int, ...],
               group_block_ids: tuple[tuple[int, ...], ...] | None = None) -> Pages:
        per_layer = None
        if group_block_ids is not None and len(group_block_ids) > 1:
            per_layer = tuple(group_block_ids[g] for g in self._group_of)
        return Pages(layers=self._caches, block_ids=block_ids, block_tokens=self.block_size,
                     layer_block_ids=per_layer)

    # ---- one step -------------------------------------------------------------------------
    def begin(self, plan: StepPlan) -> None:
        """The step's plan is bound (before the forward): open its saves."""
        self._produce = {rid: [] for rid in plan.produce}
        if self._failed_writes is None and self.store is not None and self.durable != "disk":
            self._failed_writes = self._shared_write_failures()
        if self.store is None:
            self._produce_errors = {rid: "the connector's store could not be opened"
                                    for rid in plan.produce}
            return
        for spec in plan.saves:
            self._open_save(spec)

    def start_loads(self, plan: StepPlan) -> None:
        """Before the forward (vLLM calls it then when a step has loads): start the plan's
        layer-wise loads."""
        if self.store is None:
            for spec in plan.loads:  # a lookup cannot have matched, but never serve nothing
                self._fail_load(spec, KeyError("no store"))
            return
        for spec in plan.loads:
            if spec.whole:
                self._load_whole(spec)
            else:
                self._start_load(spec)

    def _load_whole(self, spec: LoadSpec) -> None:
        """A load whole, now (a hybrid model's, or with several KV-cache groups): a boundary
        state into its blocks, then the full-attention blocks of every group (the last one
        whole); reported done or failed to vLLM."""
        assert spec.state is None or self._state_pages is not None
        tokens = list(spec.tokens)
        t0 = time.perf_counter()
        self._recving.add(spec.req_id)
        try:
            where = self.store.residency(tokens, namespace=spec.namespace)
            if spec.start:
                front = self.store.residency(tokens[:spec.start], namespace=spec.namespace)
                where = {k: where[k] - front[k] for k in where}
            if spec.state is not None:
                self._state_pages.scatter(spec.state, self.store.state(
                    tokens, namespace=spec.namespace))
            pages = self._pages(spec.block_ids, spec.group_block_ids)
            with self.store.load_layers(tokens, namespace=spec.namespace, start=spec.start,
                                        pages=pages) as load:
                for layer in range(len(self._caches)):
                    load.wait(layer)
        except STORE_ERRORS as e:
            self._failed_recving.add(spec.req_id)
            self._fail_load(spec, e)
            return
        finally:
            self.stats.add("load_seconds", time.perf_counter() - t0)
        self._report.loaded[spec.req_id] = {"dram": where["dram"], "disk": where["disk"],
                                            "remote": where["missing"]}
        self.stats.add("loads")
        self.stats.add("loaded_tokens", spec.num_tokens)

    def _start_load(self, spec: LoadSpec) -> None:
        tokens = list(spec.tokens)
        whole = len(tokens) // self.block_size * self.block_size  # tokens in whole blocks
        blocks = spec.block_ids[:(whole - spec.start) // self.block_size]
        t0 = time.perf_counter()
        try:
            where = self.store.residency(tokens, namespace=spec.namespace)
            if spec.start:  # the loaded range is the back of the prefix
                front = self.store.residency(tokens[:spec.start], namespace=spec.namespace)
                where = {k: where[k] - front[k] for k in where}
            if whole < len(tokens):
                self._load_last_block(spec, tokens, max(whole, spec.start))
            handle = None
            if blocks:
                handle = self.store.load_layers(tokens[:whole], namespace=spec.namespace,
                                                start=spec.start,
                                                buffer_layers=self.buffer_layers,
                                                pages=self._pages(blocks))
        except STORE_ERRORS as e:
            self._fail_load(spec, e)
            return
        finally:
            self.stats.add("load_seconds", time.perf_counter() - t0)
        tiers = {"dram": where["dram"], "disk": where["disk"], "remote": where["missing"]}
        self._loads.append(_Load(spec, handle, tiers))
        self.stats.add("loads")

    def _load_last_block(self, spec: LoadSpec, tokens: list[int], start: int) -> None:
        """Fill the load's last block, which ends inside (the store fills it whole), every
        layer of it, now: the forward writes its new tokens' KV there before it waits."""
        pages = self._pages(spec.block_ids[-1:])
        with self.store.load_layers(tokens, namespace=spec.namespace, start=start,
                                    pages=pages) as load:
            for layer in range(len(self._caches)):
                load.wait(layer)

    def _fail_load(self, spec: LoadSpec, error: BaseException) -> None:
        """The load's blocks hold no (or unverified) KV: vLLM recomputes them."""
        log.warning("kvstore: loading %d tokens of request %s failed, vLLM recomputes them: "
                    "%s: %s", spec.num_tokens, spec.req_id, type(error).__name__, error)
        if not spec.whole:  # a whole load is reported failed as a request instead
            self._invalid.update(spec.block_ids)
        self._report.failed.add(spec.req_id)
        self.stats.add("load_failures")

    def _open_save(self, spec: SaveSpec, *, wait: bool = False) -> None:
        try:
            handle = self.store.begin_save(list(spec.tokens), namespace=spec.namespace,
                                           wait=wait, state=spec.state is not None)
        except CapacityError as e:
            if spec.produce and not wait:  # waits in end(), once the others are handed over
                self._produce_later.append(spec)
                return
            self._refused(spec, e)
            return
        except STORE_ERRORS as e:
            self._refused(spec, e)
            return
        self._opened(spec, handle)

    def _refused(self, spec: SaveSpec, e: BaseException) -> None:
        """A save that could not be opened (the write buffer full, the store closing)."""
        log.info("kvstore: not saving request %s now: %s", spec.req_id, e)
        if spec.produce:
            self._produce_errors[spec.req_id] = f"its save was refused: {e}"
        self.stats.add("saves_refused")
        self._sent_if_final(spec)
        if spec.state is not None:
            self._boundaries.append((spec.req_id, False))

    def _opened(self, spec: SaveSpec, handle: SaveHandle) -> None:
        """An opened save: aborted if the store holds it all, else copied as layers attend."""
        if handle.base >= len(spec.tokens) and spec.state is None:  # all stored already
            handle.abort()
            self.stats.add("saves_already_stored")
            self._sent_if_final(spec)
            if spec.retain is not None:  # one catalog commit, on this thread (rare)
                self.stats.add(self._retain(spec))
            return
        first = handle.base // self.block_size
        if first >= len(spec.block_ids):  # a boundary on a stored block's end: only its state
            L, H = len(self._caches), self._caches[0].shape[1]
            empty = torch.empty((L, H, 0, self.store.layout.head_dim),
                                dtype=self.store.layout.torch_dtype)
            handle.layers(empty, empty)
            self._saves.append(_Save(spec, handle, None))
            return
        groups = None if spec.group_block_ids is None else \
            tuple(ids[first:] for ids in spec.group_block_ids)
        self._saves.append(_Save(spec, handle, self._pages(spec.block_ids[first:], groups)))

    def _sent_if_final(self, spec: SaveSpec) -> None:
        if spec.final:
            self._sent.add(spec.req_id)

    def wait_layer(self, name: str) -> None:
        """Before layer ``name`` attends: its loaded KV is in vLLM's blocks."""
        if not self._loads:
            return
        t0 = time.perf_counter()
        self._wait_upto(self._index[name] + 1)
        self.stats.add("load_seconds", time.perf_counter() - t0)

    def _wait_upto(self, layers: int) -> None:
        for load in list(self._loads):
            if load.handle is None:
                continue
            try:
                while load.loaded < layers:
                    load.handle.wait(load.loaded)
                    load.loaded += 1
            except STORE_ERRORS as e:
                self._loads.remove(load)
                load.handle.close()
                self._fail_load(load.spec, e)

    def save_layer(self, name: str) -> None:
        """After layer ``name`` attended: copy its new blocks into each save's write buffer
        (a hybrid model's sliding layers: their blocks go with the boundary state)."""
        layer = self._index.get(name)
        if layer is None:
            return
        for save in self._saves:
            self._copy_layer(save, layer)

    def _copy_layer(self, save: _Save, layer: int) -> None:
        if save.pages is not None:
            save.handle.layer_pages(layer, save.pages)  # the tokens from its base on
        save.given.add(layer)

    def end(self) -> None:
        """After the forward (or a step without one): finish the loads, hand the saves to the
        store's writer (layers the forward did not visit are copied now)."""
        if self._loads:
            self._wait_upto(len(self._caches))  # layers no attention waited for
            for load in self._loads:
                if load.handle is not None:
                    load.handle.close()
                self._report.loaded[load.spec.req_id] = load.tiers
                self.stats.add("loaded_tokens", load.spec.num_tokens)
            self._loads = []
        self._hand_over()
        while self._produce_later:  # the write buffer was full: wait for room now
            self._open_save(self._produce_later.pop(0), wait=True)
            self._hand_over()
        if self._produce:
            self._make_durable()

    def _hand_over(self) -> None:
        """Hand the open saves to the store's writer (layers not copied yet are copied now)."""
        for save in self._saves:
            for layer in range(len(self._caches)):
                if layer not in save.given:
                    self._copy_layer(save, layer)
            new = len(save.spec.tokens) - save.handle.base
            if save.spec.state is not None:
                assert self._state_pages is not None
                future = save.handle.finish(state=self._state_pages.gather(save.spec.state))
            else:
                future = save.handle.finish()
            future.add_done_callback(lambda f, spec=save.spec: self._written(spec, f))
            if save.spec.produce and save.spec.req_id in self._produce:
                self._produce[save.spec.req_id].append(future)
            self.stats.add("saves")
            self.stats.add("saved_tokens", new)
            self._sent_if_final(save.spec)
        self._saves = []

    def _make_durable(self) -> None:
        """Block until this step's producers' prompts are durable where a consumer looks:
        their saves written (and earlier saves of the store), then, with a shared tier,
        everything queued for its write-through sent (``Store.flush(remote=True)``). Each
        outcome goes to the scheduler side in the step's report."""
        t0 = time.perf_counter()
        produce, errors = self._produce, self._produce_errors
        self._produce, self._produce_errors = {}, {}
        for rid, futures in produce.items():
            for f in futures:
                try:
                    if f.result() is False:
                        errors.setdefault(rid, "the store's admission refused its save")
                except STORE_ERRORS as e:
                    errors.setdefault(rid, f"its save failed: {type(e).__name__}: {e}")
        if self.store is not None:
            why = self._flush() or self._writes_failed()
            for rid in produce if why else ():
                errors.setdefault(rid, why)
        wait_s = time.perf_counter() - t0
        self.stats.add("produce_wait_seconds", wait_s)
        for rid in produce:
            self._report.produced[rid] = {"error": errors.get(rid), "wait_s": round(wait_s, 4)}
            self.stats.add("produce_failures" if rid in errors else "produced")
            if rid in errors:
                log.warning("kvstore: request %s: its prompt's KV is not durable in %s, a "
                            "consumer recomputes it: %s", rid, self.durable, errors[rid])

    def _shared_write_failures(self) -> int:
        """Chunks the shared tiers' write-through could not send so far (their counters: a
        flush waits for the write-through but does not raise what failed)."""
        try:
            stats = self.store.stats()
        except STORE_ERRORS as e:  # a store that cannot report: none counted (never fatal)
            log.warning("kvstore: the store's stats could not be read: %s", e)
            return 0
        tiers = [stats.get(name) for name in ("remote", "objects")]  # each shared tier's
        return sum(int(t.get(k) or 0) for t in tiers if isinstance(t, dict)
                   for k in ("write_failed", "write_dropped", "write_errors"))

    def _writes_failed(self) -> str | None:
        """Why this step's prompts are not durable in the shared tier although the flush
        returned: chunks whose write-through failed since the last such check (any
        request's: a prompt is offered only when none did), or None."""
        if self.durable == "disk" or self._failed_writes is None:
            return None
        now = self._shared_write_failures()
        failed, self._failed_writes = now - self._failed_writes, now
        if failed <= 0:
            return None
        return f"{failed} chunk write(s) to the shared tier failed (not durable in {self.durable})"

    def _flush(self) -> str | None:
        """``Store.flush`` (with the shared tiers' write-through if ``durable`` is one); why
        it could not be waited for, or None. The error a flush raises is the first of any
        save since the last flush (this step's saves' own are in their futures): the wait is
        then made again, once."""
        remote = self.durable != "disk"
        for attempt in range(2):
            try:
                self.store.flush(remote=remote)
                return None
            except STORE_ERRORS as e:
                if attempt:
                    return f"the store's flush failed twice: {type(e).__name__}: {e}"
        return None

    def _written(self, spec: SaveSpec, future) -> None:
        """On the store's writer thread: a save is durable, refused or failed (a hybrid
        boundary's outcome goes to the scheduler side, which decides about the boundary it
        replaces)."""
        error = future.exception()
        durable = False
        if error is not None:
            log.warning("kvstore: saving request %s failed (its KV will be recomputed when "
                        "needed): %s: %s", spec.req_id, type(error).__name__, error)
            self._written_saves.append("save_failures")
        elif future.result() is False:
            self._written_saves.append("saves_refused")
        else:
            durable = True
            if spec.retain is not None:
                self._written_saves.append(self._retain(spec))
        if spec.state is not None:
            self._boundaries.append((spec.req_id, durable))

    def _retain(self, spec: SaveSpec) -> str:
        """Pin a stored save's context as its request's hint says; the counter to add."""
        outcome = retention.apply(self.store, list(spec.tokens), spec.namespace, spec.retain)
        return "pins" if outcome == "pinned" else "pins_refused"

    # ---- what vLLM collects after a step --------------------------------------------------
    def take_invalid(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def take_report(self) -> WorkerReport | None:
        report, self._report = self._report, WorkerReport()
        while self._boundaries:
            rid, durable = self._boundaries.popleft()
            report.stored[rid] = durable
        return report if (report.loaded or report.failed or report.stored
                          or report.produced) else None

    def take_sent(self) -> set[str]:
        out, self._sent = self._sent, set()
        return out

    def take_recving(self) -> tuple[set[str], set[str]]:
        """The hybrid loads done since the last call, and those of them that failed."""
        out = (self._recving, self._failed_recving)
        self._recving, self._failed_recving = set(), set()
        return out

    def take_stats(self) -> KVStoreConnectorStats | None:
        while self._written_saves:
            self.stats.add(self._written_saves.popleft())
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KVStoreConnectorStats()
        return out

    def close(self) -> None:
        """Cancel loads in flight (engine shutdown); saves already handed over are written
        by the store's close."""
        for load in self._loads:
            if load.handle is not None:
                load.handle.close()
        for save in self._saves:
            save.handle.abort()
        self._loads, self._saves, self._produce_later = [], [], []
