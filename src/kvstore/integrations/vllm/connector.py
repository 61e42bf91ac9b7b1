"""``KVStoreConnector``: vLLM's v1 KV connector API over a kvstore directory.

vLLM creates the connector twice: once in the EngineCore process for its scheduler
(:class:`~kvstore.integrations.vllm.scheduler.SchedulerSide`) and once in each worker
(:class:`~kvstore.integrations.vllm.worker.WorkerSide`); without multiprocessing both live in
one process and share one open store (:mod:`kvstore.integrations.shared`). Turn it on with::

    from vllm.config import KVTransferConfig
    KVTransferConfig(kv_connector="KVStoreConnector",
                     kv_connector_module_path="kvstore.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"store_dir": DIR})

(the other keys: :class:`~kvstore.integrations.vllm.config.ConnectorConfig`). A store that
cannot be opened (damaged, unreadable) leaves the connector inert: logged at startup, every
lookup a miss, vLLM serves as without it. A configuration the connector cannot serve exactly
(a GPU, tensor parallelism, quantized KV, an unknown block packing) is refused at startup, as
is a vLLM without the private surface the connector still needs (:mod:`.compat`).

``kv_load_failure_policy`` (vLLM's, in ``KVTransferConfig``): a load that fails (an evicted or
damaged chunk) is a cache miss to the connector, so it wants ``"recompute"``. vLLM's config does
not record whether a field was given, and its default is ``"fail"``: the connector fills
``"recompute"`` where the policy is vLLM's default, keeps any other value the user gave, and
keeps ``"fail"`` where ``kv_connector_extra_config["kv_load_failure_policy"]`` says so (a failed
load then fails its request). It logs what it chose.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvstore.errors import KVStoreError, LayoutMismatch
from kvstore.integrations import shared
from kvstore.integrations.vllm import compat
from kvstore.integrations.vllm import groups as kv_groups
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.events import ConnectorEvents, connector_events
from kvstore.integrations.vllm.identity import vllm_layout
from kvstore.integrations.vllm.plan import StepPlan, WorkerReport
from kvstore.integrations.vllm.roles import Exchange, durable_tier, role_of
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.stats import KVStoreConnectorStats
from kvstore.integrations.vllm.worker import WorkerSide

log = logging.getLogger("vllm.kvstore")


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector backed by :func:`kvstore.open`: loads the blocks the store holds
    beyond vLLM's own prefix cache, layer by layer, and saves every new full block
    asynchronously, and a request's last partial block when it ends. With a hybrid model
    (vLLM's hybrid KV-cache manager: sliding-window and recurrent groups, :mod:`.groups`) it
    serves every group: boundaries only, loaded whole and asynchronously. Thread-safety: as
    vLLM calls it (its scheduler thread, its forward thread)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        compat.check()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kv_role = role
        transfer = vllm_config.kv_transfer_config
        cfg = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        role = role_of(transfer)  # kv_producer, kv_consumer, kv_both (:mod:`.roles`)
        durable = durable_tier(cfg.remote, cfg.objects)
        groups = None if kv_cache_config is None else kv_groups.of(kv_cache_config)
        self._hybrid = groups is not None and groups.hybrid
        block_size = groups.block_size if self._hybrid else vllm_config.cache_config.block_size
        layout, isa = vllm_layout(vllm_config, model_id=cfg.model_id,
                                  groups=groups if self._hybrid else None)
        load_failure_policy(transfer, cfg.kv_load_failure_policy)
        self._cache_manager = None  # vLLM's KVCacheManager (scheduler role), once bound
        self._plan: StepPlan | None = None  # this step's plan (worker role), while bound
        self._lease = _open_store(cfg, layout, block_size, fill=role.saves)
        store = None if self._lease is None else self._lease.store
        if store is not None and store.config.chunk_tokens % block_size:
            log.error("kvstore: store_dir %s has chunk_tokens=%d, not a multiple of vLLM's "
                      "block size %d (the connector moves whole blocks), so the connector "
                      "serves nothing", cfg.store_dir, store.config.chunk_tokens, block_size)
            self._lease.close()
            self._lease, store = None, None
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._events: ConnectorEvents | None = None  # the store's, for take_events()
        if kv_role == KVConnectorRole.SCHEDULER:
            exchange = Exchange(role=role, durable=durable, engine_id=transfer.engine_id,
                                deadline_s=cfg.wait_deadline_s)
            self._scheduler = SchedulerSide(store, block_size=block_size,
                                            namespace=cfg.namespace,
                                            save=cfg.save and role.saves,
                                            block_ids_of=self._block_ids, groups=groups,
                                            lossy_ok=cfg.lossy_ok,
                                            grace_s=cfg.boundary_grace_s,
                                            grace_bytes=cfg.boundary_grace_bytes,
                                            exchange=exchange)
            _register_scheduler(transfer.engine_id, self)
            self._events = connector_events(vllm_config, store, block_size=block_size,
                                            namespace=cfg.namespace, hybrid=self._hybrid)
            if cfg.lossy_ok:
                log.warning("kvstore: lossy_ok: KV stored through a lossy codec (%s) is served: "
                            "answers may differ from vLLM's own; each request's "
                            "kv_transfer_params['kvstore']['lossy_tokens'] counts it",
                            dict(cfg.codecs or {}) or "by other processes of the store")
        else:
            self._worker = WorkerSide(store, block_size=block_size,
                                      buffer_layers=cfg.buffer_layers, groups=groups,
                                      durable=durable)
        log.info("kvstore: %s connector (%s) on %s (%s; block %d tokens, packing %s)%s",
                 kv_role.name.lower(), role.name, cfg.store_dir, layout.engine, block_size, isa,
                 "" if store is not None else ": the store could not be opened, every "
                 "lookup is a miss")

    @property
    def store(self):
        """The :class:`kvstore.Store` this connector serves (None if it could not be
        opened); in one process both roles share it."""
        return None if self._lease is None else self._lease.store

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss

    # ==== scheduler side =====================================================================
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        """vLLM hands the scheduler's ``KVCacheManager`` over once it is built."""
        super().bind_kv_cache_manager(kv_cache_manager)
        self._cache_manager = kv_cache_manager

    def _block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per KV-cache group (every group)."""
        assert self._cache_manager is not None
        return tuple(self._cache_manager.get_block_ids(req_id))

    def pending_saves(self) -> bool:
        """Whether final saves are planned or in flight whose blocks vLLM still holds (the
        engine must step to hand them to the store). Scheduler role."""
        return self._scheduler is not None and self._scheduler.pending()

    def on_new_request(self, request) -> None:
        """vLLM added ``request`` (a remote prefill's wait counts from now)."""
        if self._scheduler is not None:
            self._scheduler.exchange.arrived(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._scheduler.plan(scheduler_output.num_scheduled_tokens,
                                    scheduler_output.scheduled_spec_decode_tokens)

    def update_connector_output(self, connector_output) -> None:
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, WorkerReport):
            self._scheduler.reported(report)
        self._scheduler.sent(connector_output.finished_sending or ())

    def request_finished(self, request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, tuple(block_ids))

    # ==== worker side ========================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, StepPlan)
            self._plan = connector_metadata
            self._worker.begin(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._plan = None

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        assert self._plan is not None, "start_load_kv before bind_connector_metadata"
        self._worker.start_loads(self._plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.end()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        recving, _ = self._worker.take_recving()
        return self._worker.take_sent() or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Final saves copied, hybrid loads done, and those that failed (vLLM recomputes them
        whole: with several KV-cache groups, failures are reported per request)."""
        recving, failed = self._worker.take_recving()
        return KVConnectorTransferResults(finished_sending=self._worker.take_sent(),
                                          finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_invalid()

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        # vLLM asks both roles; the counters are the worker's.
        return None if self._worker is None else self._worker.take_stats()

    def build_connector_worker_meta(self) -> WorkerReport | None:
        return self._worker.take_report()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVStoreConnectorStats:
        return KVStoreConnectorStats(data=dict(data or {}))

    def take_events(self):
        """The store's KV events since the last call (:mod:`.events`), which vLLM publishes
        with its own: BlockStored / BlockRemoved of its DRAM, disk and shared tiers, in vLLM's
        block hashes. Scheduler role; nothing without ``--kv-events-config``."""
        return self._events.take() if self._events is not None else ()

    def shutdown(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
        if self._lease is not None:
            self._lease.close()
            self._lease = None


def load_failure_policy(transfer, wanted: str | None) -> str:
    """The ``kv_load_failure_policy`` the engine runs with, set on ``transfer`` (vLLM's
    ``KVTransferConfig``, which vLLM's scheduler reads after creating the connector) only
    where the user left vLLM's default: ``wanted`` (the extra config's
    ``kv_load_failure_policy``) if given, else ``"recompute"`` (a failed load is a cache
    miss). A policy the user gave is kept; ValueError if it contradicts ``wanted``. Logged."""
    default = next(f.default for f in dataclasses.fields(type(transfer))
                   if f.name == "kv_load_failure_policy")
    given = transfer.kv_load_failure_policy
    if given != default:  # the user's own: kept
        if wanted is not None and wanted != given:
            raise ValueError(f"kv_connector_extra_config['kv_load_failure_policy'] is "
                             f"{wanted!r} but KVTransferConfig.kv_load_failure_policy is "
                             f"{given!r}; set one of them")
        policy, how = given, "as configured"
    elif wanted is not None:
        policy, how = wanted, "kv_connector_extra_config['kv_load_failure_policy']"
    else:
        policy, how = "recompute", (f"vLLM's default {default!r} filled in: a failed load is "
                                    f"a cache miss")
    if policy != given:
        transfer.kv_load_failure_policy = policy
    if policy == "recompute":
        log.info("kvstore: kv_load_failure_policy=%r (%s)", policy, how)
    else:
        log.warning("kvstore: kv_load_failure_policy=%r (%s): a load from the store that "
                    "fails (an evicted or damaged chunk) fails its request instead of being "
                    "recomputed", policy, how)
    return policy


# In-process engines' scheduler-role connectors, by KVTransferConfig.engine_id (an offline
# LLM's engine core in this process: :mod:`.offline` drives its final saves).
_schedulers: dict[str, weakref.ref] = {}
_schedulers_lock = threading.Lock()


def _register_scheduler(engine_id: str | None, conn: KVStoreConnector) -> None:
    if engine_id is not None:
        with _schedulers_lock:
            _schedulers[engine_id] = weakref.ref(conn)


def scheduler_connector(engine_id: str | None) -> KVStoreConnector | None:
    """The scheduler-role connector of the engine ``engine_id`` if it runs in this process
    (and is still alive), else None."""
    with _schedulers_lock:
        ref = _schedulers.get(engine_id) if engine_id is not None else None
    return None if ref is None else ref()


def _open_store(cfg: ConnectorConfig, layout, block_size: int, *, fill: bool
                ) -> shared.Lease | None:
    """A lease on the store, or None if it cannot be opened (one line logged, naming
    ``store_dir`` and why): the connector then serves nothing, as llama.cpp's cache does; a
    cache problem never takes the server down. ``fill=False`` (a consumer): what the shared
    tiers serve is not stored in the directory."""
    try:
        return shared.acquire(cfg.store_dir, layout=layout,
                              **cfg.open_options(block_size=block_size, fill=fill))
    except LayoutMismatch as e:
        log.error("kvstore: store_dir %s holds KV of another model or engine setup, so the "
                  "connector serves nothing (use another store_dir for this one): %s",
                  cfg.store_dir, str(e).split("(stored vs asked: ", 1)[-1].rstrip(")"))
        return None
    except (KVStoreError, OSError) as e:
        log.error("kvstore: cannot open store_dir %s, so the connector serves nothing: %s: %s",
                  cfg.store_dir, type(e).__name__, e)
        return None
