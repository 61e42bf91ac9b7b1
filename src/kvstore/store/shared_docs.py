"""``store.shared_docs``: small documents (a conversation's state, say) kept in the remote tier
(Redis), where stores on other machines find them by name. Not KV: no chunk, no chain address,
no codec; untrusted bytes when read back."""

from __future__ import annotations

from kvstore.pipelines.shared.tiers import SharedTiers
from kvstore.residency.core import Core


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    return name


class SharedDocs:
    """The documents of the remote tier one open store reaches (``store.shared_docs``).

    Thread-safety: every method may be called from any thread; each is one call to the tier,
    bounded by its deadline.
    """

    def __init__(self, core: Core, shared: SharedTiers) -> None:
        # Private: the store builds its handle when it opens.
        self._core = core
        self._shared = shared

    def put(self, name: str, data: bytes) -> bool:
        """Store ``data`` under ``name`` in the remote tier, where stores on other machines
        find it. False if there is no remote tier or it did not answer (counted in stats).
        Thread-safe."""
        _check_name(name)
        if not isinstance(data, bytes):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        self._core.check_open()
        redis = self._shared.of_kind("remote")
        return redis is not None and redis.put_doc(name, data)

    def get(self, name: str) -> bytes | None:
        """The document stored under ``name`` by :meth:`put` (by any store on this Redis), or
        None. Untrusted bytes: validate before use. Thread-safe."""
        _check_name(name)
        self._core.check_open()
        redis = self._shared.of_kind("remote")
        return None if redis is None else redis.get_doc(name)
