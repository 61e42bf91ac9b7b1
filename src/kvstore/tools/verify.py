"""Offline checks of a store directory: ``verify`` (checksums and invariants) and ``inspect``."""

from __future__ import annotations

import os
from collections import Counter
from contextlib import closing

import numpy as np

from kvstore.errors import CorruptData
from kvstore.format import chunk_extent
from kvstore.format.directory import Dir
from kvstore.format.hashing import chunk_hash
from kvstore.format.records import ChunkRecord, ContextRecord
from kvstore.store.facade import Store
from kvstore.store.opening import open_store
from kvstore.tiers.disk import SegmentFiles


class _StoredExtents:
    """The segment files of a store, opened again read-only by this tool (through
    :mod:`kvstore.format`): the stored bytes of chunks straight from disk, bypassing the DRAM
    tier. Safe beside an open store, of this process or another."""

    def __init__(self, store: Store) -> None:
        self.layout = store.layout
        self._root = Dir.open_root(store.path, create=False)
        try:
            self._segments = SegmentFiles(
                self._root, store.config.segment_geometry(store.layout), readonly=True)
        except BaseException:
            self._root.close()
            raise

    def read(self, rec: ChunkRecord) -> np.ndarray:
        """``rec``'s stored bytes, unverified and not decoded; :class:`CorruptData` if its
        record claims more than a slot or the file is too short."""
        size = chunk_extent.check_stored(rec, self.layout, self._segments.geo.slot_stride)
        buf = np.empty(size, dtype=np.uint8)
        self._segments.read(rec.slot, [buf])
        return buf

    def checksums(self, rec: ChunkRecord, stored: np.ndarray) -> np.ndarray:
        """Per-layer checksums of ``rec``'s stored bytes (as :meth:`read` returns them)."""
        return chunk_extent.checksums_of(self.layout, rec, stored)

    def file_bytes(self) -> int:
        """Apparent bytes of the segment files present."""
        return sum(self._segments.existing().values())

    def close(self) -> None:
        self._segments.close()
        self._root.close()


def _still_stored(store: Store, rec: ChunkRecord) -> bool:
    """Whether the store still holds ``rec`` at the same slot and generation (it caught up
    with every commit first): bytes failing their checksum under a chunk that is gone or moved
    were raced by another process that evicted it and reused its slot, not corrupted."""
    return any(r.key == rec.key and (r.slot, r.gen) == (rec.slot, rec.gen)
               for r in store.chunk_records())


def _invariant_errors(chunks: dict[bytes, ChunkRecord], contexts: list[ContextRecord],
                      chunk_tokens: int) -> tuple[list[str], set[bytes]]:
    """What the records break (slots claimed twice, contexts whose chunks are missing, out of
    order, not full inside, misaddressed or miscounted), and the chunks contexts hold."""
    errors: list[str] = []
    slots = Counter(r.slot for r in chunks.values())
    for slot, n in slots.items():
        if n > 1:
            errors.append(f"disk slot {slot} is claimed by {n} chunks")
    held: set[bytes] = set()
    for s in contexts:
        total = 0
        for i, key in enumerate(s.chunks):
            rec = chunks.get(key)
            if rec is None:
                errors.append(f"context {s.key.hex()} references missing chunk {key.hex()}")
                break
            if i > 0 and rec.parent != s.chunks[i - 1]:
                errors.append(f"context {s.key.hex()}: chunk {i} does not follow chunk {i - 1}")
            if i < len(s.chunks) - 1 and rec.n_tokens != chunk_tokens:
                errors.append(f"context {s.key.hex()}: inner chunk {i} is not full")
            if chunk_hash(rec.parent, rec.tokens) != key:
                errors.append(f"chunk {key.hex()}: address does not match its tokens")
            total += rec.n_tokens
            held.add(key)
        if total != s.n_tokens:
            errors.append(f"context {s.key.hex()}: {total} tokens in chunks, record says "
                          f"{s.n_tokens}")
        if s.chunks and s.chunks[-1] != s.key:
            errors.append(f"context {s.key.hex()} is not keyed by its last chunk")
    return errors, held


def _extent_errors(store: Store, chunks: dict[bytes, ChunkRecord]) -> tuple[list[str], int, int]:
    """Re-read every chunk's stored bytes from disk: (errors, chunks checked, corrupt ones).
    A chunk failing its checksum (or, coded, its decode) that the store no longer holds at that
    slot was raced, and is skipped."""
    errors: list[str] = []
    checked = bad = 0
    lay = store.layout
    with closing(_StoredExtents(store)) as disk:
        for rec in chunks.values():
            try:
                raw = disk.read(rec)
            except CorruptData as e:
                if _still_stored(store, rec):
                    errors.append(str(e))
                    bad += 1
                continue
            sums = disk.checksums(rec, raw)
            if not np.array_equal(sums, rec.checksums) and _still_stored(store, rec):
                layers = np.flatnonzero(sums != rec.checksums).tolist()
                errors.append(f"chunk {rec.key.hex()} (disk slot {rec.slot}) failed its "
                              f"checksum at layers {layers}")
                bad += 1
            elif rec.codec != 0:  # coded bytes must also decode
                try:
                    chunk_extent.decode_extent(lay, rec, raw, np.empty(
                        rec.n_tokens * lay.token_bytes, dtype=np.uint8))
                except CorruptData as e:
                    if _still_stored(store, rec):
                        errors.append(f"chunk {rec.key.hex()} (disk slot {rec.slot}): {e}")
                        bad += 1
            checked += 1
    return errors, checked, bad


def verify_store(store: Store) -> dict[str, object]:
    """Re-read every extent from disk and check its checksums and the catalog's invariants.

    Returns a report; ``report["ok"]`` is False if anything is wrong. Orphan chunks (held by a
    put in progress, or left by a process that died during one; collected by the survivors)
    are reported but are not corruption. Safe while other processes use the store: a chunk
    whose bytes fail their checksum because another process evicted it and reused its slot
    during the check is skipped, not reported. Reads the store through its public snapshots
    (records, problems, index checks) and its segment files, which it opens itself read-only.
    """
    errors: list[str] = list(store.problems)
    chunks = {r.key: r for r in store.chunk_records()}
    contexts = store.contexts()
    broken, held = _invariant_errors(chunks, contexts, store.config.chunk_tokens)
    errors += broken
    corrupt, checked, bad = _extent_errors(store, chunks)
    errors += corrupt
    orphans = [k for k in chunks if k not in held]
    bad_indexes = 0
    for key, problem in store.indexes.check().items():  # manifests and every file's checksums
        if problem is not None:
            errors.append(f"indexes of context {key.hex()}: {problem}")
            bad_indexes += 1
    return {
        "ok": not errors,
        "path": store.path,
        "chunks_checked": checked,
        "corrupt_chunks": bad,
        "contexts": len(contexts),
        "orphan_chunks": len(orphans),
        "indexed_contexts": len(store.indexes.dirs()),
        "corrupt_indexes": bad_indexes,
        "errors": errors,
    }


def verify_path(path: str | os.PathLike[str]) -> dict[str, object]:
    """Open ``path`` read-only and verify it."""
    with open_store(path, readonly=True) as store:
        return verify_store(store)


def inspect_path(path: str | os.PathLike[str]) -> dict[str, object]:
    """A JSON-able summary of a store: layout, config, contexts, chunks and bytes per tier."""
    with open_store(path, readonly=True) as store:
        st = store.stats()
        contexts = store.contexts()
        lengths = sorted(s.n_tokens for s in contexts)
        with closing(_StoredExtents(store)) as disk:
            seg_bytes = disk.file_bytes()
        return {
            "path": store.path,
            "layout": store.layout.to_dict(),
            "layout_fingerprint": store.layout.fingerprint.hex(),
            "config": store.config.to_dict(),
            "contexts": len(contexts),
            "context_tokens": {
                "total": sum(lengths),
                "min": lengths[0] if lengths else 0,
                "median": lengths[len(lengths) // 2] if lengths else 0,
                "max": lengths[-1] if lengths else 0,
            },
            "chunks": st["disk"]["chunks"],  # type: ignore[index]
            "tiers": {
                "dram": {"capacity_bytes": store.config.dram_bytes,
                         "note": "process memory: empty in a freshly opened store"},
                "disk": {
                    "capacity_bytes": store.config.disk_bytes,
                    # the KV the chunks hold (decoded), and what they take in their slots
                    "payload_bytes": st["disk"]["bytes"],  # type: ignore[index]
                    "stored_bytes": st["disk"]["stored_bytes"],  # type: ignore[index]
                    "slots_used": st["disk"]["chunks"],  # type: ignore[index]
                    "slots_total": st["disk"]["slots"],  # type: ignore[index]
                    "segment_file_bytes": seg_bytes,
                },
            },
            "problems": store.problems,
        }
