"""Layer-wise loads (AttentionStore §3.2.1): a loader thread per load fills layer 0, 1, ... of
an execution buffer from the DRAM tier or disk, verified layer by layer; compute waits on each
layer's event. Reads go through :mod:`kvstore.pipelines.chunk_reads`.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.format import chunk_extent
from kvstore.format.records import ChunkRecord
from kvstore.index.lifecycle import IndexFiles
from kvstore.pipelines.chunk_reads import copy_layer, read_layer, read_layers, reading
from kvstore.pipelines.device_copy import strided_copies
from kvstore.pipelines.layer_load import LayerLoad, Loader, layer_groups
from kvstore.pipelines.pages import Pages
from kvstore.residency.core import Core
from kvstore.tiers.dram import Entry
from kvstore.tiers.exec_buffers import HbmTier
from kvstore.view.prefix_tree import Piece

DURING = "this layer-wise load"


class _ToDevice:
    """The copies of a layer-wise load into a CUDA execution buffer, on a side stream.

    For each layer, every part's layer of its chunk ([2, H, n, D], contiguous) goes to a device
    staging buffer in one copy: straight from its DRAM slot when the slot holds the raw bytes
    and the slab is page-locked (:mod:`kvstore.tiers.pinned`), else from a pinned host staging
    block that the disk read (or a coded copy's decode) filled. Device-side copies then place
    keys and values into the buffer [L, H, T, D]; the layer's event tells compute when they have
    run. The DRAM copies the load serves from are pinned from its start to its end; staging
    (host and device) alternates between two layers' worth, a host block reused once its
    copies have run (the loader never waits on the copies it has just queued). Every view is
    made once, up front: a layer costs the loader two batched copy calls, because the loader
    shares the interpreter with the compute thread, whose kernel launches it must not hold
    up. Used by the loader thread only (made, and closed, by the thread that starts the load).
    """

    WINDOW = 2  # layers whose staging may be in flight

    def __init__(self, core: Core, parts: list[Part], k_dev: torch.Tensor, v_dev: torch.Tensor,
                 after: torch.cuda.Event | None) -> None:
        self.core, self.parts = core, parts
        dev = k_dev.device
        lay = core.layout
        L, H, D = lay.num_layers, lay.num_kv_heads, lay.head_dim
        self.stream = torch.cuda.Stream(device=dev)
        self.stream.wait_stream(torch.cuda.current_stream(dev))  # a caller's out= buffer
        if after is not None:  # the execution buffer's previous load is done with it
            self.stream.wait_event(after)
        sizes = [p.rec.n_tokens * lay.layer_token_bytes for p in parts]
        off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
        with torch.cuda.stream(self.stream):  # used on the copy stream only
            self.stage = stage = [torch.empty(off[-1], dtype=torch.uint8, device=dev)
                                  for _ in range(self.WINDOW)]
        self.offsets, self.sizes = off, sizes
        # per window: each part's slice of the device staging
        self.stage_blocks = [[g[off[i] : off[i + 1]] for i in range(len(parts))]
                             for g in stage]
        # per window: (destinations, sources) of the placements, the destinations per layer
        self.place: list[tuple[list[list[torch.Tensor]], list[torch.Tensor]]] = []
        for g in stage:
            dsts: list[list[torch.Tensor]] = [[] for _ in range(L)]
            srcs: list[torch.Tensor] = []
            for i0, i1 in _runs(parts):  # parts i0..i1-1 (see _runs)
                p, n, r = parts[i0], parts[i0].rec.n_tokens, i1 - i0
                blocks = g[off[i0] : off[i1]].view(lay.torch_dtype).view(r, 2, H, n, D)
                for layer in range(L):
                    k_l, v_l = k_dev[layer], v_dev[layer]  # [H, T, D]
                    if r == 1:  # tokens [src, src + count) of one chunk
                        dsts[layer] += [k_l[:, p.dst : p.dst + p.count],
                                        v_l[:, p.dst : p.dst + p.count]]
                    else:  # r whole chunks, back to back
                        t0, t1 = p.dst, p.dst + r * n
                        dsts[layer] += [k_l[:, t0:t1].view(H, r, n, D),
                                        v_l[:, t0:t1].view(H, r, n, D)]
                if r == 1:
                    srcs += [blocks[0, 0, :, p.src : p.src + p.count],
                             blocks[0, 1, :, p.src : p.src + p.count]]
                else:
                    srcs += [blocks[:, 0].transpose(0, 1), blocks[:, 1].transpose(0, 1)]
            self.place.append((dsts, srcs))
        self.in_flight: collections.deque[torch.cuda.Event] = collections.deque()
        # pinned until close(): the DRAM copies this load serves from
        self.entries: list[Entry | None] = core.peek_copies([p.rec for p in parts])
        # per part, its DRAM slot's layers where copies may start there
        self.direct: list[tuple[torch.Tensor, ...] | None] = [
            torch.from_numpy(core.buffer(e)[: core.raw_bytes(p.rec.n_tokens)])
            .view(L, -1).unbind(0)
            if e is not None and core.dram_page_locked and not core.coded_copy(p.rec) else None
            for p, e in zip(parts, self.entries, strict=True)]
        self._group(core)
        # pinned host staging, per window, for the parts that are not copied from DRAM
        # (page-locking costs about as much as the copies: none where every part has a slot)
        self.staged = staged = [i for i, d in enumerate(self.direct) if d is None]
        self.host_blocks: list[dict[int, torch.Tensor]] = [{} for _ in range(self.WINDOW)]
        if staged:
            for blocks in self.host_blocks:
                host = torch.empty(sum(sizes[i] for i in staged), dtype=torch.uint8,
                                   pin_memory=True)
                at = 0
                for i in staged:
                    blocks[i] = host[at : at + sizes[i]]
                    at += sizes[i]

    def _group(self, core: Core) -> None:
        """Runs of parts copied from consecutive DRAM slots (equal sizes): layer l of a run is
        one strided copy (:class:`~kvstore.pipelines.device_copy.StridedCopies`); the other
        parts are copied one by one."""
        self.strided = strided_copies()
        self.groups: list[tuple[int, int, int]] = []  # (i0, i1, host address of i0's slot)
        grouped: set[int] = set()
        if self.strided.available:
            ptrs = [None if d is None or e is None else core.buffer(e).ctypes.data
                    for d, e in zip(self.direct, self.entries, strict=True)]
            pitch = core.dram_slot_stride
            i = 0
            while i < len(ptrs):
                j = i + 1
                if ptrs[i] is not None:
                    while (j < len(ptrs) and ptrs[j] is not None
                           and self.sizes[j] == self.sizes[i]
                           and ptrs[j] - ptrs[j - 1] == pitch):  # type: ignore[operator]
                        j += 1
                if j - i >= 2:
                    self.groups.append((i, j, ptrs[i]))  # type: ignore[arg-type]
                    grouped.update(range(i, j))
                i = j
        self.singles = [i for i in range(len(self.parts)) if i not in grouped]
        self.single_stage = [[blocks[i] for i in self.singles] for blocks in self.stage_blocks]
        self.pitch = core.dram_slot_stride

    def block(self, layer: int, i: int) -> np.ndarray:
        """Part ``i``'s host staging block of ``layer`` (uint8, its chunk's raw layer)."""
        return self.host_blocks[layer % self.WINDOW][i].numpy()

    def settle(self, keep: int) -> None:
        """Wait until the copies of all but the last ``keep`` layers in flight have run."""
        while len(self.in_flight) > keep:
            self.in_flight.popleft().synchronize()

    def close(self) -> None:
        """Wait for every copy queued, then unpin the DRAM copies. Idempotent."""
        self.settle(0)
        self.core.unpin_copies(self.entries)
        self.entries = []
        self.direct = []

    def issue(self, layer: int) -> torch.cuda.Event:
        """Queue layer ``layer``'s copies: each part's from its DRAM slot, or from its host
        staging block (filled by then)."""
        w = layer % self.WINDOW
        hosts, direct = self.host_blocks[w], self.direct
        srcs = [hosts[i] if direct[i] is None else direct[i][layer] for i in self.singles]
        dsts, place_srcs = self.place[w]
        base = self.stage[w].data_ptr()
        with torch.cuda.stream(self.stream):
            for i0, i1, ptr in self.groups:
                width = self.sizes[i0]
                self.strided.rows(base + self.offsets[i0], ptr + layer * width, self.pitch,
                                  width, i1 - i0, self.stream)
            if srcs:
                torch._foreach_copy_(self.single_stage[w], srcs, non_blocking=True)
            torch._foreach_copy_(dsts[layer], place_srcs, non_blocking=True)
            done = self.stream.record_event()
        self.in_flight.append(done)
        return done


def _runs(parts: list[Part]) -> list[tuple[int, int]]:
    """Maximal runs [i0, i1) of parts placed with one copy each: parts of one chunk size,
    each whole (or, for a run of one, any tokens of its chunk), back to back in the output."""
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(parts):
        j = i + 1
        p = parts[i]
        n = p.rec.n_tokens
        if p.src == 0 and p.count == n:
            while (j < len(parts) and parts[j].rec.n_tokens == n and parts[j].src == 0
                   and parts[j].count == n and parts[j].dst == parts[j - 1].dst + n):
                j += 1
        runs.append((i, j))
        i = j
    return runs


class Loads:
    """Layer-wise loads (AttentionStore §3.2.1): a loader thread per load fills layer 0, 1, ...
    of an execution buffer; compute waits on each layer. The disk slots of the load's chunks
    are pinned until it ends; DRAM copies are pinned one layer at a time.

    Thread-safety: every method may be called from any thread."""

    def __init__(self, core: Core, files: IndexFiles) -> None:
        self.core = core
        self._files = files
        self._lock = threading.Lock()  # over the two below
        self._loads: set[Loader] = set()  # running loads (not their handles)
        self._hbm_tiers: dict[str, HbmTier] = {}

    def hbm(self, device: torch.device) -> HbmTier:
        """The hbm tier (execution buffers) on ``device``; created on first use."""
        key = str(device)
        with self._lock:
            tier = self._hbm_tiers.get(key)
            if tier is None:
                tier = HbmTier(capacity_bytes=self.core.config.hbm_bytes, device=device)
                self._hbm_tiers[key] = tier
        return tier

    def tiers(self) -> list[HbmTier]:
        with self._lock:
            return list(self._hbm_tiers.values())

    def running(self) -> list[Loader]:
        with self._lock:
            return list(self._loads)

    def start(self, toks: np.ndarray, namespace: str | None, *, buffer_layers: int | None,
              out: tuple[torch.Tensor, torch.Tensor] | None, device: torch.device,
              start: int = 0, pages: Pages | None = None) -> LayerLoad:
        """Load positions [start, len(toks)) of the stored ``toks`` (``start`` checked by the
        caller): only the chunks covering them are pinned and read. Into ``pages`` (checked by
        the caller), straight into the engine's blocks: no execution buffer."""
        core = self.core
        n_tok = len(toks) - start

        def select(all_pieces: list[Piece]) -> list[Part]:
            parts = covering(all_pieces, start)
            if pages is not None:
                check_block_aligned(parts, pages.block_tokens)
            return parts

        pieces, pins = core.pin_for_load(toks, namespace, select)
        unpin = pins.release
        hbm = self.hbm(device) if out is None and pages is None else None

        buf = None
        to_gpu: _ToDevice | None = None
        k_out = v_out = None
        try:
            if pages is not None:
                pass
            elif out is None:
                buf = hbm.acquire(core.raw_bytes(n_tok))  # K and V
                kv = buf.view(core.layout.torch_dtype).view(2, *core.layout.kv_shape(n_tok))
                k_out, v_out = kv[0], kv[1]  # [L, H, T, D] each
            else:
                k_out, v_out = out
            if k_out is not None and k_out.device.type == "cuda":
                core.pin_dram_for_cuda()
                to_gpu = _ToDevice(core, pieces, k_out, v_out,
                                   None if buf is None else hbm.last_use(buf))
        except BaseException:
            if buf is not None:
                hbm.release(buf)
            unpin()
            raise

        groups = layer_groups(core.layout.num_layers)

        def load_layer(layer: int) -> torch.cuda.Event | None:
            if to_gpu is not None:
                return self._load_layer_to_gpu(pieces, to_gpu, layer)
            if pages is not None:
                if groups[layer][0] == layer:  # the group's first layer reads all of it
                    self._load_group_pages(pieces, pages, groups[layer])
            else:
                self._load_layer(pieces, chunk_extent.raw(k_out), chunk_extent.raw(v_out), layer)
            return None

        loader: list[Loader] = []

        def done() -> None:
            try:
                if to_gpu is not None:  # the copies in flight read DRAM slots and staging
                    to_gpu.close()
            finally:
                unpin()
                with self._lock:
                    self._loads.discard(loader[0])

        nbytes = 0 if buf is None else buf.numel()
        load = LayerLoad(k_out, v_out, load_layer, buffer_layers=buffer_layers, on_done=done,
                         on_close=None if buf is None else (lambda after: hbm.release(buf, after)),
                         on_abandon=None if buf is None else (lambda: hbm.forget(nbytes)),
                         num_layers=core.layout.num_layers)
        loader.append(load.loader)
        with self._lock:
            self._loads.add(load.loader)
        try:
            return load.start()
        except BaseException:
            done()
            load.close()
            raise

    def _load_layer_to_gpu(self, parts: list[Part], to_gpu: _ToDevice,
                           layer: int) -> torch.cuda.Event:
        """Queue the copies of layer ``layer`` to the GPU (loader thread): each part's layer
        from its DRAM slot where it holds the raw bytes, else read (or decoded) into its
        host staging block first. Returns the layer's event."""
        core = self.core
        lay = core.layout
        if to_gpu.staged:  # this layer's host staging blocks are free again
            to_gpu.settle(to_gpu.WINDOW - 1)
        for i, p in enumerate(parts):
            if to_gpu.direct[i] is not None:
                continue
            rec, n = p.rec, p.rec.n_tokens
            block = to_gpu.block(layer, i)  # [2, H, n, D] raw bytes
            e = to_gpu.entries[i]
            if e is not None:  # a coded DRAM copy, or a slab that is not page-locked
                core.check_open()
                with reading(core, rec, self._files, during=DURING):
                    part = copy_layer(core, rec, core.buffer(e), layer)
                np.copyto(block.view(part.dtype).reshape(part.shape), part)
            else:
                off, nbytes = rec.layer_span(layer, n * lay.layer_token_bytes)
                into = [block] if rec.codec == 0 else [np.empty(nbytes, dtype=np.uint8)]
                with reading(core, rec, self._files, during=DURING):
                    got = read_layer(core, rec, layer, into, off)
                if got[0] is not block:
                    np.copyto(block, got[0].reshape(-1).view(np.uint8))
        return to_gpu.issue(layer)

    def _load_layer(self, pieces: list[Part], kr: np.ndarray, vr: np.ndarray,
                    layer: int) -> None:
        """Fill layer ``layer`` of the raw outputs kr/vr [L, H, T, D] (loader thread)."""
        core = self.core
        lay = core.layout
        for p in pieces:
            rec, n, a, b = p.rec, p.rec.n_tokens, p.dst, p.dst + p.count
            s, e_ = p.src, p.src + p.count  # the tokens of the chunk it serves
            with core.dram_copy(rec) as e:
                if e is not None:
                    with reading(core, rec, self._files, during=DURING):
                        part = copy_layer(core, rec, core.buffer(e), layer)  # [2, H, n, D]
                    # numpy, not torch: torch's copy would run on the intra-op thread pool
                    # that the compute thread's matmuls use (measured 2x slower prefill)
                    np.copyto(kr[layer, :, a:b], part[0, :, s:e_])  # [H, count, D]
                    np.copyto(vr[layer, :, a:b], part[1, :, s:e_])
                    continue
            lbytes = n * lay.layer_token_bytes
            off, nbytes = rec.layer_span(layer, lbytes)
            whole = p.src == 0 and p.count == n and rec.codec == 0
            if whole:  # straight into the output: K of each head, then V
                bufs = chunk_extent.pieces(kr, vr, a, n, range(layer, layer + 1))
            else:  # the whole layer of the chunk (its checksum covers all of it), then a part
                bufs = [np.empty(nbytes, dtype=np.uint8)]
            with reading(core, rec, self._files, during=DURING):
                bufs = read_layer(core, rec, layer, bufs, off)
            if not whole:
                part = bufs[0].view(kr.dtype).reshape(2, lay.num_kv_heads, n, lay.head_dim)
                np.copyto(kr[layer, :, a:b], part[0, :, s:e_])
                np.copyto(vr[layer, :, a:b], part[1, :, s:e_])


    def _load_group_pages(self, parts: list[Part], pages: Pages, group: list[int]) -> None:
        """Fill layers ``group`` (consecutive) of ``pages`` (loader thread): a raw chunk on
        disk is read straight into its blocks with one read for the group and verified there,
        layer by layer; a DRAM copy (or a coded or partly used chunk, through a buffer) is
        copied into them once."""
        core = self.core
        lay = core.layout
        B = pages.block_tokens
        for p in parts:
            rec, n, s, e_ = p.rec, p.rec.n_tokens, p.src, p.src + p.count
            first = p.dst // B
            with core.dram_copy(rec) as e:
                if e is not None:
                    for layer in group:
                        with reading(core, rec, self._files, during=DURING):
                            part = copy_layer(core, rec, core.buffer(e), layer)
                        pages.scatter(layer, first, part[0, :, s:e_], part[1, :, s:e_])
                    continue
            lbytes = n * lay.layer_token_bytes
            if p.src == 0 and p.count == n and rec.codec == 0:  # in place: K, V of each head
                off, _ = rec.layer_span(group[0], lbytes)
                bufs = [r for layer in group for r in pages.regions(layer, first, n // B)]
                with reading(core, rec, self._files, during=DURING):
                    read_layers(core, rec, group[0], len(group), bufs, off)
                continue
            for layer in group:
                off, nbytes = rec.layer_span(layer, lbytes)
                with reading(core, rec, self._files, during=DURING):
                    got = read_layer(core, rec, layer, [np.empty(nbytes, dtype=np.uint8)], off)
                part = got[0].view(chunk_extent.int_dtype(lay)).reshape(
                    2, lay.num_kv_heads, n, lay.head_dim)
                pages.scatter(layer, first, part[0, :, s:e_], part[1, :, s:e_])


def check_block_aligned(parts: list[Part], block_tokens: int) -> None:
    """ValueError unless every part fills whole blocks of ``block_tokens`` (a load into pages
    places chunks block by block)."""
    for p in parts:
        if p.dst % block_tokens or p.count % block_tokens or p.src % block_tokens:
            raise ValueError(
                f"a load into pages of {block_tokens}-token blocks needs the loaded range and "
                f"the store's chunks ({p.rec.n_tokens} tokens here) on block boundaries")


@dataclass(frozen=True, slots=True)
class Part:
    """Tokens [src, src + count) of chunk ``rec`` placed at offset ``dst`` of a load's output."""

    rec: ChunkRecord
    dst: int
    src: int
    count: int


def covering(pieces: list[Piece], start: int) -> list[Part]:
    """The parts of ``pieces`` (serving tokens 0..n of a request) that serve [start, n), placed
    at offsets from ``start``: chunks wholly before ``start`` are left out, and the chunk that
    ``start`` falls inside contributes its tokens from there on."""
    parts = []
    for p in pieces:
        if p.start + p.use <= start:
            continue
        src = max(start - p.start, 0)
        parts.append(Part(p.rec, p.start + src - start, src, p.use - src))
    return parts
