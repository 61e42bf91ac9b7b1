"""Layer-wise loads (AttentionStore §3.2.1): a loader thread per load fills layer 0, 1, ... of
an execution buffer from the DRAM tier or disk, verified layer by layer; compute waits on each
layer's event. Reads go through :mod:`kvstore.pipelines.chunk_reads`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvstore.errors import StoreClosed
from kvstore.format import chunk_extent
from kvstore.format.records import ChunkRecord
from kvstore.index.lifecycle import IndexFiles
from kvstore.pipelines.chunk_reads import copy_layer, read_layer, reading
from kvstore.pipelines.get import count_lossy, resolve_all
from kvstore.pipelines.layer_load import LayerLoad, Loader
from kvstore.store.parts import Core
from kvstore.tiers.exec_buffers import HbmTier
from kvstore.view.prefix_tree import Piece

DURING = "this layer-wise load"


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


class Loads:
    """Layer-wise loads (AttentionStore §3.2.1): a loader thread per load fills layer 0, 1, ...
    of an execution buffer; compute waits on each layer. The disk slots of the load's chunks
    are pinned until it ends; DRAM copies are pinned one layer at a time.

    Thread-safety: every method may be called from any thread."""

    def __init__(self, core: Core, files: IndexFiles) -> None:
        self.core = core
        self._files = files
        self._loads: set[Loader] = set()  # running loads (not their handles)
        self._hbm_tiers: dict[str, HbmTier] = {}

    def hbm(self, device: torch.device) -> HbmTier:
        """The hbm tier (execution buffers) on ``device``; created on first use (under the
        metadata lock)."""
        key = str(device)
        tier = self._hbm_tiers.get(key)
        if tier is None:
            tier = HbmTier(capacity_bytes=self.core.config.hbm_bytes, device=device)
            self._hbm_tiers[key] = tier
        return tier

    def tiers(self) -> list[HbmTier]:
        return list(self._hbm_tiers.values())

    def running(self) -> list[Loader]:
        with self.core.mutex:
            return list(self._loads)

    def start(self, toks: np.ndarray, namespace: str | None, *, buffer_layers: int | None,
              out: tuple[torch.Tensor, torch.Tensor] | None, device: torch.device,
              start: int = 0) -> LayerLoad:
        """Load positions [start, len(toks)) of the stored ``toks`` (``start`` checked by the
        caller): only the chunks covering them are pinned and read."""
        core = self.core
        n_tok = len(toks) - start
        with core.mutex:
            core.check_open()
            if core.closing:
                raise StoreClosed(f"store {core.path!r} is closing")
            all_pieces = resolve_all(core, toks, namespace)
            pieces = covering(all_pieces, start)
            hbm = self.hbm(device) if out is None else None
            for p in pieces:
                core.slots.pin(p.rec.slot)
                hit = p.rec.key in core.dram
                if hit:
                    core.counters.dram_hits += 1
                else:
                    core.counters.disk_hits += 1
            if not core.readonly:
                core.mirror.touch(all_pieces[-1].rec.key)
            core.counters.gets += 1
            core.counters.served_tokens += n_tok
            count_lossy(core, [Piece(p.rec, p.dst, p.count) for p in pieces])
        slots = [p.rec.slot for p in pieces]

        def unpin() -> None:
            with core.mutex:
                for s in slots:
                    core.slots.unpin(s)

        buf = None
        try:
            if out is None:
                buf = hbm.acquire(core.raw_bytes(n_tok))  # K and V
                kv = buf.view(core.layout.torch_dtype).view(2, *core.layout.kv_shape(n_tok))
                k_out, v_out = kv[0], kv[1]  # [L, H, T, D] each
            else:
                k_out, v_out = out
            copy = _CudaCopy(k_out, v_out) if k_out.device.type == "cuda" else None
        except BaseException:
            if buf is not None:
                hbm.release(buf)
            unpin()
            raise
        kr, vr = ((chunk_extent.raw(copy.host_k), chunk_extent.raw(copy.host_v)) if copy is not None
                  else (chunk_extent.raw(k_out), chunk_extent.raw(v_out)))

        def load_layer(layer: int) -> torch.cuda.Event | None:
            self._load_layer(pieces, kr, vr, layer)
            return None if copy is None else copy.layer(layer)

        loader: list[Loader] = []

        def done() -> None:
            unpin()
            with core.mutex:
                self._loads.discard(loader[0])

        nbytes = 0 if buf is None else buf.numel()
        load = LayerLoad(k_out, v_out, load_layer, buffer_layers=buffer_layers, on_done=done,
                         on_close=None if buf is None else (lambda: hbm.release(buf)),
                         on_abandon=None if buf is None else (lambda: hbm.forget(nbytes)))
        loader.append(load.loader)
        with core.mutex:
            self._loads.add(load.loader)
        try:
            return load.start()
        except BaseException:
            done()
            load.close()
            raise

    def _load_layer(self, pieces: list[Part], kr: np.ndarray, vr: np.ndarray,
                    layer: int) -> None:
        """Fill layer ``layer`` of the raw outputs kr/vr [L, H, T, D] (loader thread)."""
        core = self.core
        lay = core.layout
        for p in pieces:
            rec, n, a, b = p.rec, p.rec.n_tokens, p.dst, p.dst + p.count
            s, e_ = p.src, p.src + p.count  # the tokens of the chunk it serves
            with core.mutex:
                core.check_open()
                e = core.dram.peek(rec.key, rec.gen)
            if e is not None:
                try:
                    with reading(core, rec, self._files, during=DURING):
                        part = copy_layer(core, rec, core.dram.buffer(e), layer)  # [2, H, n, D]
                    # numpy, not torch: torch's copy would run on the intra-op thread pool
                    # that the compute thread's matmuls use (measured 2x slower prefill)
                    np.copyto(kr[layer, :, a:b], part[0, :, s:e_])  # [H, count, D]
                    np.copyto(vr[layer, :, a:b], part[1, :, s:e_])
                finally:
                    with core.mutex:
                        core.dram.unpin(e)
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
