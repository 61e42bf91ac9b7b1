"""Which tokens of a conversation's history a turn keeps when the history would overflow the
context window: the truncation plan (AttentionStore §3.4, §4.1).

The rule, in one place for every user (``engine.Conversation``, the replay, the benchmarks):
while ``history + needed > window`` (``needed``: the tokens the new turn adds, its message and
its reply), keep the first ``sink`` tokens (attention sinks) and drop the oldest ``drop_ratio``
of the rest, rounded down but at least one token, so every step makes progress. What is left is
the sink tokens, then the newest tokens. A turn that does not fit even when only the sink
tokens are left is an error (``ValueError``), never an endless loop.

Keys are stored before RoPE, so the kept KV is re-positioned to ``0..K-1`` when it is used; no
recompute. The kept KV was computed with the dropped history, so it belongs under the
conversation's own namespace (``docs/store.md``, Namespaces).
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}")
    try:
        v = operator.index(value)  # ints and numpy integers, never floats
    except TypeError:
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}") from None
    if v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v}")
    return v


@dataclass(frozen=True, kw_only=True)
class Truncation:
    """The truncation rule: keep the first ``sink`` tokens, drop the oldest ``drop_ratio`` of
    the rest, repeated while the turn overflows the window (see the module docstring)."""

    drop_ratio: float = 0.5
    sink: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.drop_ratio, bool) or not isinstance(self.drop_ratio, numbers.Real) \
                or not 0.0 < self.drop_ratio < 1.0:
            raise ValueError(f"drop_ratio must be a number in (0, 1), got {self.drop_ratio!r}")
        if isinstance(self.sink, bool) or not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"sink must be a non-negative int, got {self.sink!r}")

    def fits(self, needed: int, window: int) -> bool:
        """Whether a turn needing ``needed`` tokens fits ``window`` after any history, once
        truncated (only the sink tokens left)."""
        return self.sink + _count("needed", needed, 0) <= _count("window", window, 1)

    def kept_length(self, history: int, needed: int, window: int) -> int:
        """How many of the ``history`` tokens are kept so that ``needed`` more tokens fit
        ``window`` (``history`` itself when they already fit).

        Raises ``ValueError`` when the turn cannot fit even with only the sink tokens left.
        """
        n = _count("history", history, 0)
        needed = _count("needed", needed, 0)
        window = _count("window", window, 1)
        if n + needed <= window:
            return n
        sink = min(self.sink, n)
        if sink + needed > window:
            raise ValueError(
                f"a turn needing {needed} tokens (needed) does not fit the window of {window} "
                f"tokens (window) even after dropping everything droppable from a history of "
                f"{n} tokens (history): its {sink} sink tokens (sink={self.sink}) stay")
        while n + needed > window:
            n -= max(1, int((n - sink) * self.drop_ratio))  # n > sink here: progress
        return n

    def kept(self, history: int, needed: int, window: int) -> torch.Tensor:
        """Indices [K] (int64, ascending) of the history tokens kept: the first
        ``min(sink, K)``, then the newest. See :meth:`kept_length` for the arguments."""
        n = _count("history", history, 0)
        k = self.kept_length(n, needed, window)
        sink = min(self.sink, k)
        return torch.cat([torch.arange(sink), torch.arange(n - (k - sink), n)])

    def apply(self, tokens: Sequence[int], keys: torch.Tensor, values: torch.Tensor, *,
              needed: int, window: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Truncate a stored context: ``tokens`` [T], ``keys``/``values`` [L, H, T, D] (keys
        pre-RoPE) so that ``needed`` more tokens fit ``window``. Returns the kept tokens and
        their KV; the kept keys get positions ``0..K-1`` when RoPE is applied on use."""
        n = len(tokens)
        for name, t in (("keys", keys), ("values", values)):
            if t.dim() != 4 or t.shape[2] != n:
                raise ValueError(f"{name} must be [L, H, T, D] with T = len(tokens) = {n}, "
                                 f"got shape {tuple(t.shape)}")
        idx = self.kept(n, needed, window)
        toks = [int(tokens[i]) for i in idx.tolist()]
        return toks, keys.index_select(2, idx), values.index_select(2, idx)
