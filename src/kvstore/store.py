"""The store: prefix-addressed, refcounted chunks of KV over a DRAM tier and a disk tier.

Durability and crash safety come from one write order: a chunk's extent is written into a slot no
committed record references, fsynced, and only then does a catalog transaction make it visible.
Freed slots are reused only after the transaction that freed them has committed. Sessions (one
per put) are the durable truth; chunk refcounts are derived from them at open, and chunks no
session references (left by a crash between an eviction and a put) are collected then.
"""

from __future__ import annotations

import heapq
import os
import shutil
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from threading import Condition, RLock

import numpy as np
import torch
import xxhash

from kvstore.catalog import FORMAT_VERSION, Catalog, ChunkRecord, SessionRecord
from kvstore.dram import DramTier
from kvstore.errors import (
    CapacityError,
    CorruptData,
    FormatError,
    KVStoreError,
    LayoutMismatch,
    StoreClosed,
)
from kvstore.hashing import as_tokens, chain_seed, chunk_hash, common_prefix_len
from kvstore.hbm import HbmTier
from kvstore.index.context import (
    ContextIndexes,
    directory_bytes,
    positioned_keys,
    publish,
    read_context_indexes,
)
from kvstore.index.spec import IndexSpec, build_index
from kvstore.layerwise import LayerLoad
from kvstore.layout import KVLayout
from kvstore.lock import DirLock
from kvstore.policy import AccessStats, Priority, PriorityHeap, Queued, make_policy
from kvstore.saving import SaveHandle, Saver
from kvstore.schedule import Job, Prefetcher, Windows, as_jobs
from kvstore.segments import SegmentFiles, SegmentGeometry

DEFAULT_DRAM_BYTES = 1 << 30  # 1 GiB
DEFAULT_DISK_BYTES = 16 << 30  # 16 GiB
DEFAULT_CHUNK_TOKENS = 256
DEFAULT_WRITE_BUFFER_BYTES = 256 << 20  # 256 MiB
DEFAULT_HBM_BYTES = 1 << 30  # 1 GiB


class _KeysUnavailable(Exception):
    """A context's keys could not be read to rebuild one of its index files."""


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Sizes and policy of a store; persisted at creation, sizes replaceable on reopen."""

    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    dram_bytes: int = DEFAULT_DRAM_BYTES
    disk_bytes: int = DEFAULT_DISK_BYTES
    hbm_bytes: int = DEFAULT_HBM_BYTES
    write_buffer_bytes: int = DEFAULT_WRITE_BUFFER_BYTES
    policy: str = "scheduler"

    def __post_init__(self) -> None:
        for name in ("chunk_tokens", "dram_bytes", "disk_bytes", "hbm_bytes",
                     "write_buffer_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | np.integer):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            low = 1 if name == "chunk_tokens" else 0
            if v < low:
                raise ValueError(f"{name} must be >= {low}, got {v}")
        make_policy(self.policy)

    def to_dict(self) -> dict[str, object]:
        return {"chunk_tokens": self.chunk_tokens, "dram_bytes": self.dram_bytes,
                "disk_bytes": self.disk_bytes, "hbm_bytes": self.hbm_bytes,
                "write_buffer_bytes": self.write_buffer_bytes, "policy": self.policy}


@dataclass(slots=True, kw_only=True)
class _PutPlan:
    """A put between planning and commit: its new chunks, the slots taken for them, the DRAM
    slots staging them, and the reused prefix chunks it holds."""

    toks: np.ndarray
    namespace: str | None
    now: int
    parts: list[np.ndarray]
    chain: list[bytes]
    specs: list[tuple[bytes, bytes, int]]  # (key, parent, chunk index) of each new chunk
    slots: list[int]
    held: list[bytes]
    staged: dict[bytes, torch.Tensor]
    records: list[ChunkRecord] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Piece:
    """``use`` leading tokens of chunk ``rec`` placed at token offset ``start`` of a request."""

    rec: ChunkRecord
    start: int
    use: int


_INT_VIEW = {2: torch.int16, 4: torch.int32}


def _raw(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a same-shape numpy integer view of its bytes (works for bf16 too)."""
    return t.view(_INT_VIEW[t.element_size()]).numpy()


def _checksums(extent: np.ndarray, num_layers: int) -> np.ndarray:
    """xxh3_64 of each layer's bytes of a contiguous extent ([num_layers * layer_bytes] uint8)."""
    per = len(extent) // num_layers
    return np.fromiter(
        (xxhash.xxh3_64_intdigest(extent[i * per : (i + 1) * per]) for i in range(num_layers)),
        dtype=np.uint64, count=num_layers,
    )


def _piece_checksums(pieces: list[np.ndarray], num_layers: int) -> np.ndarray:
    """The same checksums as :func:`_checksums`, streamed over an extent given as pieces in
    extent order (each layer's pieces are consecutive and equally many)."""
    per = len(pieces) // num_layers
    out = np.empty(num_layers, dtype=np.uint64)
    for layer in range(num_layers):
        h = xxhash.xxh3_64()
        for p in pieces[layer * per : (layer + 1) * per]:
            h.update(p)
        out[layer] = h.intdigest()
    return out


def _extent_pieces(k: np.ndarray, v: np.ndarray, t0: int, n: int) -> list[np.ndarray]:
    """Contiguous pieces of tokens [t0, t0+n) of raw K/V views [L, H, T, D], in extent order:
    for each layer, K of every head, then V of every head."""
    L, H = k.shape[0], k.shape[1]
    out = []
    for layer in range(L):
        out += [k[layer, h, t0 : t0 + n] for h in range(H)]  # each [n, D], contiguous
        out += [v[layer, h, t0 : t0 + n] for h in range(H)]
    return out


class _CudaCopy:
    """Host-to-device copies of a layer-wise load: each layer is read into pinned host memory,
    then copied on a side stream; the layer's event tells compute when it has arrived."""

    def __init__(self, k_dev: torch.Tensor, v_dev: torch.Tensor) -> None:
        self.k_dev, self.v_dev = k_dev, v_dev  # [L, H, T, D] on the GPU
        self.host_k = torch.empty(k_dev.shape, dtype=k_dev.dtype, pin_memory=True)
        self.host_v = torch.empty(v_dev.shape, dtype=v_dev.dtype, pin_memory=True)
        self.stream = torch.cuda.Stream(device=k_dev.device)

    def layer(self, layer: int) -> torch.cuda.Event:
        with torch.cuda.stream(self.stream):
            self.k_dev[layer].copy_(self.host_k[layer], non_blocking=True)
            self.v_dev[layer].copy_(self.host_v[layer], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev


class Store:
    """An open store directory. Use :func:`kvstore.open`; close with :meth:`close` or ``with``.

    Thread-safety: every public method is safe to call from several threads; they are
    serialized by one lock per store. Two processes cannot open one store for writing at once
    (:class:`~kvstore.errors.StoreLocked`).
    """

    def __init__(self, path: str, *, layout: KVLayout, config: StoreConfig, catalog: Catalog,
                 lock: DirLock, readonly: bool) -> None:
        # Private: open() builds a Store only once catalog, lock and config are settled.
        self.path = path
        self.layout = layout
        self.config = config
        self.readonly = readonly
        self._catalog = catalog
        self._lock_file = lock
        self._mutex = RLock()
        self._closed = False
        self._policy = make_policy(config.policy)
        self._chunk_bytes = layout.chunk_bytes(config.chunk_tokens)
        self._geo = SegmentGeometry.for_budget(slot_bytes=self._chunk_bytes,
                                               disk_bytes=config.disk_bytes)
        self._segments = SegmentFiles(os.path.join(path, "segments"), self._geo,
                                      readonly=readonly)
        self._dram = DramTier(capacity_bytes=config.dram_bytes, slot_bytes=self._chunk_bytes,
                              policy=self._policy)
        self._clock = int(catalog.get_meta("clock") or 0)
        self._chunks: dict[bytes, ChunkRecord] = {}
        self._children: dict[bytes, set[bytes]] = defaultdict(set)
        self._sessions: dict[bytes, SessionRecord] = {}
        self._holders: dict[bytes, set[bytes]] = defaultdict(set)  # chunk -> sessions holding it
        self._session_heap = PriorityHeap()
        self._free_slots: list[int] = []
        self._dirty_access: set[bytes] = set()
        self.problems: list[str] = []  # integrity problems found at open (read-only mode)
        self._counters: dict[str, int] = defaultdict(int)
        self._io: ThreadPoolExecutor | None = None  # one IO worker, started on first use
        self._pins: dict[int, int] = defaultdict(int)  # disk slot -> layer-wise loads reading it
        self._deferred_free: set[int] = set()  # freed while pinned: reusable once unpinned
        self._loads: set[LayerLoad] = set()
        self._hbm_tiers: dict[str, HbmTier] = {}
        self._failed: BaseException | None = None  # a commit failed ambiguously: no more writes
        self._closing = False
        self._cond = Condition(self._mutex)  # signals the end of unlocked writes
        self._writers = 0  # puts writing extents without the lock
        self._inflight: set[bytes] = set()  # chunk keys being written by a put
        self._held: dict[bytes, int] = defaultdict(int)  # chunk -> puts/saves that need it
        self._corrupt: set[bytes] = set()  # failed a checksum, kept only while held
        # Per-head indexes of stored contexts: session key -> bytes of its index directory.
        self._index_root = os.path.join(path, "indexes")
        self._indexed: dict[bytes, int] = {}
        # Scheduler hints (AttentionStore §3.3): the job queue and where chunks/sessions are
        # next needed in it.
        self._jobs: list[Job] = []
        self._running: list[Job] = []
        self._queue_dirty = False
        self._windows = Windows(prefetch=0, eviction=0)
        self._job_pieces: list[list[_Piece]] = []
        self._chunk_pos: dict[bytes, int] = {}
        self._session_pos: dict[bytes, int] = {}
        self._prefetcher = Prefetcher(self._prefetch_step)  # its thread starts on first use
        self._saver = Saver(  # asynchronous saving; its thread starts on the first save
            capacity_bytes=config.write_buffer_bytes,
            write=lambda toks, k, v, ns, base: self._write(toks, _raw(k), _raw(v), ns, base),
            release=self._release_locked)

    def _io_pool(self) -> ThreadPoolExecutor:
        """Two IO workers: disk reads/writes (two at a time: queue depth 2) overlap checksums
        and DRAM copies on the caller's thread. Used only while the store lock is held."""
        if self._io is None:
            self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstore-io")
        return self._io

    # ------------------------------------------------------------------ loading
    def _load(self) -> None:
        chunks, sessions = self._catalog.load()
        problems: list[str] = []
        # Sessions are the truth: a session whose chain is incomplete is dropped.
        broken = [s.key for s in sessions.values() if any(c not in chunks for c in s.chunks)]
        for k in broken:
            problems.append(f"session {k.hex()} references a missing chunk")
        referenced = {c for s in sessions.values() if s.key not in broken for c in s.chunks}
        orphans = [k for k in chunks if k not in referenced]
        # Slots outside the current budget, or in missing/short segment files, are lost.
        present = self._segments.existing()
        bad_chunks: set[bytes] = set()
        lost_slots: set[bytes] = set()
        for k, rec in chunks.items():
            if k not in referenced:
                continue
            seg, off = self._geo.locate(rec.slot)
            if rec.slot >= self._geo.total_slots:
                lost_slots.add(k)
            elif present.get(seg, -1) < off + rec.n_tokens * self.layout.token_bytes:
                bad_chunks.add(k)
                problems.append(f"chunk {k.hex()} lies in a missing or truncated segment file")
        drop = set(broken)
        shrunk = set()  # contexts beyond a smaller disk budget: evicted, not corrupt
        for s in sessions.values():
            if any(c in bad_chunks for c in s.chunks):
                drop.add(s.key)
            elif any(c in lost_slots for c in s.chunks):
                shrunk.add(s.key)
        drop |= shrunk
        if self.readonly:
            self.problems = problems
            keep_sessions = {k: s for k, s in sessions.items() if k not in drop}
        else:
            keep_sessions = {k: s for k, s in sessions.items() if k not in drop}
            live = {c for s in keep_sessions.values() for c in s.chunks}
            dead = [k for k in chunks if k not in live]
            if drop or dead:
                with self._catalog.write() as txn:
                    for k in drop:
                        txn.delete_session(k)
                    for k in dead:
                        txn.delete_chunk(k)
            self._counters["corrupt_chunks"] += len(bad_chunks)
            self._counters["dropped_sessions"] += len(drop - shrunk)
            self._counters["evicted_sessions"] += len(shrunk)
            self._counters["collected_orphans"] += len(orphans)
            # Segment files are created lazily on first write; existing ones of the wrong size
            # (truncated, or the budget changed) are resized now; files beyond the budget go.
            for seg, size in present.items():
                if seg >= self._geo.num_segments:
                    self._segments.remove(seg)
                elif size == self._geo.segment_size(seg):
                    self._segments.mark_ready(seg)
                else:
                    self._segments.prepare(seg)
        for s in keep_sessions.values():
            for c in s.chunks:
                if c not in self._chunks:
                    rec = chunks[c]
                    self._chunks[c] = rec
                    self._children[rec.parent].add(c)
                self._holders[c].add(s.key)
            self._sessions[s.key] = s
            self._session_heap.push(s.key, self._session_priority(s))
        used = {rec.slot for rec in self._chunks.values()}
        self._free_slots = [s for s in range(self._geo.total_slots) if s not in used]
        heapq.heapify(self._free_slots)
        self._load_indexes()

    def _load_indexes(self) -> None:
        """Index directories of live contexts; in a writable store, staged leftovers and the
        indexes of contexts that are gone (a crash between a commit and the removal) go."""
        if not os.path.isdir(self._index_root):
            return
        for name in sorted(os.listdir(self._index_root)):
            full = os.path.join(self._index_root, name)
            try:
                key = bytes.fromhex(name)
            except ValueError:
                key = b""
            live = key in self._sessions and os.path.isdir(full) and not os.path.islink(full)
            if live and not self.readonly:  # a head rewrite a crash interrupted
                for f in os.listdir(full):
                    if ".tmp-" in f:
                        os.unlink(os.path.join(full, f))
            if live:
                self._indexed[key] = directory_bytes(full)
            elif not self.readonly:
                if os.path.isdir(full) and not os.path.islink(full):
                    shutil.rmtree(full, ignore_errors=True)
                else:
                    os.unlink(full)
                self._counters["collected_indexes"] += 1

    # ------------------------------------------------------------------ helpers
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"store {self.path!r} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.readonly:
            raise PermissionError(f"store {self.path!r} was opened read-only")
        if self._failed is not None:
            raise KVStoreError(f"a catalog commit of {self.path!r} failed ({self._failed!r}); "
                               f"close and reopen the store before writing again")

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _queued(self, pos: int | None) -> Queued | None:
        if pos is None:
            return None
        return Queued(position=pos, in_window=pos < self._windows.eviction)

    def _chunk_queued(self, key: bytes) -> Queued | None:
        return self._queued(self._chunk_pos.get(key))

    def _session_priority(self, s: SessionRecord) -> Priority:
        return self._policy.priority(AccessStats(inserted=s.created, last_access=s.last_access),
                                     self._queued(self._session_pos.get(s.key)))

    def _extent_bytes(self, n_tokens: int) -> int:
        return n_tokens * self.layout.token_bytes

    def _extent_view(self, slot: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """A slot's first extent bytes viewed as [L, 2 (K/V), H, n, D] in the layout dtype."""
        lay = self.layout
        nbytes = self._extent_bytes(n_tokens)
        return slot[:nbytes].view(lay.torch_dtype).view(
            lay.num_layers, 2, lay.num_kv_heads, n_tokens, lay.head_dim)

    def _extent_np(self, slot: torch.Tensor, n_tokens: int) -> np.ndarray:
        """:meth:`_extent_view` as a raw numpy integer view [L, 2, H, n, D]."""
        return _raw(self._extent_view(slot, n_tokens))

    def _check_kv(self, name: str, t: object, n_tokens: int) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != self.layout.torch_dtype:
            raise TypeError(
                f"{name} must have dtype {self.layout.torch_dtype} (the layout's "
                f"{self.layout.dtype!r}), got {t.dtype}"
            )
        want = self.layout.kv_shape(n_tokens)
        if tuple(t.shape) != want:
            raise ValueError(
                f"{name} must have shape [num_layers, num_kv_heads, T, head_dim] = {list(want)} "
                f"for {n_tokens} tokens, got {list(t.shape)}"
            )
        return t

    def _split(self, toks: np.ndarray) -> list[np.ndarray]:
        c = self.config.chunk_tokens
        return [toks[i : i + c] for i in range(0, len(toks), c)]

    def _resolve(self, toks: np.ndarray, namespace: str | None) -> list[_Piece]:
        """The longest stored prefix of ``toks``, as pieces of stored chunks."""
        c = self.config.chunk_tokens
        parent = chain_seed(self.layout.fingerprint, namespace)
        pieces: list[_Piece] = []
        pos = 0
        while len(toks) - pos >= c:
            part = toks[pos : pos + c]
            rec = self._chunks.get(chunk_hash(parent, part))
            if (rec is None or rec.n_tokens != c or rec.key in self._corrupt
                    or not np.array_equal(rec.tokens, part)):
                break
            pieces.append(_Piece(rec, pos, c))
            parent = rec.key
            pos += c
        rest = toks[pos : pos + c]
        if len(rest):
            best, best_len = None, 0
            for child in self._children.get(parent, ()):
                rec = self._chunks[child]
                if child in self._corrupt:
                    continue
                n = common_prefix_len(rec.tokens, rest)
                if n > best_len:
                    best, best_len = rec, n
            if best is not None:
                pieces.append(_Piece(best, pos, best_len))
        return pieces

    def _resolve_all(self, toks: np.ndarray, namespace: str | None) -> list[_Piece]:
        """Pieces serving every token of ``toks``; KeyError (counted as a miss) otherwise."""
        pieces = self._resolve(toks, namespace)
        served = sum(p.use for p in pieces)
        if served < len(toks):
            self._counters["get_misses"] += 1
            raise KeyError(f"only {served} of the {len(toks)} tokens are stored")
        return pieces

    def _check_out(self, out: object, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate an ``out=(keys, values)`` pair for ``n_tokens`` tokens."""
        if not isinstance(out, tuple | list) or len(out) != 2:
            raise TypeError("out must be a (keys, values) pair of tensors")
        k_out = self._check_kv("out[0]", out[0], n_tokens)
        v_out = self._check_kv("out[1]", out[1], n_tokens)
        if k_out.device != v_out.device:
            raise ValueError(f"out tensors must be on one device, got {k_out.device} and "
                             f"{v_out.device}")
        return k_out, v_out

    # ------------------------------------------------------------------ chunk IO
    def _load_chunk(self, rec: ChunkRecord) -> torch.Tensor:
        """The chunk's slot in DRAM, reading and verifying it from disk on a DRAM miss."""
        slot = self._dram.lookup(rec.key, self._tick())
        if slot is not None:
            self._counters["dram_hits"] += 1
            return slot
        self._counters["disk_hits"] += 1
        return self._fetch_chunk(rec)

    def _fetch_chunk(self, rec: ChunkRecord) -> torch.Tensor:
        """Read and verify a chunk from disk into a new DRAM slot."""
        slot = self._dram.insert(rec.key, self._extent_bytes(rec.n_tokens), self._clock,
                                 self._chunk_queued(rec.key))
        try:
            buf = slot[: self._extent_bytes(rec.n_tokens)].numpy()
            self._segments.read(rec.slot, [buf])
            self._verify(rec, _checksums(buf, self.layout.num_layers))
        except CorruptData as e:
            self._dram.discard(rec.key)
            self._quarantine(rec.key, e)
            raise
        except BaseException:
            self._dram.discard(rec.key)
            raise
        return slot

    def _copy_out(self, slot: torch.Tensor, p: _Piece, k_out: torch.Tensor,
                  v_out: torch.Tensor) -> None:
        """Copy the ``p.use`` leading tokens of a chunk held in ``slot`` into the output."""
        a, b = p.start, p.start + p.use
        if k_out.device.type == "cpu":
            ext = self._extent_np(slot, p.rec.n_tokens)  # [L, 2, H, n, D]
            np.copyto(_raw(k_out)[:, :, a:b], ext[:, 0, :, : p.use])  # [L, H, use, D]
            np.copyto(_raw(v_out)[:, :, a:b], ext[:, 1, :, : p.use])
        else:
            ext = self._extent_view(slot, p.rec.n_tokens)
            k_out[:, :, a:b].copy_(ext[:, 0, :, : p.use])
            v_out[:, :, a:b].copy_(ext[:, 1, :, : p.use])

    def _read_misses(self, misses: list[_Piece], k_out: torch.Tensor,
                     v_out: torch.Tensor) -> None:
        """Read chunks from disk into the output and the DRAM tier, verifying each layer.

        Whole chunks bound for a contiguous CPU output are read by the IO worker straight into
        the output, in jobs of whole layers (~1 MiB, one ``preadv`` each), while this thread
        verifies the previous job's layers and copies them into the chunk's DRAM slot, so only
        the last job's CPU work is not hidden behind the disk. Other pieces go through a DRAM
        slot (:meth:`_load_chunk`).
        """
        lay = self.layout
        direct = (k_out.device.type == "cpu" and k_out.is_contiguous()
                  and v_out.is_contiguous())
        kr, vr = (_raw(k_out), _raw(v_out)) if direct else (None, None)
        now_direct = [p for p in misses if direct and p.use == p.rec.n_tokens]
        staged = [p for p in misses if not (direct and p.use == p.rec.n_tokens)]
        pool = self._io_pool()
        per_layer = 2 * lay.num_kv_heads  # pieces per layer in an extent
        jobs = []  # (piece, first layer, last layer + 1, pieces, future)
        for p in now_direct:
            pieces = _extent_pieces(kr, vr, p.start, p.use)
            lbytes = p.rec.n_tokens * lay.layer_token_bytes
            step = max(1, (1 << 20) // lbytes)
            for l0 in range(0, lay.num_layers, step):
                l1 = min(l0 + step, lay.num_layers)
                part = pieces[l0 * per_layer : l1 * per_layer]
                fut = pool.submit(self._segments.read, p.rec.slot, part, l0 * lbytes)
                jobs.append((p, l0, l1, part, fut))
        ext = None
        try:
            for p, l0, l1, part, fut in jobs:
                fut.result()
                self._verify(p.rec, _piece_checksums(part, l1 - l0), l0)
                n, a = p.rec.n_tokens, p.start
                if l0 == 0:
                    self._counters["disk_hits"] += 1
                    ext = None
                    if self._dram.num_slots:
                        ext = self._extent_np(
                            self._dram.insert(p.rec.key, self._extent_bytes(n), self._clock,
                                              self._chunk_queued(p.rec.key)), n)
                if ext is not None:
                    np.copyto(ext[l0:l1, 0], kr[l0:l1, :, a : a + n])  # [l1-l0, H, n, D]
                    np.copyto(ext[l0:l1, 1], vr[l0:l1, :, a : a + n])
        except BaseException as e:
            for job in jobs:
                job[-1].cancel()
            wait([job[-1] for job in jobs])
            self._dram.discard(p.rec.key)  # its slot may be partly filled
            if isinstance(e, CorruptData):
                self._quarantine(p.rec.key, e)
            raise
        for p in staged:
            self._copy_out(self._load_chunk(p.rec), p, k_out, v_out)

    @staticmethod
    def _verify(rec: ChunkRecord, sums: np.ndarray, first_layer: int = 0) -> None:
        """Compare checksums of layers first_layer.. of ``rec`` with the stored ones."""
        want = rec.checksums[first_layer : first_layer + len(sums)]
        if not np.array_equal(sums, want):
            bad = first_layer + int(np.flatnonzero(sums != want)[0])
            raise CorruptData(
                f"chunk {rec.key.hex()} (disk slot {rec.slot}) failed its checksum at layer {bad}"
            )

    def _quarantine(self, key: bytes, err: CorruptData) -> None:
        """Drop every session holding a corrupt chunk, so the store stops claiming it."""
        self._counters["corrupt_chunks"] += 1
        self._corrupt.add(key)  # never served again (a put or save may still hold it)
        if self.readonly:
            return
        victims = sorted(self._holders.get(key, ()))
        self._counters["dropped_sessions"] += len(victims)
        self._drop_sessions(victims)
        err.add_note(f"dropped {len(victims)} stored context(s) that included this chunk")

    def _drop_sessions(self, keys: list[bytes]) -> int:
        """Delete sessions durably; free chunks no remaining session (or put) holds.

        Returns the number of chunks freed. Slots become reusable only after the commit.
        """
        if not keys:
            return 0
        freed = self._freed_by(keys, frozenset())
        with self._catalog.write() as txn:
            for k in keys:
                txn.delete_session(k)
            for c in freed:
                txn.delete_chunk(c)
        self._unlink_sessions(keys, freed)
        return len(freed)

    def _freed_by(self, keys: list[bytes], keep: frozenset[bytes] | set[bytes]) -> list[bytes]:
        """Chunks no session would hold once sessions ``keys`` are gone (except ``keep`` and
        chunks a put or save in progress holds)."""
        dec: dict[bytes, int] = defaultdict(int)
        for k in keys:
            for c in self._sessions[k].chunks:
                dec[c] += 1
        return [c for c, d in dec.items()
                if len(self._holders[c]) == d and c not in keep and c not in self._held]

    def _unlink_sessions(self, keys: list[bytes], freed: list[bytes]) -> None:
        """Apply a committed removal of sessions ``keys`` and chunks ``freed`` to memory."""
        for k in keys:
            s = self._sessions.pop(k)
            self._session_heap.remove(k)
            self._dirty_access.discard(k)
            for c in s.chunks:
                self._holders[c].discard(k)
            if self._indexed.pop(k, None) is not None:  # the context's indexes go with it
                shutil.rmtree(self._index_path(k), ignore_errors=True)
        for c in freed:
            self._forget_chunk(c)
        if self._jobs:
            self._queue_dirty = True

    def _forget_chunk(self, c: bytes) -> None:
        self._corrupt.discard(c)
        rec = self._chunks.pop(c)
        self._holders.pop(c, None)
        kids = self._children.get(rec.parent)
        if kids is not None:
            kids.discard(c)
            if not kids:
                del self._children[rec.parent]
        self._dram.discard(c)
        if self._pins.get(rec.slot):
            self._deferred_free.add(rec.slot)  # a layer-wise load still reads it
        else:
            heapq.heappush(self._free_slots, rec.slot)

    def _collect_orphans(self, candidates: frozenset[bytes]) -> None:
        """Durably delete chunks among ``candidates`` that no session holds any more."""
        dead = [c for c in candidates
                if c in self._chunks and not self._holders.get(c) and c not in self._held]
        if dead:
            with self._catalog.write() as txn:
                for c in dead:
                    txn.delete_chunk(c)
            for c in dead:
                self._forget_chunk(c)

    def _make_room(self, need: int) -> None:
        """Evict whole sessions (least valuable first) until ``need`` slots are free.

        With a queue-aware policy, sessions inside the look-ahead eviction window are exempt
        while any other session can leave; when only they remain, the one at the window's tail
        leaves (a put is not refused because of hints)."""
        if len(self._free_slots) < need:
            self._refresh_queue()
            reclaimable = len(self._free_slots) + sum(
                1 for c, r in self._chunks.items()
                if c not in self._held and not self._pins.get(r.slot))
            if reclaimable < need:  # refuse before evicting anything
                raise CapacityError(
                    f"need {need} free disk slots but at most {reclaimable} can be freed now "
                    f"(the rest hold chunks that puts, saves or layer-wise loads in progress use)")
        while len(self._free_slots) < need:
            victim = self._session_heap.peek()
            if victim is None:
                raise CapacityError(
                    f"need {need} free disk slots but only {len(self._free_slots)} can be freed"
                )
            if self._policy.exempt(self._queued(self._session_pos.get(victim))):
                self._counters["evicted_in_window"] += 1
            self._counters["evicted_sessions"] += 1
            self._counters["evicted_chunks"] += self._drop_sessions([victim])
            if len(self._free_slots) < need and not self._sessions:
                raise CapacityError(
                    f"need {need} free disk slots, store holds only {self._geo.total_slots}"
                )

    # ------------------------------------------------------------------ public API
    def put(self, tokens: object, keys: torch.Tensor, values: torch.Tensor, *,
            namespace: str | None = None, index: IndexSpec | None = None) -> None:
        """Store the KV of ``tokens``; durable when it returns.

        ``keys``/``values``: [num_layers, num_kv_heads, T, head_dim] in the layout dtype, keys
        without rotary encoding. Chunks already stored (a shared prefix) are not written again.
        A stored context that is a strict prefix of ``tokens`` is superseded (its KV stays
        servable through this one, but its indexes go with it). With ``index``, per-head
        indexes of that spec are built over the context's keys (RoPE at 0..T-1) and stored
        with it (see :meth:`build_indexes`). Thread-safe; the store lock is not held while the
        extents are written and synced or the indexes built, so gets and other puts proceed.
        """
        toks = as_tokens(tokens)
        keys = self._check_kv("keys", keys, len(toks))
        values = self._check_kv("values", values, len(toks))
        if index is not None:
            self._check_index_spec(index, "index")
        kr = _raw(keys.detach().to("cpu").contiguous())  # [L, H, T, D]
        vr = _raw(values.detach().to("cpu").contiguous())  # [L, H, T, D]
        self._write(toks, kr, vr, namespace)
        if index is not None:
            self._attach_indexes(toks, namespace, keys, index)

    # ------------------------------------------------------------------ per-head indexes
    def _index_path(self, key: bytes) -> str:
        return os.path.join(self._index_root, key.hex())

    def _exact_session(self, toks: np.ndarray, namespace: str | None) -> SessionRecord | None:
        """The stored context of exactly ``toks`` (under the lock)."""
        pieces = self._resolve(toks, namespace)
        if not pieces or sum(p.use for p in pieces) != len(toks):
            return None
        s = self._sessions.get(pieces[-1].rec.key)
        return s if s is not None and s.n_tokens == len(toks) else None

    def _check_index_spec(self, spec: object, name: str) -> None:
        """Refuse a spec that cannot be built over this layout's keys, before anything is
        written."""
        if not isinstance(spec, IndexSpec):
            raise TypeError(f"{name} must be a kvstore.index.IndexSpec, got "
                            f"{type(spec).__name__}")
        if spec.kind == "pq" and self.layout.head_dim % spec.pq_subspaces:
            raise ValueError(f"{name}.pq_subspaces ({spec.pq_subspaces}) must divide the "
                             f"layout's head_dim ({self.layout.head_dim})")
        if spec.kind == "graph":
            import hnswlib  # noqa: F401  (ImportError now, not after the KV is stored)

    def _attach_indexes(self, toks: np.ndarray, namespace: str | None, keys: torch.Tensor,
                        spec: IndexSpec) -> bool:
        """Build indexes over ``keys`` (pre-RoPE [L, H, T, D]) without the lock, stage their
        files, then publish them under the context's session key if it is still stored.
        Nothing is built when no context of exactly ``toks`` is stored (they are served
        through a longer context, whose indexes :meth:`indexes` then offers)."""
        with self._mutex:
            self._check_writable()
            if self._exact_session(toks, namespace) is None:
                return False
        built = ContextIndexes.build(positioned_keys(keys, self.layout), spec)
        tmp, nbytes = built.stage(self._index_root)
        try:
            with self._mutex:
                self._check_writable()
                s = self._exact_session(toks, namespace)
                if s is None:  # evicted (or superseded) while the indexes were built
                    return False
                publish(tmp, self._index_path(s.key))
                self._indexed[s.key] = nbytes
                self._counters["indexes_built"] += 1
                return True
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)

    def build_indexes(self, tokens: object, spec: IndexSpec, *,
                      namespace: str | None = None) -> bool:
        """Build and store per-(layer, kv-head) indexes for the stored context of exactly
        ``tokens`` (late materialization, AlayaDB §7.2: a context is indexed once it is
        stored). Keys are indexed with RoPE at positions 0..T-1. The files live in the store
        directory under the context, checksummed, and are removed when the context is (delete,
        eviction, a longer put that supersedes it). Existing indexes are replaced. Returns
        False if no context of exactly these tokens is stored (or it left meanwhile).
        Thread-safe; the build runs without the store lock."""
        self._check_index_spec(spec, "spec")
        toks = as_tokens(tokens)
        with self._mutex:
            self._check_writable()
            if self._exact_session(toks, namespace) is None:
                return False
        try:
            keys, _ = self.get(toks, namespace=namespace)  # [L, H, T, D] pre-RoPE
        except KeyError:  # evicted since the check
            return False
        return self._attach_indexes(toks, namespace, keys, spec)

    def indexes(self, tokens: object, *, namespace: str | None = None
                ) -> ContextIndexes | None:
        """The stored indexes covering ``tokens``: those of the stored context of exactly these
        tokens, or of a longer stored context that starts with them (query it with
        ``limit=len(tokens)``, the prefix filter). None if no such context has indexes.

        Every file is checked: a head whose file is corrupt or missing is rebuilt from the
        stored keys (and rewritten, in a writable store; counted in ``stats()["indexes"]``);
        if the manifest itself is bad, the context's indexes are dropped and counted as
        corrupt, and None is returned; if the stored keys cannot be read for a rebuild (a
        corrupt chunk), None is returned too. Thread-safe: files are read and heads rebuilt
        without the store lock.
        """
        toks = as_tokens(tokens)
        with self._mutex:
            self._check_open()
            pieces = self._resolve(toks, namespace)
            if not pieces or sum(p.use for p in pieces) != len(toks):
                return None
            last = pieces[-1]
            ends = [last.rec.key]
            if last.use < last.rec.n_tokens:  # the prefix ends inside a chunk: any sibling
                tail = toks[last.start:]  # chunk that starts with the same tokens will do
                ends = [c for c in self._children.get(last.rec.parent, ())
                        if c not in self._corrupt
                        and np.array_equal(self._chunks[c].tokens[:len(tail)], tail)]
            cands = {k for c in ends for k in self._holders.get(c, ()) if k in self._indexed}
            if not cands:
                return None
            s = min((self._sessions[k] for k in cands), key=lambda r: (r.n_tokens, r.key))
            ctx = np.concatenate([self._chunks[c].tokens for c in s.chunks])
            path = self._index_path(s.key)
        full: list[np.ndarray] = []

        def rebuild(layer: int, head: int, spec: IndexSpec):
            if not full:  # the context's keys, read (and checked) once
                try:
                    keys, _ = self.get(ctx, namespace=namespace)
                except (KeyError, CorruptData) as e:  # evicted, or a chunk failed its checksum
                    raise _KeysUnavailable(str(e)) from e
                full.append(positioned_keys(keys, self.layout))
            return build_index(full[0][layer, head], spec)

        try:
            ci, rebuilt = read_context_indexes(path, rebuild=rebuild, rewrite=not self.readonly)
            ok = (ci.n_tokens == s.n_tokens and ci.num_layers == self.layout.num_layers
                  and ci.num_kv_heads == self.layout.num_kv_heads)
        except CorruptData:
            ok, rebuilt = False, []
        except (_KeysUnavailable, OSError):  # unreadable keys, or the context left meanwhile
            with self._mutex:
                self._counters["unavailable_indexes"] += 1
            return None
        with self._mutex:
            if s.key not in self._indexed:  # evicted or replaced while loading
                return None
            self._counters["rebuilt_index_heads"] += len(rebuilt)
            if not ok:
                self._counters["corrupt_indexes"] += 1
                if not self.readonly:
                    self._indexed.pop(s.key, None)
                    shutil.rmtree(path, ignore_errors=True)
                return None
            return ci

    def _write(self, toks: np.ndarray, kr: np.ndarray, vr: np.ndarray, namespace: str | None,
               base: int = 0) -> None:
        """Store ``toks`` given raw KV kr/vr [L, H, T - base, D] of tokens [base, T).

        Plan under the lock (slots, evictions), write and sync without it, commit under it.
        """
        with self._mutex:
            self._check_writable()
            plan = self._plan_put(toks, namespace, base)
            if plan is None:
                return
            self._writers += 1
            pool = self._io_pool()
        try:
            try:
                self._write_extents(plan, kr, vr, base, pool)
            except BaseException:
                with self._mutex:
                    self._abort_put(plan)
                raise
            with self._mutex:
                self._commit_put(plan)
        finally:
            with self._mutex:
                self._writers -= 1
                self._cond.notify_all()

    def _plan_put(self, toks: np.ndarray, namespace: str | None, base: int) -> _PutPlan | None:
        """Under the lock: what a put must write, with slots taken and its prefix held."""
        lay, c = self.layout, self.config.chunk_tokens
        n_tok = len(toks)
        while True:
            now = self._tick()
            pieces = self._resolve(toks, namespace)
            if sum(p.use for p in pieces) == n_tok:
                # Already servable (possibly through a longer context): only refresh recency.
                self._counters["put_tokens"] += n_tok
                self._touch_holders(pieces[-1].rec.key, now)
                return None
            parts = self._split(toks)
            seed = chain_seed(lay.fingerprint, namespace)
            existing = [p.rec for p in pieces if p.use == p.rec.n_tokens and p.use == c]
            chain: list[bytes] = [r.key for r in existing]
            parent = chain[-1] if chain else seed
            specs: list[tuple[bytes, bytes, int]] = []  # (key, parent, chunk index)
            for i in range(len(existing), len(parts)):
                key = chunk_hash(parent, parts[i])
                specs.append((key, parent, i))
                chain.append(key)
                parent = key
            if not any(k in self._inflight for k, _, _ in specs):
                break
            self._cond.wait()  # another put is writing the same chunks: wait, then re-plan
            self._check_writable()
        self._counters["put_tokens"] += n_tok
        for key, _, _ in specs:
            if key in self._corrupt:  # held by another put or save until it ends
                raise CorruptData(f"chunk {key.hex()} of this context's stored prefix failed its "
                                  f"checksum; nothing was stored")
            if key in self._chunks:
                # Same address but different tokens (a hash collision) or a full chunk that the
                # walk did not take: refuse rather than alias.
                raise CorruptData(f"chunk address collision at {key.hex()}")
        if specs[0][2] * c < base:
            raise KVStoreError(f"the stored prefix of this context (first {base} tokens, whose "
                               f"KV was not kept for saving) is no longer stored")
        if len(chain) > self._geo.total_slots:  # the reused prefix stays on disk too
            raise CapacityError(
                f"a context of {n_tok} tokens needs {len(chain)} chunk slots; disk_bytes="
                f"{self.config.disk_bytes} holds {self._geo.total_slots}"
            )
        held = [r.key for r in existing]
        self._hold(held)
        taken: list[int] = []
        try:
            self._make_room(len(specs))
            for _ in specs:
                taken.append(heapq.heappop(self._free_slots))
            # Segment files are created here, before writes run concurrently on the IO workers.
            self._segments.ensure_ready(taken)
        except BaseException:
            for s in taken:
                heapq.heappush(self._free_slots, s)
            self._release(held)
            raise
        # DRAM staging slots (pending: invisible, not evictable) while a free or evictable slot
        # exists; the chunks not staged are simply not cached.
        staged: dict[bytes, torch.Tensor] = {}
        for key, _, i in specs:
            if self._dram.num_slots and self._dram.evictable:
                staged[key] = self._dram.insert(key, self._extent_bytes(len(parts[i])), now,
                                                self._chunk_queued(key), pending=True)
        self._inflight.update(k for k, _, _ in specs)
        return _PutPlan(toks=toks, namespace=namespace, now=now, parts=parts, chain=chain,
                        specs=specs, slots=taken, held=held, staged=staged)

    def _write_extents(self, plan: _PutPlan, kr: np.ndarray, vr: np.ndarray, base: int,
                       pool: ThreadPoolExecutor) -> None:
        """Without the lock: write the new extents into the plan's slots and make them durable
        on the IO worker (one pwritev per chunk straight from the caller's arrays, then
        fdatasync), while this thread computes checksums and fills the DRAM staging slots from
        the same bytes. Fills ``plan.records``."""
        lay, c = self.layout, self.config.chunk_tokens
        jobs = [(slot_no, _extent_pieces(kr, vr, i * c - base, len(plan.parts[i])))
                for slot_no, (_, _, i) in zip(plan.slots, plan.specs, strict=True)]

        def write_all() -> None:
            # One task: buffered writes to one file serialize in the kernel anyway, and two
            # concurrent writers measured slower here.
            for slot_no, pieces in jobs:
                self._segments.write(slot_no, pieces)
            self._segments.sync(plan.slots)

        fut = pool.submit(write_all)
        try:
            for (key, par, i), (slot_no, pieces) in zip(plan.specs, jobs, strict=True):
                n, t0 = len(plan.parts[i]), i * c - base
                sums = _piece_checksums(pieces, lay.num_layers)
                slot = plan.staged.get(key)
                if slot is not None:
                    ext = self._extent_np(slot, n)
                    np.copyto(ext[:, 0], kr[:, :, t0 : t0 + n])  # [L, H, n, D]
                    np.copyto(ext[:, 1], vr[:, :, t0 : t0 + n])
                plan.records.append(ChunkRecord(key, par, n, slot_no, sums, plan.parts[i].copy()))
        finally:
            wait([fut])  # the worker must be done with the slots before anything reuses them
        fut.result()  # durable (or the IO error, re-raised here)

    def _abort_put(self, plan: _PutPlan, *, recycle_slots: bool = True) -> None:
        """Under the lock: undo a plan that did not commit. Its slots are reused only if no
        commit can have reached the disk (``recycle_slots``)."""
        for key in plan.staged:
            self._dram.discard(key)
        if recycle_slots:
            for s in plan.slots:
                heapq.heappush(self._free_slots, s)
        self._inflight.difference_update(k for k, _, _ in plan.specs)
        self._release(plan.held)

    def _commit_put(self, plan: _PutPlan) -> None:
        """Under the lock: make a written plan visible in one catalog transaction."""
        if self._failed is not None or self._closed:
            self._abort_put(plan)
            self._check_writable()
        bad = [k for k in plan.held if k in self._corrupt]
        if bad:  # the reused prefix failed a checksum while this put wrote
            self._abort_put(plan)
            raise CorruptData(f"chunk {bad[0].hex()} of this context's stored prefix failed its "
                              f"checksum while the put was written; nothing was stored")
        chain, now = plan.chain, plan.now
        # Contexts this put supersedes: stored strict prefixes of it (computed now: other puts
        # may have committed while this one wrote).
        superseded = self._prefix_sessions(plan.toks, chain, plan.namespace)
        session = SessionRecord(chain[-1], len(plan.toks), now, now, tuple(chain))
        freed = self._freed_by(superseded, set(chain))
        try:
            with self._catalog.write() as txn:
                for rec in plan.records:
                    txn.put_chunk(rec)
                txn.put_session(session)
                for k in superseded:
                    txn.delete_session(k)
                for ch in freed:
                    txn.delete_chunk(ch)
                txn.put_meta("clock", self._clock)
        except BaseException as e:
            # The commit failed in a way that may or may not have reached the disk (e.g. its
            # fsync failed): recycling the slots could overwrite a committed extent. Refuse
            # further writes; reopening rebuilds the state from what the catalog holds.
            self._failed = e
            self._abort_put(plan, recycle_slots=False)
            raise
        # Committed: apply to the in-memory mirror.
        for rec in plan.records:
            self._chunks[rec.key] = rec
            self._children[rec.parent].add(rec.key)
            self._inflight.discard(rec.key)
        for key in plan.staged:
            self._dram.publish(key)
        self._unlink_sessions(superseded, freed)
        self._sessions[session.key] = session
        for ch in chain:
            self._holders[ch].add(session.key)
        self._session_heap.push(session.key, self._session_priority(session))
        self._release(plan.held)
        self._counters["put_chunks_written"] += len(plan.records)
        if self._jobs:
            self._queue_dirty = True
            self._prefetcher.kick()

    def _hold(self, keys: list[bytes]) -> None:
        """Keep chunks stored (not freed by evictions) while a put or save still needs them."""
        for k in keys:
            self._held[k] += 1

    def _release(self, keys: list[bytes]) -> None:
        for k in keys:
            self._held[k] -= 1
            if not self._held[k]:
                del self._held[k]
        self._collect_orphans(frozenset(keys))

    def _prefix_sessions(self, toks: np.ndarray, chain: list[bytes],
                         namespace: str | None) -> list[bytes]:
        """Stored sessions whose tokens are a strict prefix of ``toks`` (chain = its chunks)."""
        c = self.config.chunk_tokens
        out = []
        parent = chain_seed(self.layout.fingerprint, namespace)
        for i, key in enumerate(chain):
            part = toks[i * c : (i + 1) * c]
            if key in self._sessions and key != chain[-1]:
                out.append(key)
            for child in self._children.get(parent, ()):
                rec = self._chunks[child]
                if (child in self._sessions and child != key and rec.n_tokens < len(part)
                        and np.array_equal(rec.tokens, part[: rec.n_tokens])):
                    out.append(child)
            parent = key
        return out

    def _touch_holders(self, chunk: bytes, clock: int) -> None:
        for k in self._holders.get(chunk, ()):
            s = self._sessions[k]
            s.last_access = clock
            self._dirty_access.add(k)
            self._session_heap.push(k, self._session_priority(s))

    def match(self, tokens: object, *, namespace: str | None = None) -> int:
        """How many leading tokens of ``tokens`` the store can serve (from any tier).

        Thread-safe.
        """
        toks = as_tokens(tokens)
        with self._mutex:
            self._check_open()
            n = sum(p.use for p in self._resolve(toks, namespace))
            self._counters["match_calls"] += 1
            self._counters["matched_tokens"] += n
            return n

    def get(self, tokens: object, *, namespace: str | None = None,
            out: tuple[torch.Tensor, torch.Tensor] | None = None,
            device: str | torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of all of ``tokens``: (keys, values), [num_layers, num_kv_heads, T, head_dim].

        Keys are pre-RoPE, in the layout dtype, on CPU unless ``device`` is given; with
        ``out=(k, v)`` the preallocated tensors are filled and returned. Raises KeyError if not
        every token is stored, :class:`CorruptData` if stored bytes fail their checksum (the
        contexts holding them are then dropped, so a retry sees a shorter match). Thread-safe.
        """
        toks = as_tokens(tokens)
        n_tok = len(toks)
        if out is not None:
            k_out, v_out = self._check_out(out, n_tok)
            if device is not None and torch.device(device) != k_out.device:
                raise ValueError(f"device={device!r} disagrees with out tensors on {k_out.device}")
        with self._mutex:
            self._check_open()
            pieces = self._resolve_all(toks, namespace)
            if out is None:
                shape = self.layout.kv_shape(n_tok)
                k_out = torch.empty(shape, dtype=self.layout.torch_dtype, device=device)
                v_out = torch.empty(shape, dtype=self.layout.torch_dtype, device=device)
            # Pass 1: DRAM hits (lookups only, so nothing is evicted while copying them out).
            misses = []
            for p in pieces:
                slot = self._dram.lookup(p.rec.key, self._tick())
                if slot is None:
                    misses.append(p)
                else:
                    self._counters["dram_hits"] += 1
                    self._copy_out(slot, p, k_out, v_out)
            # Pass 2: DRAM misses, read from disk.
            if misses:
                self._read_misses(misses, k_out, v_out)
            if not self.readonly:
                self._touch_holders(pieces[-1].rec.key, self._clock)
            self._counters["gets"] += 1
            self._counters["served_tokens"] += n_tok
            return k_out, v_out

    def load_layers(self, tokens: object, *, namespace: str | None = None,
                    buffer_layers: int | None = None,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None,
                    device: str | torch.device | None = None) -> LayerLoad:
        """Start loading the KV of ``tokens`` layer by layer; returns a :class:`LayerLoad`.

        A loader thread fills layer 0, 1, ... of (keys, values) [L, H, T, D] (pre-RoPE) in an
        execution buffer of the hbm tier on ``device`` (default CPU; on CUDA each layer goes
        through pinned host memory and a copy stream), or in ``out`` (contiguous CPU tensors);
        ``wait(l)`` blocks until layer l is ready. With ``buffer_layers=B`` the loader loads at
        most B layers before compute first waits, then stays at most B + 1 layers ahead of the
        layer compute waits for (None: no bound). Layers read from disk are verified one by one
        and are not copied into the DRAM tier. The chunks are pinned until the load ends, so
        concurrent evictions cannot reuse their space under it. :meth:`LayerLoad.close` gives
        the execution buffer back. Raises KeyError if not every token is stored, CapacityError
        if the execution buffer does not fit ``hbm_bytes``. Thread-safe.
        """
        toks = as_tokens(tokens)
        n_tok = len(toks)
        shape = self.layout.kv_shape(n_tok)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if out is not None:
            k_out, v_out = self._check_out(out, n_tok)
            if k_out.device.type != "cpu" or not (k_out.is_contiguous()
                                                  and v_out.is_contiguous()):
                raise ValueError("out tensors of load_layers must be contiguous CPU tensors")
            if device is not None and dev != k_out.device:
                raise ValueError(f"device={device!r} disagrees with out tensors on {k_out.device}")
        with self._mutex:
            self._check_open()
            if self._closing:
                raise StoreClosed(f"store {self.path!r} is closing")
            pieces = self._resolve_all(toks, namespace)
            buf = None
            if out is None:
                buf = self._hbm(dev).acquire(self._extent_bytes(n_tok))  # K and V
                kv = buf.view(self.layout.torch_dtype).view(2, *shape)  # [2, L, H, T, D]
                k_out, v_out = kv[0], kv[1]
            copy = None
            if k_out.device.type == "cuda":
                try:
                    copy = _CudaCopy(k_out, v_out)
                except BaseException:
                    if buf is not None:
                        self._hbm(dev).release(buf)
                    raise
                kr, vr = _raw(copy.host_k), _raw(copy.host_v)
            else:
                kr, vr = _raw(k_out), _raw(v_out)

            def load_layer(layer: int) -> torch.cuda.Event | None:
                self._load_layer(pieces, kr, vr, layer)
                return None if copy is None else copy.layer(layer)

            slots = [p.rec.slot for p in pieces]
            hbm = self._hbm(dev) if buf is not None else None
            load = LayerLoad(
                k_out, v_out, load_layer, buffer_layers=buffer_layers,
                on_done=lambda: self._end_load(load, slots),
                on_close=None if buf is None else lambda: hbm.release(buf))  # type: ignore[union-attr]
            for s in slots:
                self._pins[s] += 1
            now = self._tick()
            for p in pieces:
                hit = self._dram.lookup(p.rec.key, now) is not None
                self._counters["dram_hits" if hit else "disk_hits"] += 1
            if not self.readonly:
                self._touch_holders(pieces[-1].rec.key, now)
            self._counters["gets"] += 1
            self._counters["served_tokens"] += n_tok
            self._loads.add(load)
            try:
                return load.start()
            except BaseException:
                self._end_load(load, slots)
                load.close()
                raise

    def _hbm(self, device: torch.device) -> HbmTier:
        """The hbm tier (execution buffers) on ``device``; created on first use."""
        key = str(device)
        tier = self._hbm_tiers.get(key)
        if tier is None:
            tier = HbmTier(capacity_bytes=self.config.hbm_bytes, device=device)
            self._hbm_tiers[key] = tier
        return tier

    def _load_layer(self, pieces: list[_Piece], kr: np.ndarray, vr: np.ndarray,
                    layer: int) -> None:
        """Fill layer ``layer`` of the raw outputs kr/vr [L, H, T, D] (loader thread)."""
        lay = self.layout
        with self._mutex:
            self._check_open()
            for p in pieces:
                rec, n, a, b = p.rec, p.rec.n_tokens, p.start, p.start + p.use
                slot = self._dram.peek(rec.key) if rec.key in self._chunks else None
                if slot is not None:
                    ext = self._extent_np(slot, n)  # [L, 2, H, n, D]
                    # numpy, not torch: torch's copy would run on the intra-op thread pool
                    # that the compute thread's matmuls use (measured 2x slower prefill)
                    np.copyto(kr[layer, :, a:b], ext[layer, 0, :, : p.use])  # [H, use, D]
                    np.copyto(vr[layer, :, a:b], ext[layer, 1, :, : p.use])
                    continue
                lbytes = n * lay.layer_token_bytes
                if p.use == n:  # straight into the output: K of each head, then V
                    bufs = ([kr[layer, h, a:b] for h in range(lay.num_kv_heads)]
                            + [vr[layer, h, a:b] for h in range(lay.num_kv_heads)])
                else:
                    bufs = [np.empty(lbytes, dtype=np.uint8)]
                try:
                    self._segments.read(rec.slot, bufs, layer * lbytes)
                    if _piece_checksums(bufs, 1)[0] != rec.checksums[layer]:
                        raise CorruptData(f"chunk {rec.key.hex()} (disk slot {rec.slot}) failed "
                                          f"its checksum at layer {layer}")
                except CorruptData as e:
                    self._quarantine(rec.key, e)
                    raise
                if p.use != n:
                    part = bufs[0].view(kr.dtype).reshape(2, lay.num_kv_heads, n, lay.head_dim)
                    np.copyto(kr[layer, :, a:b], part[0, :, : p.use])
                    np.copyto(vr[layer, :, a:b], part[1, :, : p.use])

    def _end_load(self, load: LayerLoad, slots: list[int]) -> None:
        with self._mutex:
            self._loads.discard(load)
            for s in slots:
                self._pins[s] -= 1
                if not self._pins[s]:
                    del self._pins[s]
                    if s in self._deferred_free:
                        self._deferred_free.discard(s)
                        heapq.heappush(self._free_slots, s)

    # ------------------------------------------------------------------ asynchronous saving
    def begin_save(self, tokens: object, *, namespace: str | None = None,
                   max_new_tokens: int = 0) -> SaveHandle:
        """Start saving the context ``tokens`` asynchronously (AttentionStore §3.2.2).

        Give each layer's KV to :meth:`SaveHandle.layer` as soon as it exists (during prefill),
        decode-step KV of up to ``max_new_tokens`` more tokens to :meth:`SaveHandle.append`, then
        :meth:`SaveHandle.finish`: a writer thread stores the context (crash-safe, all or
        nothing) and the returned future completes when it is durable. Only tokens after the
        already stored full chunks are copied; those chunks are held until the save ends.
        Waits while the write buffer (``write_buffer_bytes``) is full. Thread-safe.
        """
        toks = as_tokens(tokens)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        c = self.config.chunk_tokens
        with self._mutex:
            self._check_writable()
            if self._closing:
                raise StoreClosed(f"store {self.path!r} is closing")
            pieces = self._resolve(toks, namespace)
            held = [p.rec.key for p in pieces if p.use == p.rec.n_tokens == c]
            self._hold(held)
        base = len(held) * c
        capacity = len(toks) + max_new_tokens - base
        nbytes = capacity * self.layout.token_bytes
        try:
            self._saver.reserve(nbytes)
        except BaseException:
            self._release_locked(held)
            raise
        return SaveHandle(self._saver, self.layout, toks, namespace, base, capacity, held,
                          nbytes)

    def save_async(self, tokens: object, keys: torch.Tensor, values: torch.Tensor, *,
                   namespace: str | None = None) -> Future[None]:
        """:meth:`put` on the writer thread: returns once the KV is copied into the write
        buffer; the future completes when it is durable. Thread-safe."""
        toks = as_tokens(tokens)
        keys = self._check_kv("keys", keys, len(toks))
        values = self._check_kv("values", values, len(toks))
        with self.begin_save(toks, namespace=namespace) as save:
            for layer in range(self.layout.num_layers):
                save.layer(layer, keys[layer], values[layer])
            return save.finish()

    def wait_saved(self, tokens: object, *, namespace: str | None = None) -> None:
        """Block until asynchronous saves that may extend what the store serves for
        ``tokens`` are written (so :meth:`match` sees them); raises such a save's error.
        Thread-safe."""
        self._check_open()
        self._saver.wait_for(as_tokens(tokens), namespace)

    def flush(self) -> None:
        """The durability point of asynchronous saves: block until every finished save is
        durable; raise the first error a save met since the last flush. Thread-safe."""
        self._check_open()
        self._saver.flush()

    def _release_locked(self, keys: list[bytes]) -> None:
        with self._mutex:
            if not self._closed:
                self._release(keys)

    # ------------------------------------------------------------------ scheduler hints
    def set_queue(self, jobs: object, *, running: object = ()) -> None:
        """Hand the store the scheduler's waiting jobs, the next to run first (AttentionStore
        §3.3). Each job is its prompt's token ids (or ``(tokens, namespace)``, or a
        :class:`kvstore.Job`). ``running``: jobs executing now (same forms); their stored
        contexts are kept in DRAM ahead of every waiting job's, since they are being read, but
        they do not count in the windows. Replaces the previous queue; call it whenever the
        queue changes.

        With the ``scheduler`` (or ``belady``) policy, a background thread then fetches from
        disk into DRAM the stored contexts of the next ``prefetch_window`` jobs, and eviction
        looks ahead ``eviction_window`` jobs (see :mod:`kvstore.schedule`; both windows are in
        ``stats()["queue"]``). With ``lru``/``fifo`` the queue is recorded but not used.
        Thread-safe.
        """
        parsed = as_jobs(jobs)
        now_running = as_jobs(running)
        with self._mutex:
            self._check_open()
            self._jobs = parsed
            self._running = now_running
            self._queue_dirty = True
            if self._policy.uses_queue:
                self._refresh_queue()
                self._prefetcher.kick()

    def wait_prefetched(self, timeout: float | None = None) -> bool:
        """Block until the prefetcher has acted on the latest queue and store changes (False
        on timeout). Re-raises an IO error the prefetcher met. Thread-safe."""
        return self._prefetcher.wait_idle(timeout)

    def _refresh_queue(self) -> None:
        """Under the lock: recompute where chunks and sessions are next needed in the queue,
        the windows, and the priorities that depend on them."""
        if not self._queue_dirty or not self._policy.uses_queue:
            return
        self._queue_dirty = False
        old_chunks, old_sessions = self._chunk_pos, self._session_pos
        chunk_pos: dict[bytes, int] = {}
        session_pos: dict[bytes, int] = {}
        job_pieces = []
        for job in self._running:  # position -1: ahead of every waiting job
            for p in self._resolve(job.tokens, job.namespace):
                chunk_pos.setdefault(p.rec.key, -1)
                if p.rec.key in self._sessions:
                    session_pos.setdefault(p.rec.key, -1)
        for i, job in enumerate(self._jobs):
            pieces = self._resolve(job.tokens, job.namespace)
            job_pieces.append(pieces)
            for p in pieces:
                chunk_pos.setdefault(p.rec.key, i)
                if p.rec.key in self._sessions:  # the job's prompt extends this context
                    session_pos.setdefault(p.rec.key, i)
        n = len(self._sessions)
        avg = sum(len(x.chunks) for x in self._sessions.values()) / n if n else 1.0
        self._windows = Windows.derive(dram_slots=self._dram.num_slots,
                                       disk_slots=self._geo.total_slots, avg_session_slots=avg)
        self._chunk_pos, self._session_pos, self._job_pieces = chunk_pos, session_pos, job_pieces
        for k in old_sessions.keys() | session_pos.keys():
            if k in self._sessions:
                self._session_heap.push(k, self._session_priority(self._sessions[k]))
        for k in old_chunks.keys() | chunk_pos.keys():
            self._dram.requeue(k, self._chunk_queued(k))

    def _prefetch_step(self) -> bool:
        """Prefetcher thread: fetch one chunk of a job in the prefetch window into DRAM, if one
        is missing and DRAM can take it without evicting something needed sooner. Returns
        whether there may be more to do. Holds the store lock for one chunk's read."""
        with self._mutex:
            if self._closed or self._closing:
                return False
            self._refresh_queue()
            for pieces in self._job_pieces[: self._windows.prefetch]:
                for p in pieces:
                    rec = self._chunks.get(p.rec.key)
                    if rec is None or rec.key in self._dram or rec.key in self._corrupt:
                        continue
                    if not self._dram.evictable:
                        return False
                    now = self._clock
                    mine = self._policy.priority(AccessStats(inserted=now, last_access=now),
                                                 self._chunk_queued(rec.key))
                    victim = self._dram.victim_priority()
                    if victim is not None and not victim < mine:  # type: ignore[operator]
                        return False  # DRAM holds only what is needed sooner
                    try:
                        self._fetch_chunk(rec)
                    except CorruptData:
                        # quarantined: skipped from now on (it stays while held, or read-only)
                        self._queue_dirty = True
                        return True
                    self._counters["prefetched_chunks"] += 1
                    return True
            return False

    def residency(self, tokens: object, *, namespace: str | None = None) -> dict[str, int]:
        """Where the KV of ``tokens`` is: tokens served from DRAM, from disk only, and not
        stored. Counts no access. Thread-safe."""
        toks = as_tokens(tokens)
        with self._mutex:
            self._check_open()
            out = {"dram": 0, "disk": 0, "missing": len(toks)}
            for p in self._resolve(toks, namespace):
                out["dram" if p.rec.key in self._dram else "disk"] += p.use
                out["missing"] -= p.use
            return out

    def delete(self, tokens: object, *, namespace: str | None = None) -> bool:
        """Remove the context stored for exactly ``tokens``; chunks other contexts share stay.

        Returns False if no context was stored for exactly these tokens. Thread-safe.
        """
        toks = as_tokens(tokens)
        with self._mutex:
            self._check_writable()
            pieces = self._resolve(toks, namespace)
            if sum(p.use for p in pieces) != len(toks):
                return False
            last = pieces[-1].rec
            s = self._sessions.get(last.key)
            if s is None or s.n_tokens != len(toks) or last.n_tokens != pieces[-1].use:
                return False
            self._drop_sessions([s.key])
            return True

    def stats(self) -> dict[str, object]:
        """Bytes and chunk counts per tier, hits/misses, evictions. Thread-safe."""
        with self._mutex:
            cnt = self._counters
            disk_payload = sum(self._extent_bytes(r.n_tokens) for r in self._chunks.values())
            return {
                "hbm": {
                    "capacity_bytes": self.config.hbm_bytes,
                    "bytes": sum(t.used_bytes for t in self._hbm_tiers.values()),
                    "idle_bytes": sum(t.idle_bytes for t in self._hbm_tiers.values()),
                    "devices": sorted(self._hbm_tiers),
                },
                "dram": {
                    "capacity_bytes": self.config.dram_bytes,
                    "bytes": self._dram.bytes_used,
                    "chunks": len(self._dram),
                    "slots": self._dram.num_slots,
                },
                "disk": {
                    "capacity_bytes": self.config.disk_bytes,
                    "bytes": disk_payload,
                    "slot_bytes": len(self._chunks) * self._geo.slot_stride,
                    "chunks": len(self._chunks),
                    "slots": self._geo.total_slots,
                    "sessions": len(self._sessions),
                    "tokens": sum(s.n_tokens for s in self._sessions.values()),
                },
                "hits": {"dram": cnt["dram_hits"], "disk": cnt["disk_hits"]},
                "misses": cnt["get_misses"],
                "evictions": {
                    "dram_chunks": self._dram.evictions,
                    "disk_sessions": cnt["evicted_sessions"],
                    "disk_chunks": cnt["evicted_chunks"],
                },
                "queue": {
                    "jobs": len(self._jobs),
                    "running": len(self._running),
                    "prefetch_window": self._windows.prefetch,
                    "eviction_window": self._windows.eviction,
                    "prefetched_chunks": cnt["prefetched_chunks"],
                    "evicted_in_window": cnt["evicted_in_window"],
                },
                "saves": {
                    "write_buffer_bytes": self.config.write_buffer_bytes,
                    "write_buffer_used": self._saver.used_bytes,
                    "saved": self._saver.saved,
                    "failed": self._saver.failed,
                },
                "indexes": {
                    "contexts": len(self._indexed),
                    "bytes": sum(self._indexed.values()),
                    "built": cnt["indexes_built"],
                    "rebuilt_heads": cnt["rebuilt_index_heads"],
                    "corrupt": cnt["corrupt_indexes"],
                    "unavailable": cnt["unavailable_indexes"],
                    "collected": cnt["collected_indexes"],
                },
                "corrupt": {
                    "chunks": cnt["corrupt_chunks"],
                    "dropped_sessions": cnt["dropped_sessions"],
                    "collected_orphans": cnt["collected_orphans"],
                },
                "requests": {
                    "puts_tokens": cnt["put_tokens"],
                    "chunks_written": cnt["put_chunks_written"],
                    "gets": cnt["gets"],
                    "served_tokens": cnt["served_tokens"],
                    "matches": cnt["match_calls"],
                    "matched_tokens": cnt["matched_tokens"],
                },
            }

    # ------------------------------------------------------------------ introspection
    def index_dirs(self) -> dict[bytes, str]:
        """Session key -> directory of the contexts that have indexes. Thread-safe."""
        with self._mutex:
            return {k: self._index_path(k) for k in self._indexed}

    def sessions(self) -> list[SessionRecord]:
        """Snapshot of the stored contexts (copies). Thread-safe."""
        with self._mutex:
            return [replace(s) for s in self._sessions.values()]

    def chunk_records(self) -> list[ChunkRecord]:
        """Snapshot of the chunk records. Thread-safe."""
        with self._mutex:
            return list(self._chunks.values())

    def read_extent(self, rec: ChunkRecord) -> np.ndarray:
        """Read a chunk's extent straight from disk (bypassing DRAM), unverified. Thread-safe."""
        with self._mutex:
            self._check_open()
            buf = np.empty(self._extent_bytes(rec.n_tokens), dtype=np.uint8)
            self._segments.read(rec.slot, [buf])
            return buf

    def checksums_of(self, extent: np.ndarray) -> np.ndarray:
        return _checksums(extent, self.layout.num_layers)

    def drop_caches(self) -> None:
        """Empty the DRAM tier and the OS page cache of the segment files (for benchmarks)."""
        with self._mutex:
            self._check_open()
            for key in list(self._chunks):
                self._dram.discard(key)
            self._segments.drop_cache()

    # ------------------------------------------------------------------ closing
    def close(self, *, abandon_pending: bool = False) -> None:
        """Finish IO, persist access times, release files and the lock. Idempotent.

        Finished asynchronous saves are written first (with ``abandon_pending``, those not yet
        started are dropped: their futures get :class:`StoreClosed`); either way each context is
        stored whole or not at all. Layer-wise loads still running are cancelled (their waiters
        get an error). No thread of the store outlives close(). Thread-safe.
        """
        with self._mutex:
            self._closing = True  # no new layer-wise loads, saves or prefetches from here on
            loads = list(self._loads)
        self._prefetcher.close()
        self._saver.close(abandon=abandon_pending)
        for load in loads:
            load.close()  # outside the lock: the loader needs it to finish its layer
        with self._mutex:
            self._cond.wait_for(lambda: self._writers == 0)  # puts writing without the lock
            if self._closed:
                return
            self._closed = True
            try:
                if self._dirty_access and not self.readonly:
                    with self._catalog.write() as txn:
                        for k in self._dirty_access:
                            txn.put_session(self._sessions[k])
                        txn.put_meta("clock", self._clock)
                    self._dirty_access.clear()
            finally:
                if self._io is not None:
                    self._io.shutdown(wait=True)
                    self._io = None
                self._segments.close()
                self._catalog.close()
                self._lock_file.release()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._sessions)} contexts"
        return f"<kvstore.Store {self.path!r} {state}>"


def _size_arg(name: str, v: object) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | np.integer):
        raise TypeError(f"{name} must be an int number of bytes, got {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return int(v)


def open_store(path: str | os.PathLike[str], *, layout: KVLayout | None = None,
               dram_bytes: int | None = None, disk_bytes: int | None = None,
               hbm_bytes: int | None = None, write_buffer_bytes: int | None = None,
               chunk_tokens: int | None = None, policy: str | None = None,
               readonly: bool = False) -> Store:
    """Open (or create) the store directory ``path``.

    On creation ``layout`` is required; omitted sizes get the defaults (dram 1 GiB, disk 16 GiB,
    hbm 1 GiB of execution buffers, write buffer 256 MiB, chunk_tokens 256, policy
    "scheduler"). On reopen, ``layout`` and ``chunk_tokens`` may be omitted
    (stored values are used) but must match if given (:class:`LayoutMismatch`); sizes and policy
    given replace the stored ones. ``readonly`` opens a store that must exist, shares it with
    other readers, and never writes. Raises :class:`StoreLocked` if another process has it open
    for writing.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if layout is not None and not isinstance(layout, KVLayout):
        raise TypeError(f"layout must be a kvstore.KVLayout, got {type(layout).__name__}")
    dram_bytes = _size_arg("dram_bytes", dram_bytes)
    hbm_bytes = _size_arg("hbm_bytes", hbm_bytes)
    write_buffer_bytes = _size_arg("write_buffer_bytes", write_buffer_bytes)
    disk_bytes = _size_arg("disk_bytes", disk_bytes)
    if chunk_tokens is not None:
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int):
            raise TypeError(f"chunk_tokens must be an int, got {type(chunk_tokens).__name__}")
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if policy is not None:
        make_policy(policy)
    if readonly:
        if not os.path.isdir(os.path.join(path, "catalog")):
            raise FileNotFoundError(f"no kvstore at {path!r}")
    else:
        os.makedirs(path, exist_ok=True)
    lock = DirLock(os.path.join(path, "LOCK"), exclusive=not readonly)
    try:
        catalog = Catalog(os.path.join(path, "catalog"), readonly=readonly)
        try:
            sizes = {"dram_bytes": dram_bytes, "disk_bytes": disk_bytes, "hbm_bytes": hbm_bytes,
                     "write_buffer_bytes": write_buffer_bytes}
            store = _settle(path, catalog, lock, layout, sizes, chunk_tokens, policy, readonly)
        except BaseException:
            catalog.close()
            raise
    except BaseException:
        lock.release()
        raise
    return store


def _settle(path: str, catalog: Catalog, lock: DirLock, layout: KVLayout | None,
            sizes: dict[str, int | None], chunk_tokens: int | None,
            policy: str | None, readonly: bool) -> Store:
    fmt = catalog.get_meta("format")
    given = {k: v for k, v in {**sizes, "chunk_tokens": chunk_tokens, "policy": policy}.items()
             if v is not None}
    if fmt is None:
        if readonly:
            raise FormatError(f"{path!r} holds no initialized kvstore")
        if layout is None:
            raise ValueError(f"layout is required to create a new store at {path!r}")
        config = StoreConfig(**given)
        _check_budget(layout, config)
        with catalog.write() as txn:
            txn.put_meta("layout", layout.to_dict())
            txn.put_meta("config", config.to_dict())
            txn.put_meta("clock", 0)
            txn.put_meta("format", FORMAT_VERSION)  # last: marks the store initialized
    else:
        if fmt != FORMAT_VERSION:
            raise FormatError(f"store format {fmt!r} is not supported (expected {FORMAT_VERSION})")
        try:
            stored = KVLayout.from_dict(catalog.get_meta("layout"))  # type: ignore[arg-type]
            stored_cfg = StoreConfig(**catalog.get_meta("config"))  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            raise FormatError(f"store metadata at {path!r} is invalid: {e}") from None
        if layout is not None and layout != stored:
            raise LayoutMismatch(
                f"store at {path!r} was created for {stored}, not {layout}"
            )
        if chunk_tokens is not None and chunk_tokens != stored_cfg.chunk_tokens:
            raise LayoutMismatch(
                f"store at {path!r} uses chunk_tokens={stored_cfg.chunk_tokens}, "
                f"not {chunk_tokens}"
            )
        layout = stored
        config = replace(stored_cfg, **given)
        _check_budget(layout, config)
        if config != stored_cfg and not readonly:
            with catalog.write() as txn:
                txn.put_meta("config", config.to_dict())
    store = Store(path, layout=layout, config=config, catalog=catalog, lock=lock,
                  readonly=readonly)
    store._load()
    return store


def _check_budget(layout: KVLayout, config: StoreConfig) -> None:
    slot = layout.chunk_bytes(config.chunk_tokens)
    if config.disk_bytes < slot:
        raise ValueError(
            f"disk_bytes={config.disk_bytes} is smaller than one chunk ({slot} bytes for "
            f"chunk_tokens={config.chunk_tokens}); the disk tier must hold at least one chunk"
        )
