"""Pages: an engine's block-paged KV cache, which loads fill and saves read in place.

Serving engines keep KV in fixed-size blocks of ``block_tokens`` tokens (vLLM's paged KV
cache). A :class:`Pages` names, for one load or one save, the engine's per-layer block tensors
and the blocks that hold consecutive runs of ``block_tokens`` tokens. Within a block, each kv
head has ``block_tokens * head_dim`` elements of K followed by as many of V, in whatever order
the engine packs them inside that region: the store moves those bytes as they are. The bytes
of a block region then become the stored ``[block_tokens, head_dim]`` rows of that head, so a
layout whose engine packs its pages must name the packing and the block size in
``KVLayout.engine`` (the fingerprint): pages are only served to an engine that packs the same.

A load into pages writes each layer straight into the blocks (disk reads land there, verified
in place; DRAM copies are copied once), with no execution buffer in between; a save copies the
blocks straight into its write buffer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.format.chunk_extent import raw
from kvstore.layout import KVLayout
from kvstore.view.prefix_tree import Piece, served


@dataclass(frozen=True, kw_only=True, eq=False)
class Pages:
    """Blocks ``block_ids`` of an engine's paged KV cache, holding tokens ``[0, num_tokens)``
    of one load or save (block ``block_ids[i]`` holds tokens ``i * block_tokens ..``).

    ``layers``: per layer a CPU tensor [num_blocks, num_kv_heads, 2 (K, V),
    block_tokens * head_dim] in the layout's dtype (a view of the engine's cache: vLLM's
    [num_blocks, H, block_tokens, 2 * head_dim] viewed so, :meth:`of`). ``layer_block_ids``
    (optional): each layer's own block ids, as many as ``block_ids``, where layers keep their
    blocks in separate tables (vLLM's KV-cache groups of a hybrid model).

    Thread-safety: the record is immutable; :meth:`scatter` and :meth:`gather` write the
    engine's blocks or the caller's rows, so one thread at a time may write a given block
    (a load's loader thread fills its blocks while the engine reads others).
    """

    layers: tuple[torch.Tensor, ...]
    block_ids: tuple[int, ...]
    block_tokens: int
    layer_block_ids: tuple[tuple[int, ...], ...] | None = None

    def ids(self, layer: int) -> tuple[int, ...]:
        """The block ids of ``layer``."""
        return self.block_ids if self.layer_block_ids is None else self.layer_block_ids[layer]

    @classmethod
    def of(cls, caches: list[torch.Tensor] | tuple[torch.Tensor, ...], block_ids,
           block_tokens: int) -> Pages:
        """Pages over per-layer caches [num_blocks, H, block_tokens, 2 * head_dim] (vLLM's CPU
        layout: each (block, head) row holds K's block_tokens * head_dim elements, then V's)."""
        views = []
        for c in caches:
            nb, h, b, d2 = c.shape
            if b != block_tokens:
                raise ValueError(f"caches must have block_tokens={block_tokens} rows per block, "
                                 f"got shape {list(c.shape)}")
            views.append(c.view(nb, h, 2, b * d2 // 2))
        return cls(layers=tuple(views), block_ids=tuple(int(b) for b in block_ids),
                   block_tokens=block_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.block_ids) * self.block_tokens

    def check(self, layout: KVLayout) -> Pages:
        """``self`` if it fits ``layout``, else ValueError naming what does not."""
        B = self.block_tokens
        if isinstance(B, bool) or not isinstance(B, int) or B <= 0:
            raise ValueError(f"pages.block_tokens must be an int > 0, got {B!r}")
        if len(self.layers) != layout.num_layers:
            raise ValueError(f"pages.layers must hold {layout.num_layers} layers, got "
                             f"{len(self.layers)}")
        if not self.block_ids:
            raise ValueError("pages.block_ids is empty")
        if self.layer_block_ids is not None and (
                len(self.layer_block_ids) != len(self.layers)
                or any(len(ids) != len(self.block_ids) for ids in self.layer_block_ids)):
            raise ValueError("pages.layer_block_ids must give every layer as many block ids "
                             "as block_ids")
        for layer in range(layout.num_layers):
            self.check_layer(layout, layer)
        return self

    def check_layer(self, layout: KVLayout, layer: int) -> None:
        """ValueError unless layer ``layer``'s tensor fits ``layout`` and holds every block."""
        B, H, D = self.block_tokens, layout.num_kv_heads, layout.head_dim
        t = self.layers[layer]
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" \
                or t.dtype != layout.torch_dtype:
            raise ValueError(f"pages.layers must be CPU tensors of {layout.dtype}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} on "
                             f"{getattr(t, 'device', '?')}")
        if t.dim() != 4 or tuple(t.shape[1:]) != (H, 2, B * D) or t.stride(3) != 1:
            raise ValueError(f"pages.layers must be [num_blocks, {H}, 2, {B * D}] with "
                             f"contiguous rows, got {list(t.shape)}")
        lo, hi = min(self.ids(layer)), max(self.ids(layer))
        if lo < 0 or hi >= t.shape[0]:
            raise ValueError(f"pages.block_ids must be in [0, {t.shape[0]}), got {lo}..{hi}")

    def runs(self, first: int = 0, count: int | None = None, layer: int = 0
             ) -> list[tuple[int, int, int]]:
        """Runs of consecutive block ids of ``layer`` among blocks ``first .. first + count -
        1``: (index in its block ids, first block id, length)."""
        ids = self.ids(layer)
        stop = len(ids) if count is None else first + count
        runs: list[tuple[int, int, int]] = []
        for i in range(first, stop):
            b = ids[i]
            if runs and runs[-1][1] + runs[-1][2] == b:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((i, b, 1))
        return runs

    @functools.cached_property
    def _raw(self) -> list[np.ndarray]:
        """Per layer a raw integer view [NB, H, 2, B*D] of its tensor (made once)."""
        return [raw(t) for t in self.layers]

    def regions(self, layer: int, first: int, count: int) -> list[np.ndarray]:
        """Raw views of blocks ``first .. first + count - 1`` of ``layer`` in a chunk extent's
        layer order: for K then V, for each head, each block's region ([block_tokens *
        head_dim] elements each): what a read of those tokens' layer fills in place."""
        t = self._raw[layer]  # [NB, H, 2, B*D]
        ids = self.ids(layer)[first:first + count]
        return [t[b, h, kv] for kv in range(2) for h in range(t.shape[1]) for b in ids]

    def scatter(self, layer: int, first: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write raw rows ``k``, ``v`` [H, n * block_tokens, D] (one layer's K and V, rows
        contiguous) into blocks ``first .. first + n - 1`` of ``layer``: one copy per run of
        consecutive blocks and K/V (numpy: one thread, the GIL released)."""
        for dst, src in self._pairs(layer, first, k, v):
            np.copyto(dst, src)

    def gather(self, layer: int, first: int, k: np.ndarray, v: np.ndarray) -> None:
        """Read blocks ``first ..`` of ``layer`` into raw rows ``k``, ``v`` [H, n *
        block_tokens, D] (the inverse of :meth:`scatter`)."""
        for blocks, rows in self._pairs(layer, first, k, v):
            np.copyto(rows, blocks)

    def _pairs(self, layer: int, first: int, k: np.ndarray, v: np.ndarray
               ) -> list[tuple[np.ndarray, np.ndarray]]:
        """(blocks, rows) views per run and K/V: [H, c, B*D] each, the same elements."""
        B = self.block_tokens
        assert k.shape == v.shape and k.shape[1] % B == 0, (k.shape, v.shape, B)
        H, n, D = k.shape
        t = self._raw[layer]  # [NB, H, 2, B*D]
        pairs = []
        for i, b, c in self.runs(first, n // B, layer):
            a = (i - first) * B
            for kv, rows in ((0, k), (1, v)):
                part = rows[:, a:a + c * B]  # [H, c*B, D]
                assert part.strides[1:] == (D * part.itemsize, part.itemsize), part.strides
                view = np.lib.stride_tricks.as_strided(
                    part, (H, c, B * D), (part.strides[0], B * D * part.itemsize,
                                          part.itemsize))
                pairs.append((t[b:b + c, :, kv].transpose(1, 0, 2), view))  # [H, c, B*D]
        return pairs



def to_block_end(toks: np.ndarray, pieces: list[Piece], end: int) -> np.ndarray:
    """``toks`` continued to ``end`` with the tokens of the chunk that holds the last of them
    (``pieces``: the local pieces serving ``toks``): a load into pages fills its last block
    whole. KeyError unless ``pieces`` serve every token and that chunk reaches ``end``."""
    if served(pieces) < len(toks):
        raise KeyError(f"the store holds {served(pieces)} of the {len(toks)} tokens here "
                       f"(a load ending inside a block needs that block's chunk locally)")
    last = pieces[-1]
    if end - last.start > last.rec.n_tokens:
        raise KeyError(f"the stored chunk holding tokens {last.start}.. has "
                       f"{last.rec.n_tokens} tokens: it does not fill the load's last "
                       f"block (to {end})")
    return np.concatenate([toks[:last.start], last.rec.tokens[:end - last.start]])
