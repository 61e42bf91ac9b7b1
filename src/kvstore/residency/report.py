"""What ``Store.stats()`` reports: one dictionary assembled from the counters and state of the
store's parts (:meth:`kvstore.residency.core.Core.stats` calls it with the metadata lock held).
The parts above the residency (the look-ahead's queue, the saver, the indexes, the remote
link) are passed in; each reads only its own state and the residency's, under that lock."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvstore.codecs import layer_codec
from kvstore.tiers.exec_buffers import HbmTier

Core = Any  # kvstore.residency.core.Core, which calls this module (not imported: no cycle)


def assemble_stats(core: Core, *, tiers: Iterable[HbmTier], hints: Any, saver: Any,
                   shared: dict[str, dict[str, object]], exclusive: bool) -> dict[str, object]:
    """The stats of one open store; ``core.mutex`` is held by the caller. ``hints``: the
    look-ahead (its queue and windows), ``saver``: the asynchronous saver, ``shared``: each
    shared tier's stats by its name (``remote`` is None without one)."""
    cnt, config = core.counters, core.config
    return {
        **_tiers(core, list(tiers)),
        "hits": {"dram": cnt.dram_hits, "disk": cnt.disk_hits},
        "codecs": _codecs(core),
        "misses": cnt.get_misses,
        "evictions": {
            "dram_chunks": core.dram.evictions,
            "disk_contexts": cnt.evicted_contexts,
            "disk_chunks": cnt.evicted_chunks,
            "kept_back_contexts": cnt.kept_back_contexts,
            "bypassed_puts": cnt.bypassed_puts,
            "policy": hints.policy.name,
            "return_prediction": hints.return_prediction(),
        },
        "queue": {
            "jobs": len(hints.jobs),
            "running": len(hints.running),
            "prefetch_window": hints.windows.prefetch,
            "eviction_window": hints.windows.eviction,
            "prefetched_chunks": cnt.prefetched_chunks,
            "evicted_in_window": cnt.evicted_in_window,
        },
        "saves": {
            "write_buffer_bytes": config.write_buffer_bytes,
            "write_buffer_used": saver.used_bytes,
            "saved": saver.saved,
            "failed": saver.failed,
        },
        "indexes": _indexes(core),
        "remote": None,  # without a Redis tier
        **shared,
        "corrupt": {
            "chunks": cnt.corrupt_chunks,
            "dropped_contexts": cnt.dropped_contexts,
            "malformed_records": cnt.malformed_records,
            "collected_orphans": cnt.collected_orphans,
        },
        "sharing": {
            "exclusive": exclusive,
            "generation": core.mirror.seen_gen,
            "catch_ups": cnt.catch_ups,
            "full_reloads": cnt.full_reloads,
            "read_races": cnt.read_races,
            "reclaimed_reservations": cnt.reclaimed_reservations,
            "deduplicated_chunks": cnt.put_chunks_deduplicated,
        },
        "requests": {
            "puts_tokens": cnt.put_tokens,
            "chunks_written": cnt.put_chunks_written,
            "gets": cnt.gets,
            "served_tokens": cnt.served_tokens,
            "matches": cnt.match_calls,
            "matched_tokens": cnt.matched_tokens,
        },
    }


def _tiers(core: Core, tiers: list[HbmTier]) -> dict[str, object]:
    """What each tier holds and can hold."""
    tree, config = core.tree, core.config
    return {
        "hbm": {
            "capacity_bytes": config.hbm_bytes,
            "bytes": sum(t.used_bytes for t in tiers),
            "idle_bytes": sum(t.idle_bytes for t in tiers),
            "devices": sorted(str(t.device) for t in tiers),
            "dram_pinned": bool(core.dram.pinned),  # DRAM page-locked for copies to the GPU
            "dram_pin_failure": core.dram.pin_failure,
        },
        "dram": {
            "capacity_bytes": config.dram_bytes,
            "bytes": core.dram.bytes_used,
            "chunks": len(core.dram),
            "slots": core.dram.num_slots,
            "slot_bytes": core.dram.slot_stride,
            "codec": config.codecs["dram"],  # chunks kept as stored (coded), or decoded
        },
        "disk": {
            "capacity_bytes": config.disk_bytes,
            "bytes": sum(core.raw_bytes(r.n_tokens) for r in tree.chunks.values()),
            "stored_bytes": sum(r.stored_bytes(r.n_tokens * core.layout.layer_token_bytes)
                                for r in tree.chunks.values()),
            "slot_bytes": len(tree.chunks) * core.geo.slot_stride,
            "chunks": len(tree.chunks),
            "slots": core.geo.total_slots,
            "contexts": len(tree.contexts),
            "tokens": sum(s.n_tokens for s in tree.contexts.values()),
        },
    }


def _codecs(core: Core) -> dict[str, object]:
    """The codecs configured, the chunks stored through each, and what they served."""
    cnt, tree, config = core.counters, core.tree, core.config
    return {
        "config": dict(config.codecs),
        "chunks": {name: sum(1 for r in tree.chunks.values()
                             if layer_codec.NAMES[r.codec] == name)
                   for name in layer_codec.NAMES},
        "coded_chunks_written": cnt.coded_chunks_written,
        "raw_fallback_chunks": cnt.raw_fallback_chunks,
        "lossy_gets": cnt.lossy_gets,
        "lossy_tokens_served": cnt.lossy_tokens_served,
    }


def _indexes(core: Core) -> dict[str, int]:
    """The per-head indexes stored, and what this process did with them."""
    c, tree = core.counters, core.tree
    return {"contexts": len(tree.indexed),
            "bytes": sum(e.nbytes for e in tree.indexed.values()),
            "built": c.indexes_built, "rebuilt_heads": c.rebuilt_index_heads,
            "corrupt": c.corrupt_indexes, "unavailable": c.unavailable_indexes,
            "collected": c.collected_indexes}
