"""What of a store's records can be trusted: a pure plan, computed from the records alone.

Contexts are the durable truth: a context whose chain is incomplete (a chunk record missing or
unreadable) is dropped; one whose chunk lies beyond the disk budget (the budget shrank) is
evicted; one whose chunk lies in a missing or truncated segment file is dropped as corrupt.
Chunks that no kept context holds and no put in progress (of any process) holds are orphans.
The plan is applied at open by a writable store (:func:`apply`), and the same filter keeps a
read-only store, or a process reloading a catalog another process damaged, from serving what
the plan would drop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvstore.format.catalog import WriteTxn
from kvstore.format.records import ChunkRecord, ContextRecord


@dataclass(frozen=True, kw_only=True)
class RecoveryPlan:
    """What to keep (the records given to :func:`plan`; its very mappings where it keeps all
    of them) and what to drop."""

    keep_chunks: Mapping[bytes, ChunkRecord]
    keep_contexts: Mapping[bytes, ContextRecord]
    dropped: list[bytes] = field(default_factory=list)  # broken or corrupt contexts
    evicted: list[bytes] = field(default_factory=list)  # beyond a smaller disk budget
    orphans: list[bytes] = field(default_factory=list)  # chunks nothing holds
    bad_chunks: int = 0  # chunks in missing or truncated segment files
    problems: list[str] = field(default_factory=list)

    @property
    def dead_chunks(self) -> list[bytes]:
        """Chunk records to delete: every chunk no kept context holds (orphans included)."""
        if len(self.keep_chunks) == len(self.all_chunks):  # kept are among all: all kept
            return []
        return [k for k in self.all_chunks if k not in self.keep_chunks]

    all_chunks: tuple[bytes, ...] = ()


def plan(chunks: Mapping[bytes, ChunkRecord], contexts: Mapping[bytes, ContextRecord], *,
         total_slots: int, extent_end: Callable[[ChunkRecord], tuple[int, int]] | None = None,
         segment_sizes: Mapping[int, int] | None = None,
         held: frozenset[bytes] | set[bytes] = frozenset(),
         chunk_tokens: int | None = None) -> RecoveryPlan:
    """Decide what to keep. ``extent_end(rec)`` gives (segment, end offset) of a chunk's
    extent; with ``segment_sizes`` (segment -> file size, for the files present) chunks in
    missing or short files count as corrupt. ``held``: chunks puts in progress hold.
    ``chunk_tokens``: the store's chunk size (a chunk record claiming more is corrupt)."""
    problems: list[str] = []
    broken = set()
    for ctx in contexts.values():
        why = _broken(ctx, chunks, chunk_tokens)
        if why is not None:
            broken.add(ctx.key)
            problems.append(f"context {ctx.key.hex()} {why}: dropped")
    bad, lost = set(), set()
    for k, rec in chunks.items():
        if chunk_tokens is not None and rec.n_tokens > chunk_tokens:
            bad.add(k)
            problems.append(f"chunk {k.hex()} claims {rec.n_tokens} tokens, more than a chunk "
                            f"holds ({chunk_tokens})")
        elif rec.slot >= total_slots:
            lost.add(k)
            problems.append(f"chunk {k.hex()} lies in disk slot {rec.slot}, beyond the "
                            f"{total_slots} slots of the disk budget")
        elif segment_sizes is not None and extent_end is not None:
            seg, end = extent_end(rec)
            if segment_sizes.get(seg, -1) < end:
                bad.add(k)
                problems.append(f"chunk {k.hex()} lies in a missing or truncated segment file")
    dropped, evicted = [], []
    if broken or bad or lost:
        for ctx in contexts.values():
            if ctx.key in broken or any(c in bad for c in ctx.chunks):
                dropped.append(ctx.key)
            elif any(c in lost for c in ctx.chunks):
                evicted.append(ctx.key)
    gone = set(dropped) | set(evicted)
    # what is all kept is the mapping given, not a copy (a full load keeps a million)
    keep_contexts = {k: c for k, c in contexts.items() if k not in gone} if gone \
        else contexts
    live = {c for ctx in keep_contexts.values() for c in ctx.chunks}
    referenced = live if not broken and not gone else \
        {c for ctx in contexts.values() if ctx.key not in broken for c in ctx.chunks}
    # every kept context's chunks are among them: as many live keys as chunks means all live
    keep_chunks = chunks if len(live) == len(chunks) else \
        {k: r for k, r in chunks.items()
         if (k in live or (k in held and k not in lost and k not in bad))}
    orphans = [k for k in chunks if k not in referenced and k not in held]
    return RecoveryPlan(keep_chunks=keep_chunks, keep_contexts=keep_contexts, dropped=dropped,
                        evicted=evicted, orphans=orphans, bad_chunks=len(bad),
                        problems=problems, all_chunks=tuple(chunks))


def _broken(ctx: ContextRecord, chunks: Mapping[bytes, ChunkRecord],
            chunk_tokens: int | None) -> str | None:
    """Why a context cannot be served from these chunk records (None: it can)."""
    keys = ctx.chunks
    if not keys or keys[-1] != ctx.key:
        return "is malformed"
    full, last, total, prev = chunk_tokens, len(keys) - 1, 0, None
    for i, k in enumerate(keys):
        r = chunks.get(k)
        if r is None:
            return "references a missing chunk"
        if full is None:
            full = r.n_tokens
        if i and (r.parent != prev or r.n_tokens > full):
            return "has chunks that do not form one chain"
        if i < last and r.n_tokens != full:
            return "has an inner chunk that is not full"
        total += r.n_tokens
        prev = k
    if total != ctx.n_tokens:
        return "records a token count its chunks do not add up to"
    return None


def apply(p: RecoveryPlan, txn: WriteTxn) -> None:
    """Delete what the plan drops, in one transaction (with the pins of contexts it does not
    keep)."""
    for k in (*p.dropped, *p.evicted):
        txn.delete_context(k)
        txn.delete_index(k)
    for k in txn.pins():
        if k not in p.keep_contexts:
            txn.delete_pin(k)
    for k in p.dead_chunks:
        txn.delete_chunk(k)
