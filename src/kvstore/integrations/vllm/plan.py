"""What passes between the connector's two roles each engine step.

The scheduler side sends a :class:`StepPlan` (vLLM's ``KVConnectorMetadata``) to the worker:
which blocks to fill from the store before the forward, and which requests' full blocks to save
after it. The worker answers with a :class:`WorkerReport` (vLLM's
``KVConnectorWorkerMetadata``): what each load delivered. Both are plain picklable records:
vLLM ships them between processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvstore.integrations.retention import Hint
from kvstore.integrations.vllm.hybrid import StatePlan


@dataclass(frozen=True, kw_only=True)
class LoadSpec:
    """Fill positions [start, len(tokens)) of a request from the store: block
    ``block_ids[i]`` receives positions start + i*B .. start + (i+1)*B - 1 (the last block
    whole, where ``tokens`` end inside it: vLLM computes the rest of it)."""

    req_id: str
    tokens: tuple[int, ...]  # the stored prefix the load reads (its chain address)
    start: int  # a multiple of the block size: vLLM computed (or cached) what is before
    block_ids: tuple[int, ...]
    namespace: str | None
    # Several KV-cache groups (SupportsHMA): each full-attention group's blocks (block_ids
    # are the first's); a hybrid model's boundary state's blocks.
    group_block_ids: tuple[tuple[int, ...], ...] | None = None
    state: StatePlan | None = None
    # Whole and asynchronous (a hybrid model's, or several groups'): vLLM schedules the
    # request once the worker reports it done or failed (per request, not per block).
    whole: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) - self.start


@dataclass(frozen=True, kw_only=True)
class SaveSpec:
    """Save the KV of ``tokens`` (whole blocks; a final save's tail filled up with the
    scheduler's ``PAD``) from the request's blocks ``block_ids`` (one per block of
    ``tokens``, in order). The store writes only what it does not hold yet.
    ``final``: the request has finished; vLLM frees its blocks once the worker reports it."""

    req_id: str
    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]
    namespace: str | None
    final: bool = False
    group_block_ids: tuple[tuple[int, ...], ...] | None = None  # as LoadSpec's
    state: StatePlan | None = None  # a hybrid prompt's end: its boundary state too
    # a final save's (or a hybrid boundary's) retention hint: pin ``tokens`` once stored
    retain: Hint | None = None
    # a producer's save of a request's whole prompt (:mod:`.roles`): never dropped for a
    # full write buffer (it waits, after the step's other saves are handed over)
    produce: bool = False


@dataclass(kw_only=True)
class StepPlan(KVConnectorMetadata):
    """The connector's work in one engine step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # requests whose prompt ends in this step and whose KV a consumer will look for: the
    # step's wait_for_save returns once it is durable where the consumer looks (:mod:`.roles`)
    produce: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class WorkerReport(KVConnectorWorkerMetadata):
    """Per request: the tokens a load delivered, by the tier that held them when it started
    (``{"dram": n, "disk": n, "remote": n}``), the requests whose load failed (vLLM
    recomputes their blocks), and what became of hybrid boundary saves since the last report
    (``stored``: True once durable, False if refused or failed; the scheduler side then
    decides about the boundary each replaces, :mod:`.boundaries`), and of producers' prompts
    (``produced``: ``{"error": None or why it is not durable, "wait_s": seconds the step
    waited for it}``)."""

    loaded: dict[str, dict[str, int]] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    stored: dict[str, bool] = field(default_factory=dict)
    produced: dict[str, dict] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> WorkerReport:
        assert isinstance(other, WorkerReport)
        return WorkerReport(loaded={**self.loaded, **other.loaded},
                            failed=self.failed | other.failed,
                            stored={**self.stored, **other.stored},
                            produced={**self.produced, **other.produced})
