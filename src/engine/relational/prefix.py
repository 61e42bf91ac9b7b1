"""Exact longest-common-prefix statistics of a batch of prompts, and the store's hit model.

Prompts are sequences of *pieces* (token arrays of whole prompt lines, see
:mod:`engine.relational.prompts`). No piece's tokens are a proper prefix of another piece's
(each line's only newline is in its last token), so the token LCP of two prompts is the total
length of their equal leading pieces plus the token LCP of the first pieces that differ.

What the store serves (``kvstore.Store.match``): the full chunks of the prompt that are stored
under the same chain, then, inside the next chunk, the longest common prefix with any stored
chunk that follows the same parent (a partial chunk of a shorter context or a full chunk of a
longer one). Whatever ``chunk_tokens`` is, that is the longest common prefix with any stored
context, so with every earlier prompt of a batch stored (and nothing evicted) a request is
served ``max LCP with the earlier prompts`` tokens, less one when that covers the whole prompt
(a request computes at least its last token: ``Generator`` reuses at most ``len - 1``). The
chunking decides *where* the served tokens come from: see :func:`tier_split`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_BLOCK = 32  # tokens compared per step in lcp_flat


class FlatSeqs:
    """Many int sequences in one flat array, with vectorized pairwise LCP.

    Thread-safety: immutable after construction; safe to share.
    """

    def __init__(self, seqs: Sequence[np.ndarray]) -> None:
        self.lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        self.starts = np.zeros(len(seqs), dtype=np.int64)
        if len(seqs) > 1:
            np.cumsum(self.lens[:-1], out=self.starts[1:])
        self.flat = (np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs])
                     if len(seqs) else np.zeros(0, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.lens)

    def lcp(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """LCP (in tokens) of sequences ``a[k]`` and ``b[k]`` for every k."""
        a = np.asarray(a, dtype=np.int64)
        b = np.asarray(b, dtype=np.int64)
        limit = np.minimum(self.lens[a], self.lens[b])
        out = np.zeros(len(a), dtype=np.int64)
        active = np.nonzero(limit > 0)[0]
        off = 0
        steps = np.arange(_BLOCK, dtype=np.int64)
        while len(active):
            k = off + steps  # [B]
            pos_ok = k[None, :] < limit[active, None]  # [A, B]
            ia = np.minimum(self.starts[a[active], None] + k[None, :], len(self.flat) - 1)
            ib = np.minimum(self.starts[b[active], None] + k[None, :], len(self.flat) - 1)
            same = (self.flat[ia] == self.flat[ib]) & pos_ok  # [A, B]
            run = np.where(same.all(axis=1), _BLOCK, np.argmin(same, axis=1))  # [A]
            out[active] += run
            go_on = (run == _BLOCK) & (off + _BLOCK < limit[active])
            active = active[go_on]
            off += _BLOCK
        return out


def piece_ranks(piece_keys: Sequence[bytes], used: np.ndarray) -> np.ndarray:
    """Rank of each used piece in token-lexicographic order (``piece_keys[p]``: its tokens as
    big-endian uint32 bytes, which compare as the token sequences do); unused pieces get -1."""
    rank = np.full(len(piece_keys), -1, dtype=np.int64)
    ids = sorted(np.unique(used[used >= 0]).tolist(), key=piece_keys.__getitem__)
    rank[ids] = np.arange(len(ids))
    return rank


class PromptSet:
    """The prompts of a batch, sorted, with the exact LCP between any two.

    ``rows[i]`` is prompt i as piece ids, padded with -1. Prompts compare token by token as
    their pieces compare by rank (no piece is a proper prefix of another), so one ``lexsort``
    orders them. LCP(i, j) is the minimum of the neighbour LCPs in sorted order between them,
    answered in O(1) by a sparse table. Thread-safety: immutable after construction.
    """

    def __init__(self, rows: np.ndarray, pieces: Sequence[np.ndarray],
                 piece_keys: Sequence[bytes]) -> None:
        rows = np.asarray(rows, dtype=np.int64)
        if rows.ndim != 2:
            raise ValueError(f"rows must be a 2-D matrix of piece ids, got shape {rows.shape}")
        self.rows = rows
        n = len(rows)
        piece_len = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        valid = rows >= 0
        self.lens = np.where(valid, piece_len[np.maximum(rows, 0)], 0).sum(axis=1)
        rank = piece_ranks(piece_keys, rows)
        ranked = np.where(valid, rank[np.maximum(rows, 0)], -1)
        # lexsort: the last key is the primary one; a shorter prompt sorts before its extensions
        self.sorted = (np.lexsort(ranked.T[::-1]) if n else np.zeros(0, dtype=np.int64))
        self.rank_of = np.empty(n, dtype=np.int64)
        self.rank_of[self.sorted] = np.arange(n)
        self.adjacent = self._adjacent_lcp(pieces, piece_len)  # [n]; adjacent[0] = 0
        self._table = _sparse_table(self.adjacent)

    def _adjacent_lcp(self, pieces: Sequence[np.ndarray], piece_len: np.ndarray) -> np.ndarray:
        """LCP of each prompt in sorted order with the one before it (0 for the first)."""
        n = len(self.rows)
        out = np.zeros(n, dtype=np.int64)
        if n < 2:
            return out
        mat = np.concatenate([self.rows[self.sorted], np.full((n, 1), -1, dtype=np.int64)],
                             axis=1)  # piece ids in sorted order; the -1 column ends every run
        width = mat.shape[1]
        cum = np.zeros((n, width), dtype=np.int64)  # tokens before piece k
        np.cumsum(np.where(mat[:, :-1] >= 0, piece_len[np.maximum(mat[:, :-1], 0)], 0),
                  axis=1, out=cum[:, 1:])
        same = mat[1:] == mat[:-1]  # [n-1, W]
        same[:, -1] = False
        k = np.argmin(same, axis=1)  # the first piece that differs
        rng = np.arange(n - 1)
        lcp = cum[rng + 1, k]
        a, b = mat[1:][rng, k], mat[:-1][rng, k]
        idx = np.flatnonzero((a >= 0) & (b >= 0))
        if len(idx):
            uniq, inv = np.unique(np.concatenate([a[idx], b[idx]]), return_inverse=True)
            flat = FlatSeqs([pieces[int(p)] for p in uniq.tolist()])
            lcp[idx] += flat.lcp(inv[: len(idx)], inv[len(idx):])
        out[1:] = lcp
        return out

    def __len__(self) -> int:
        return len(self.rows)

    def lcp(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Exact token LCP of prompts ``i[k]`` and ``j[k]`` (``i[k] != j[k]``)."""
        ri, rj = self.rank_of[np.asarray(i)], self.rank_of[np.asarray(j)]
        lo, hi = np.minimum(ri, rj) + 1, np.maximum(ri, rj)  # min of adjacent[lo..hi]
        return _range_min(self._table, lo, hi)

    def served_unbounded(self, order: Sequence[int]) -> np.ndarray:
        """For each position of ``order`` (a permutation of the prompts): the longest common
        prefix with any prompt earlier in ``order`` (every earlier prompt stored)."""
        n = len(self.rows)
        order = np.asarray(order, dtype=np.int64)
        if sorted(order.tolist()) != list(range(n)):
            raise ValueError("order must be a permutation of the prompt indices")
        when = np.empty(n, dtype=np.int64)
        when[order] = np.arange(n)
        seq = when[self.sorted].tolist()  # execution position of each sorted rank
        best = np.zeros(n, dtype=np.int64)
        for direction in (1, -1):  # nearest earlier-executed prompt on each side, sorted order
            stack: list[int] = []
            ranks = range(n) if direction == 1 else range(n - 1, -1, -1)
            near = np.full(n, -1, dtype=np.int64)
            for p in ranks:
                while stack and seq[stack[-1]] > seq[p]:
                    stack.pop()
                if stack:
                    near[p] = stack[-1]
                stack.append(p)
            has = np.nonzero(near >= 0)[0]
            if len(has):
                lcp = _range_min(self._table, np.minimum(has, near[has]) + 1,
                                 np.maximum(has, near[has]))
                np.maximum.at(best, has, lcp)
        out = np.zeros(n, dtype=np.int64)
        out[when[self.sorted]] = best  # by execution position
        return out

    def served_window(self, order: Sequence[int], window: int) -> np.ndarray:
        """For each position of ``order``: the longest common prefix with any of the
        ``window`` prompts just before it in ``order``."""
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        order = np.asarray(order, dtype=np.int64)
        n = len(order)
        best = np.zeros(n, dtype=np.int64)
        for s in range(1, min(window, n - 1) + 1):
            np.maximum(best[s:], self.lcp(order[s:], order[:-s]), out=best[s:])
        return best


def _sparse_table(values: np.ndarray) -> list[np.ndarray]:
    table = [values]
    k = 1
    while 2 * k <= len(values):
        prev = table[-1]
        table.append(np.minimum(prev[:-k], prev[k:]))
        k *= 2
    return table


def _range_min(table: list[np.ndarray], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """min(values[lo..hi]) (inclusive) for each pair, lo <= hi."""
    lo = np.asarray(lo, dtype=np.int64)
    hi = np.asarray(hi, dtype=np.int64)
    span = hi - lo + 1
    level = np.floor(np.log2(np.maximum(span, 1))).astype(np.int64)
    out = np.empty(len(lo), dtype=np.int64)
    for lv in np.unique(level).tolist():
        m = level == lv
        t = table[lv]
        out[m] = np.minimum(t[lo[m]], t[hi[m] - (1 << lv) + 1])
    return out


@dataclass(frozen=True, kw_only=True)
class TierHits:
    """Tokens of a batch by where the store would serve them from."""

    prompt_tokens: int
    served: int
    dram: int
    disk: int
    recent_lcp: int  # tokens shared with the recent prompts, wherever the store finds them

    @property
    def recent_lcp_rate(self) -> float:
        return self.recent_lcp / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        return self.served / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def dram_rate(self) -> float:
        return self.dram / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def disk_rate(self) -> float:
        return self.disk / self.prompt_tokens if self.prompt_tokens else 0.0


def served_tokens(lcp: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Tokens a request reuses: its LCP with the stored prompts, at most ``len - 1``."""
    return np.minimum(np.asarray(lcp), np.asarray(lens) - 1).clip(min=0)


def tier_split(unbounded: np.ndarray, recent: np.ndarray, lens: np.ndarray,
               chunk_tokens: int) -> TierHits:
    """Split each request's served tokens between the fast tier (DRAM holding the KV of the
    recent prompts; ``recent`` = LCP with them) and disk (``unbounded`` = LCP with every
    earlier prompt), as the store serves them: the full chunks on the chain of a recent prompt
    come from DRAM; the last, partial piece comes from the stored chunk with the longest common
    prefix, which is a recent one only when the recent prompts reach the whole match."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    lens = np.asarray(lens, dtype=np.int64)
    served = served_tokens(unbounded, lens)
    recent = np.minimum(np.asarray(recent, dtype=np.int64), np.asarray(unbounded))
    fast = np.where(recent == unbounded, recent, chunk_tokens * (recent // chunk_tokens))
    fast = np.minimum(fast, served)
    return TierHits(prompt_tokens=int(lens.sum()), served=int(served.sum()),
                    dram=int(fast.sum()), disk=int((served - fast).sum()),
                    recent_lcp=int(np.minimum(recent, served).sum()))
