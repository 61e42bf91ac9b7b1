"""A store's KV events: event sources fed by its tiers' reports, and its own publisher.

:func:`attach_source` gives an engine integration (vLLM's connector, whose ``take_events``
hands the events to vLLM's own publisher) a source hashing blocks its way;
:func:`start_publisher` makes the store publish them itself on ZMQ (``kvstore.open(...,
events=...)``, ``kvstore serve --kv-events``), one process per store directory. See
docs/store.md, "KV events". Imported only when events are asked for (it needs msgspec, and
the publisher pyzmq).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from kvstore.events.config import EventsConfig, check_media
from kvstore.events.hashing import BlockHasher, CborBlockHasher, namespace_extra_keys
from kvstore.events.publisher import ZmqPublisher, lock_publisher
from kvstore.events.source import EventSource
from kvstore.residency.core import Core


def attach_source(core: Core, *, hasher: BlockHasher, block_size: int,
                  extra_keys_of: Callable[[str | None], tuple[Any, ...] | None],
                  media: Mapping[str, str] | None = None, max_queue_size: int = 100_000,
                  wake: Callable[[], None] | None = None) -> EventSource:
    """A source of the store's KV events (:class:`~kvstore.events.source.EventSource`), fed
    by its tiers from now on; its first drain announces what the store holds. ValueError if
    ``block_size`` does not divide the store's ``chunk_tokens``."""
    source = EventSource(
        catalog=core.catalog, media=check_media(media or {}), hasher=hasher,
        block_size=block_size, chunk_tokens=core.config.chunk_tokens, seed_of=core.seed,
        extra_keys_of=extra_keys_of, dram_now=core.dram_ready,
        max_queue_size=max_queue_size, wake=wake)
    core.hooks.attach(source)
    return source


def start_publisher(core: Core, cfg: EventsConfig) -> ZmqPublisher:
    """The store's own publisher of ``cfg`` (:class:`~kvstore.events.publisher.ZmqPublisher`),
    started: :class:`~kvstore.errors.StoreLocked` if another process publishes this store's
    events, OSError if an endpoint cannot be opened."""
    if core.readonly:
        raise ValueError("events: a store opened read-only cannot publish KV events (the "
                         "publisher takes the directory's publisher lock, a file it creates)")
    cfg.check_store(core.config.chunk_tokens)
    fd = lock_publisher(core.root)
    publisher: ZmqPublisher | None = None
    source: EventSource | None = None
    try:
        holder: list[ZmqPublisher] = []
        source = attach_source(core, hasher=CborBlockHasher(cfg.hash_seed,
                                                            int_hashes=cfg.int_hashes),
                               block_size=cfg.block_size, extra_keys_of=namespace_extra_keys,
                               media=cfg.media, max_queue_size=cfg.max_queue_size,
                               wake=lambda: holder[0].wake() if holder else None)
        publisher = ZmqPublisher(cfg, source, fd)
        holder.append(publisher)
        publisher.start()
    except BaseException:
        if source is not None:
            core.hooks.detach(source)
        if publisher is not None:
            publisher.close()
        else:
            os.close(fd)
        raise
    return publisher
