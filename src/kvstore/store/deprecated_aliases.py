"""The names ``Store`` had before its calls beside the data path moved to handles
(``store.retention``, ``store.indexes``, ``store.shared_docs``, ``store.debug``): each forwards
to the handle and answers what it answers. Kept for callers of the old names (DESIGN's public
API contract names ``store.pin``, ``store.unpin`` and ``store.delete``); they warn nothing.
``store.indexes(tokens)``, the old method, is the handle's ``__call__``
(:class:`kvstore.store.index_api.Indexes`); ``load_layers(pages=...)`` forwards to
``Store.load_into_pages`` in the facade itself.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvstore.eviction.policies import EvictionPolicy
from kvstore.format.disk_throttle import ReadThrottle
from kvstore.format.records import PinRecord
from kvstore.index.spec import IndexSpec
from kvstore.residency.retention import ContextInfo
from kvstore.store.debug_hooks import DebugHooks
from kvstore.store.index_api import Indexes
from kvstore.store.retention_api import Retention
from kvstore.store.shared_docs import SharedDocs


class DeprecatedAliases:
    """The old names of :class:`kvstore.store.facade.Store`'s handle calls (a base of
    ``Store``). Thread-safety: each as the call it forwards to."""

    retention: Retention
    indexes: Indexes
    shared_docs: SharedDocs
    debug: DebugHooks

    # ------------------------------------------------------------------ retention
    def pin(self, tokens: object, namespace: str | None = None,
            ttl_s: float | None = None) -> PinRecord:
        """Deprecated: use ``store.retention.pin`` (same arguments and answer). Thread-safe."""
        return self.retention.pin(tokens, namespace, ttl_s)

    def unpin(self, tokens: object, namespace: str | None = None) -> bool:
        """Deprecated: use ``store.retention.unpin``. Thread-safe."""
        return self.retention.unpin(tokens, namespace)

    def pins(self) -> list[PinRecord]:
        """Deprecated: use ``store.retention.pins``. Thread-safe."""
        return self.retention.pins()

    def list_contexts(self, *namespaces: str | None) -> list[ContextInfo]:
        """Deprecated: use ``store.retention.list_contexts``. Thread-safe."""
        return self.retention.list_contexts(*namespaces)

    def context_tokens(self, key: bytes) -> np.ndarray:
        """Deprecated: use ``store.retention.context_tokens``. Thread-safe."""
        return self.retention.context_tokens(key)

    def delete(self, tokens: object = None, namespace: str | None = None) -> bool | int:
        """Deprecated: use ``store.retention.delete`` (same arguments and answer). Thread-safe."""
        return self.retention.delete(tokens, namespace)

    # ------------------------------------------------------------------ indexes
    def build_indexes(self, tokens: object, spec: IndexSpec, *,
                      namespace: str | None = None) -> bool:
        """Deprecated: use ``store.indexes.build``. Thread-safe."""
        return self.indexes.build(tokens, spec, namespace=namespace)

    def index_dirs(self) -> dict[bytes, str]:
        """Deprecated: use ``store.indexes.dirs``. Thread-safe."""
        return self.indexes.dirs()

    def check_indexes(self) -> dict[bytes, str | None]:
        """Deprecated: use ``store.indexes.check``. Thread-safe."""
        return self.indexes.check()

    # ------------------------------------------------------------------ documents
    def put_shared_doc(self, name: str, data: bytes) -> bool:
        """Deprecated: use ``store.shared_docs.put``. Thread-safe."""
        return self.shared_docs.put(name, data)

    def shared_doc(self, name: str) -> bytes | None:
        """Deprecated: use ``store.shared_docs.get``. Thread-safe."""
        return self.shared_docs.get(name)

    # ------------------------------------------------------------------ hooks
    @property
    def wall_clock(self) -> Callable[[], float]:
        """Deprecated: use ``store.debug.wall_clock`` (set it before other threads use the
        store)."""
        return self.debug.wall_clock

    @wall_clock.setter
    def wall_clock(self, clock: Callable[[], float]) -> None:
        self.debug.wall_clock = clock

    @property
    def policy(self) -> EvictionPolicy:
        """Deprecated: use ``store.debug.policy``. Thread-safe to read."""
        return self.debug.policy

    def throttle_disk_reads(self, throttle: ReadThrottle | None) -> None:
        """Deprecated: use ``store.debug.throttle_disk_reads``. Thread-safe."""
        self.debug.throttle_disk_reads(throttle)

    def drop_caches(self) -> None:
        """Deprecated: use ``store.debug.drop_caches``. Thread-safe."""
        self.debug.drop_caches()
