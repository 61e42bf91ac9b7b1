"""The worker's counters, reported through vLLM's KV-transfer metrics.

vLLM collects ``get_kv_connector_stats()`` from the worker every step, sums the intervals
(:meth:`KVStoreConnectorStats.aggregate`) and logs ``reduce()`` with its periodic stats
("KV Transfer metrics: ...") when stats logging is on.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = (
    "loads",  # layer-wise loads started
    "loaded_tokens",  # tokens filled into vLLM's blocks from the store
    "load_failures",  # loads that failed (miss, corrupt, IO): vLLM recomputes
    "load_seconds",  # time the forward waited for loaded layers (and packed them)
    "saves",  # saves handed to the store's writer
    "saved_tokens",  # new tokens those saves copied (a stored prefix is not copied again)
    "saves_already_stored",  # saves with nothing new to store
    "saves_refused",  # saves refused: write buffer full, store closing, eviction admission
    "save_failures",  # saves the store failed to write (disk full, IO error)
    "pins",  # saved contexts pinned by their request's retention hint
    "pins_refused",  # ... that the store refused to pin (over a cap, or not stored whole)
    "produced",  # producers' prompts made durable where a consumer looks (kv_role)
    "produce_failures",  # ... that could not be (a save refused or failed, a tier's wait)
    "produce_wait_seconds",  # time wait_for_save waited for them to be durable
)


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """Counters of one interval (``data``: name -> number)."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def add(self, name: str, amount: float = 1) -> None:
        assert name in COUNTERS, name
        self.data[name] += amount

    def reset(self) -> None:
        for name in COUNTERS:
            self.data[name] = 0

    def aggregate(self, other: KVConnectorStats) -> KVStoreConnectorStats:
        for name in COUNTERS:
            self.data[name] += other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {name: self.data[name] for name in COUNTERS}
        for name in ("load_seconds", "produce_wait_seconds"):
            out[name] = round(float(out[name]), 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in COUNTERS)
