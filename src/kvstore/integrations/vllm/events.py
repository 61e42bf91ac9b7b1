"""The store's KV events through vLLM's own publisher: the connector's ``take_events()``.

With ``--kv-events-config`` (``KVEventsConfig(enable_kv_cache_events=True, ...)``), vLLM's
scheduler calls ``take_events()`` after every step and publishes what it returns in the same
``KVEventBatch`` as its own ``"GPU"`` events. The scheduler-side connector attaches an event
source to the store (:meth:`kvstore.Store.attach_event_source`) whose blocks are hashed by the
engine's own hash (:func:`~kvstore.integrations.vllm.compat.block_hasher`: its
``--prefix-caching-hash-algo``, its NONE_HASH), in its block size: the hashes a request's
``block_hashes`` hold and vLLM's own events carry, so a router matches them against its
prompts. A request's ``cache_salt`` is its blocks' extra key, as vLLM hashes it; chunks of a
namespace the connector would not serve (another base ``namespace``, a user of the store's
Python API) are not announced.

What it reports: this process's DRAM tier (``"CPU"``) and the directory's disk (``"STORAGE"``:
every engine on the directory can load it, so each announces it), and the shared tiers this
process writes through to (``"REDIS"``, ``"S3"``). The first events after startup announce
what the store holds (no ``AllBlocksCleared``: vLLM's own events of the engine's first step
come before them in the same batch, and a router honouring it would drop those). Hybrid models
are not announced (a hit needs a boundary, which blocks do not say).

Thread-safety: ``take`` from vLLM's scheduler thread; the store's tiers report from any.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kvstore.events.blocks import SKIP
from kvstore.integrations.surface import UnsupportedEngine
from kvstore.integrations.vllm import compat
from kvstore.store.facade import Store

log = logging.getLogger("vllm.kvstore")


def salt_keys(base: str | None):
    """The namespace -> extra keys rule of a connector whose base namespace is ``base``
    (:func:`kvstore.integrations.vllm.scheduler.request_namespace`'s inverse): ``base`` has
    none, ``[base, salt]`` has vLLM's ``cache_salt`` key, any other is not the connector's."""

    def extra_keys(namespace: str | None) -> tuple[Any, ...] | None:
        if namespace == base:
            return None
        try:
            got = json.loads(namespace) if namespace is not None else None
        except ValueError:
            return SKIP
        if isinstance(got, list) and len(got) == 2 and got[0] == base \
                and isinstance(got[1], str):
            return (("cache_salt", got[1]),)
        return SKIP

    return extra_keys


class ConnectorEvents:
    """The store's events for vLLM's publisher (see the module docstring)."""

    def __init__(self, store: Store, *, block_size: int, namespace: str | None,
                 hasher: compat.VllmBlockHasher) -> None:
        from vllm.distributed import kv_events

        self._store = store
        self._types = {name: getattr(kv_events, name)
                       for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared")}
        self._source = store.attach_event_source(hasher=hasher, block_size=block_size,
                                                 extra_keys_of=salt_keys(namespace))

    def take(self) -> list:
        """vLLM's events (its own classes) for what the store's tiers gained and lost since
        the last call; none if the store fails (logged)."""
        try:
            events = self._source.drain()
        except Exception as e:  # a catalog error: the next step tries again
            log.warning("kvstore: KV events of the store could not be read: %s: %s",
                        type(e).__name__, e)
            return []
        out = []
        for ev in events:
            cls = self._types[type(ev).__name__]
            out.append(cls(**{f: getattr(ev, f) for f in ev.__struct_fields__}))
        return out

    def stats(self) -> dict[str, object]:
        return self._source.stats()

    def close(self) -> None:
        self._store.detach_event_source(self._source)


def connector_events(vllm_config, store: Store | None, *, block_size: int,
                     namespace: str | None, hybrid: bool) -> ConnectorEvents | None:
    """The events of ``store`` for vLLM's publisher if vLLM publishes KV events, else None
    (also for a hybrid model, or a vLLM without the hashing surface: logged)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    if cfg is None or not cfg.enable_kv_cache_events or store is None:
        return None
    if hybrid:
        log.warning("kvstore: KV events of the store are not published for a hybrid model "
                    "(its hits need a stored boundary, which block events do not say)")
        return None
    if store.config.chunk_tokens % block_size:
        return None  # the connector serves nothing then (logged at startup)
    try:
        hasher = compat.block_hasher(vllm_config.cache_config)
    except UnsupportedEngine as e:
        log.error("kvstore: KV events of the store are not published: %s", e)
        return None
    log.info("kvstore: the store's KV events go out with vLLM's (media %s, block %d tokens)",
             "CPU/STORAGE/REDIS/S3", block_size)
    return ConnectorEvents(store, block_size=block_size, namespace=namespace, hasher=hasher)
