"""The truncation rule of engine.truncation done by hand, step by step, on explicit index lists
(the oracle of the truncation and replay tests)."""

from __future__ import annotations


def reference_kept(history, needed, window, drop_ratio, sink):
    """The rule done by hand on the list of token indices: while the turn overflows, keep the
    first ``sink`` entries and drop the oldest ``drop_ratio`` of the others (at least one).
    None when nothing is left to drop and it still overflows."""
    idx = list(range(history))
    while len(idx) + needed > window:
        head, rest = idx[:sink], idx[sink:]
        if not rest:
            return None
        drop = int(len(rest) * drop_ratio)
        idx = head + rest[max(drop, 1):]
    return idx
