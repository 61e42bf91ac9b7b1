"""The store's counters: typed fields, so a misspelt counter is an AttributeError, not a silent 0.

Counters are this process's view (each process of a shared store counts its own work). They are
updated under the store's metadata lock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Counters:
    dram_hits: int = 0  # chunks served from this process's DRAM tier
    disk_hits: int = 0  # chunks read from disk
    get_misses: int = 0  # gets of tokens not (all) stored
    read_races: int = 0  # reads that lost a race with another process reusing a slot
    gets: int = 0
    served_tokens: int = 0
    match_calls: int = 0
    matched_tokens: int = 0
    put_tokens: int = 0
    put_chunks_written: int = 0
    put_chunks_deduplicated: int = 0  # written, but another process committed them first
    evicted_contexts: int = 0
    evicted_chunks: int = 0
    evicted_in_window: int = 0
    bypassed_puts: int = 0  # puts the policy's admission refused (nothing written or evicted)
    kept_back_contexts: int = 0  # victims a size-aware eviction put back (the rest freed enough)
    prefetched_chunks: int = 0
    corrupt_chunks: int = 0
    dropped_contexts: int = 0
    malformed_records: int = 0  # catalog records that could not be decoded (deleted at open)
    collected_orphans: int = 0
    reclaimed_reservations: int = 0  # of processes that died with a put in progress
    indexes_built: int = 0
    rebuilt_index_heads: int = 0
    corrupt_indexes: int = 0
    unavailable_indexes: int = 0
    collected_indexes: int = 0
    catch_ups: int = 0  # times this process applied other processes' commits
    full_reloads: int = 0  # ... by reloading every record
    lossy_gets: int = 0  # gets and layer-wise loads that served chunks stored through a lossy codec
    lossy_tokens_served: int = 0  # tokens they served from such chunks
    coded_chunks_written: int = 0  # chunks written through the disk codec
    raw_fallback_chunks: int = 0  # chunks the disk codec could not take, written raw
