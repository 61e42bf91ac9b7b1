"""The boundary state of a hybrid model in vLLM's blocks: which blocks a load fills or a save
reads (scheduler side), and the bytes moved between those blocks and the store (worker side).

A boundary after ``n`` tokens (:mod:`.groups`) needs, besides the full-attention blocks the
store's chunks hold, each sliding group's window blocks and each recurrent group's state block.
The scheduler names them by block id in a :class:`StatePlan`; the worker gathers their pages
into one state (a save) or scatters a stored state into them (a load), checking its length
first: a state of another length is not this configuration's, and is refused as corrupt.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvstore.errors import CorruptData
from kvstore.integrations.vllm.groups import Groups

SKIP = -1  # a window block a load leaves alone: vLLM's own prefix cache filled it


@dataclass(frozen=True, kw_only=True)
class StatePlan:
    """The blocks of one boundary's state: ``boundary`` tokens; per sliding group the block
    ids of its window blocks (``SKIP``: not written by a load); per recurrent group the block
    holding its state."""

    boundary: int
    sliding: tuple[tuple[int, ...], ...]
    recurrent: tuple[int, ...]


def state_plan(groups: Groups, block_ids: tuple[list[int], ...], n: int, *,
               keep_below: int = 0) -> StatePlan:
    """The state blocks of a boundary after ``n`` tokens in a request's tables ``block_ids``
    (per group, as vLLM gives them). ``keep_below``: for a load, the tokens vLLM's own cache
    holds (window blocks before that are its own, not written)."""
    sliding = []
    for g in groups.sliding:
        ids = block_ids[g.index]
        first_kept = keep_below // g.block_size
        sliding.append(tuple(SKIP if j < first_kept else int(ids[j])
                             for j in g.window_blocks(n)))
    recurrent = tuple(int(block_ids[g.index][g.state_index(n)]) for g in groups.recurrent)
    return StatePlan(boundary=n, sliding=tuple(sliding), recurrent=recurrent)


def full_block_ids(groups: Groups, block_ids: tuple[list[int], ...], lo: int, hi: int
                   ) -> tuple[tuple[int, ...], ...]:
    """Blocks ``lo .. hi - 1`` of each full-attention group's table."""
    return tuple(tuple(int(b) for b in block_ids[g.index][lo:hi]) for g in groups.full)


class StatePages:
    """The registered pages of a hybrid model's sliding and recurrent layers, as raw bytes
    [num_blocks, page bytes] per layer. Thread-safety: as vLLM calls the worker (its forward
    thread)."""

    def __init__(self, groups: Groups, kv_caches: dict[str, torch.Tensor]) -> None:
        self.groups = groups
        self._pages: dict[str, np.ndarray] = {}
        for g in groups.sliding + groups.recurrent:
            for name in g.layers:
                t = kv_caches[name]
                if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dim() < 2 \
                        or not t[0].is_contiguous() \
                        or t[0].numel() * t.element_size() < g.page_bytes:
                    raise ValueError(f"the KVStoreConnector needs layer {name}'s KV cache as "
                                     f"one CPU tensor of {g.page_bytes}-byte pages, got "
                                     f"{getattr(t, 'shape', type(t).__name__)}")
                u = t.view(torch.uint8).numpy()  # the same memory, strides in bytes
                self._pages[name] = np.lib.stride_tricks.as_strided(  # [NB, page bytes]
                    u, shape=(t.shape[0], g.page_bytes), strides=(u.strides[0], 1))

    def gather(self, plan: StatePlan) -> np.ndarray:
        """The state of ``plan``'s boundary, copied out of the blocks (uint8)."""
        parts = []
        for g, ids in zip(self.groups.sliding, plan.sliding, strict=True):
            for name in g.layers:
                parts += [self._pages[name][b] for b in ids]
        for g, b in zip(self.groups.recurrent, plan.recurrent, strict=True):
            parts += [self._pages[name][b] for name in g.layers]
        return np.concatenate(parts)

    def scatter(self, plan: StatePlan, state: bytes) -> None:
        """Write a stored state into ``plan``'s blocks; CorruptData (nothing written) if its
        length is not this configuration's for the boundary."""
        want = self.groups.state_size(plan.boundary)
        if len(state) != want:
            raise CorruptData(f"a stored boundary state of {len(state)} bytes, expected "
                              f"{want} after {plan.boundary} tokens")
        src = np.frombuffer(state, dtype=np.uint8)
        at = 0
        for g, ids in zip(self.groups.sliding, plan.sliding, strict=True):
            for name in g.layers:
                for b in ids:
                    if b != SKIP:
                        self._pages[name][b] = src[at:at + g.page_bytes]
                    at += g.page_bytes
        for g, b in zip(self.groups.recurrent, plan.recurrent, strict=True):
            for name in g.layers:
                self._pages[name][b] = src[at:at + g.page_bytes]
                at += g.page_bytes
        assert at == want
