"""Field orders for one family of calls (same instruction and field names).

The input is the matrix ``P[row, field]`` of piece ids (one per rendered ``name: value`` line)
and the token length of every piece. Each strategy returns ``orders[row]``: the fields of that
row's prompt, first to last.

- :func:`original_order`: the order the query wrote the arguments in.
- :func:`paper_order`: LLM-SQL's fixed rule (Algorithm 1): every row gets one order, by
  ``score(field) = average tokens of its lines x rows / distinct values``, highest first.
- :func:`group_orders`: the per-group planner (the paper's "future work", the GGR idea of
  greedy group recursion): rows are split into groups by the values of the field that saves
  them the most tokens when it leads, and each group's remaining fields are planned again,
  separately, so different groups get different orders. A value's saving counts the fields it
  determines within its group (a film's title determines its cast): a plain per-value count
  puts a short, frequent value (a genre) first and splits every longer shared run behind it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def original_order(P: np.ndarray) -> np.ndarray:
    n, m = P.shape
    return np.broadcast_to(np.arange(m), (n, m)).copy()


def paper_scores(P: np.ndarray, piece_len: np.ndarray) -> np.ndarray:
    """The paper's column score: ASL x rows / cardinality (ASL in tokens of the line)."""
    n, m = P.shape
    scores = np.zeros(m)
    for f in range(m):
        col = P[:, f]
        scores[f] = piece_len[col].mean() * n / len(np.unique(col))
    return scores


def paper_field_order(P: np.ndarray, piece_len: np.ndarray) -> list[int]:
    """Fields by descending paper score (ties: argument order)."""
    s = paper_scores(P, piece_len)
    return sorted(range(P.shape[1]), key=lambda f: (-s[f], f))


def paper_order(P: np.ndarray, piece_len: np.ndarray) -> np.ndarray:
    n, m = P.shape
    return np.broadcast_to(np.asarray(paper_field_order(P, piece_len)), (n, m)).copy()


def group_orders(P: np.ndarray, piece_len: np.ndarray,
                 fallback: Sequence[int] | None = None) -> np.ndarray:
    """The per-group order of every row (recursive; all groups of one depth at once).

    A group of rows that share a prefix picks the field that saves it the most tokens when it
    leads: for each value of the field held by ``c >= 2`` rows, ``(c - 1)`` times the tokens of
    its line *plus* the lines of the other fields that are constant on those rows (a value
    that determines others, such as a film's title determining its cast, leads them all). Each
    such value's rows become a group: the field, then its constant fields, then the group's
    other fields planned again, separately. Rows whose value is unique are planned again as a
    group of their own at the same position, so they can lead with another field. A group in
    which no field is shared by two rows keeps ``fallback`` (default: the paper's order) for
    its remaining fields. Ties go to the earlier field. Deterministic.
    """
    n, m = P.shape
    if fallback is None:
        fallback = paper_field_order(P, piece_len)
    fallback = [int(f) for f in fallback]
    if sorted(fallback) != list(range(m)):
        raise ValueError(f"fallback must be a permutation of range({m}), got {fallback}")
    orders = np.full((n, m), -1, dtype=np.int64)
    if n == 0 or m == 0:
        return orders.reshape(n, m) if m else np.zeros((n, 0), dtype=np.int64)
    L = piece_len[P].astype(np.int64)  # [n, m] tokens of each line
    used = np.zeros((n, m), dtype=bool)
    depth = np.zeros(n, dtype=np.int64)
    node = np.zeros(n, dtype=np.int64)
    active = np.ones(n, dtype=bool)
    next_node = 1
    span = int(P.max()) + 1

    def finish(rows: np.ndarray) -> None:  # rows of one node: the fallback for what is left
        free = [f for f in fallback if not used[rows[0], f]]
        d = int(depth[rows[0]])
        orders[rows, d:] = free

    while active.any():
        A = np.flatnonzero(active)
        uniq, ni = np.unique(node[A], return_inverse=True)  # node index of each active row
        K = len(uniq)
        gains = np.zeros((K, m))
        cand: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        for f in range(m):
            free = ~used[A, f]  # the same for every row of a node
            rows, rni = A[free], ni[free]
            if len(rows) < 2:
                continue
            key = rni * span + P[rows, f]
            o = np.argsort(key, kind="stable")
            ks, grows, gni = key[o], rows[o], rni[o]
            starts = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]])
            counts = np.diff(np.r_[starts, len(ks)])
            first = grows[starts]
            const = np.zeros((len(starts), m), dtype=bool)
            for f2 in range(m):
                if f2 == f:
                    continue
                col = P[grows, f2]
                const[:, f2] = ((np.minimum.reduceat(col, starts)
                                 == np.maximum.reduceat(col, starts)) & ~used[first, f2])
            tokens = L[first, f] + (np.where(const, L[first], 0)).sum(axis=1)
            gain = (counts - 1) * tokens
            gains[:, f] = np.bincount(gni[starts], weights=gain, minlength=K)
            cand[f] = (grows, starts, counts, gni[starts], const)
        best = np.argmax(gains, axis=1)  # first maximum: the earlier field
        positive = gains[np.arange(K), best] > 0
        # Groups with nothing shared keep the fallback for their remaining fields.
        done = ~positive[ni]
        if done.any():
            rows = A[done]
            o = np.argsort(ni[done], kind="stable")
            rows, rn = rows[o], ni[done][o]
            cuts = np.flatnonzero(np.r_[True, rn[1:] != rn[:-1]])
            for a, b in zip(cuts, np.r_[cuts[1:], len(rows)], strict=True):
                finish(rows[a:b])
            active[rows] = False
        rest_node = {}  # parent node index -> node of its rows with a unique value
        for f, (grows, starts, counts, gnode, const) in cand.items():
            pick = np.flatnonzero(positive[gnode] & (best[gnode] == f))
            for g in pick.tolist():
                rows = grows[starts[g]: starts[g] + counts[g]]
                if counts[g] == 1:
                    parent = int(gnode[g])
                    if parent not in rest_node:
                        rest_node[parent] = next_node
                        next_node += 1
                    node[rows] = rest_node[parent]
                    continue
                fields = [f] + [f2 for f2 in fallback if const[g, f2]]
                d = int(depth[rows[0]])
                orders[rows, d: d + len(fields)] = fields
                used[np.ix_(rows, fields)] = True
                depth[rows] += len(fields)
                node[rows] = next_node
                next_node += 1
                if depth[rows[0]] == m:
                    active[rows] = False
    return orders
