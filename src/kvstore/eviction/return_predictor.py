"""Whether a conversation comes back, predicted from the turn that just ended, learned online.

LPC (Learned Prefix Caching, NeurIPS'25) predicts from a turn's content whether the user will
continue. :class:`ReturnPredictor` is a logistic regression over hashed sparse features of the
turn a save ends (:func:`turn_features`): its position in the conversation, its lengths, the
time since the previous turn, and the token ids at the head and tail of what the turn added
(the user's message and the reply: "thanks!" ends conversations, a question in the reply
invites one more turn). Labels come from what the owner sees afterwards: the conversation came
back (1) or stayed away longer than every think time seen (0; taken back if it returns after
all). Training is AdaGrad, one step per label, in a fixed order: deterministic, no randomness
at all, no GPU and nothing to download. The state is two float32 vectors of ``dims`` entries
(8 KiB at the default 1024), saved with :meth:`to_bytes` and checked by :meth:`from_bytes`.

Measured on the ShareGPT file (docs/benchmarks/retention.md): content adds about a point of
AUC over position and lengths alone; the signal is weaker than LPC reports with a trained
text encoder, and the policy that uses it is measured as such.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Feature families: each hashes into the same weight vector with its own salt.
_BIAS, _TURN, _NEW, _HISTORY, _GAP, _HEAD, _TAIL = range(7)
CONTENT_TOKENS = 32  # ids at the head and at the tail of what the turn added

_MAGIC = b"KVRP"
_VERSION = 1


@dataclass(frozen=True, slots=True)
class TurnFeatures:
    """Sparse features: ``index`` into the weight vector, ``value`` each (same length)."""

    index: np.ndarray  # [n] int64
    value: np.ndarray  # [n] float32

    def __post_init__(self) -> None:
        assert self.index.shape == self.value.shape, (self.index.shape, self.value.shape)


def _bucket(x: float) -> int:
    """0, 1, 2-3, 4-7, ... (log2 buckets of a non-negative count)."""
    return int(max(0.0, x)).bit_length()


def _slot(family: int, value: int, dims: int) -> int:
    h = (value * 0x9E3779B1 + family * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
    h ^= h >> 12
    return h % dims


def turn_features(*, turns: int, new_tokens: int, history_tokens: int, gap_s: float | None,
                  head: Sequence[int] = (), tail: Sequence[int] = (),
                  dims: int = 1024) -> TurnFeatures:
    """The features of a save that ends a conversation's ``turns``-th turn: ``new_tokens`` the
    turn added (message and reply), ``history_tokens`` in the whole context, ``gap_s`` since
    the previous turn's save (None on the first), ``head`` / ``tail``: token ids at the start
    and end of what the turn added (at most :data:`CONTENT_TOKENS` each are used)."""
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns!r}")
    idx = [_slot(_BIAS, 0, dims), _slot(_TURN, min(turns, 16), dims),
           _slot(_NEW, _bucket(new_tokens), dims), _slot(_HISTORY, _bucket(history_tokens), dims),
           _slot(_GAP, 0 if gap_s is None else 1 + _bucket(gap_s), dims)]
    val = [1.0] * len(idx)
    for family, ids in ((_HEAD, head[:CONTENT_TOKENS]), (_TAIL, tail[-CONTENT_TOKENS:])):
        uniq = sorted(set(int(t) for t in ids))
        if uniq:
            w = 1.0 / math.sqrt(len(uniq))
            idx.extend(_slot(family, t, dims) for t in uniq)
            val.extend([w] * len(uniq))
    return TurnFeatures(index=np.asarray(idx, dtype=np.int64),
                        value=np.asarray(val, dtype=np.float32))


class ReturnPredictor:
    """P(the conversation has another turn | the features of the turn that ended).

    ``observe(features, label)`` takes one AdaGrad step of the logistic loss (an owner that
    learns an earlier label was wrong observes the right one: the step towards it outweighs
    the wrong one's); ``predict(features)`` is the probability. ``seen`` counts labels. Before
    ``min_labels`` labels it predicts ``prior`` (the owner's fallback). Thread-safety: none;
    the owner serializes access.
    """

    def __init__(self, *, dims: int = 1024, rate: float = 0.1, min_labels: int = 50) -> None:
        if isinstance(dims, bool) or not isinstance(dims, int) or dims < 8:
            raise ValueError(f"dims must be an int >= 8, got {dims!r}")
        if not rate > 0:
            raise ValueError(f"rate must be positive, got {rate!r}")
        self.dims = dims
        self.rate = float(rate)
        self.min_labels = int(min_labels)
        self.weights = np.zeros(dims, dtype=np.float32)  # [dims]
        self.grad_sq = np.full(dims, 1e-6, dtype=np.float32)  # [dims] AdaGrad accumulators
        self.seen = 0
        self.scores = ProgressiveScores()  # this process's, not saved with the state

    @property
    def ready(self) -> bool:
        return self.seen >= self.min_labels

    def features(self, **kw) -> TurnFeatures:
        """:func:`turn_features` at this predictor's ``dims``."""
        return turn_features(dims=self.dims, **kw)

    def predict(self, f: TurnFeatures, prior: float | None = None) -> float:
        """The probability; ``prior``: the owner's own estimate (the rate at the turn count),
        which the features then correct (its logit is the model's offset)."""
        z = float(self.weights[f.index] @ f.value) + _logit(prior)
        return 1.0 / (1.0 + math.exp(-max(-30.0, min(30.0, z))))

    def observe(self, f: TurnFeatures, label: int, prior: float | None = None, *,
                correction: bool = False) -> None:
        """One label: 1 the conversation came back, 0 it ended (``prior``: as
        :meth:`predict` took it). Once :attr:`ready`, the prediction it makes for the label
        before learning from it is scored (:attr:`scores`), unless the label corrects one
        observed earlier (``correction``: a return after its end was labelled)."""
        if label not in (0, 1):
            raise ValueError(f"label must be 0 or 1, got {label!r}")
        p = self.predict(f, prior)
        if self.ready and not correction:
            self.scores.add(p, label)
        g = (p - label) * f.value  # [n]
        # np.add.at: a hashed index may repeat within one feature vector
        np.add.at(self.grad_sq, f.index, g * g)
        np.add.at(self.weights, f.index, -self.rate * g / np.sqrt(self.grad_sq[f.index]))
        self.seen += 1

    # ------------------------------------------------------------------ persistence
    def to_bytes(self) -> bytes:
        head = struct.pack("<4sIIIQd", _MAGIC, _VERSION, self.dims, self.min_labels, self.seen,
                           self.rate)
        return head + self.weights.tobytes() + self.grad_sq.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> ReturnPredictor:
        """A predictor saved by :meth:`to_bytes`; ``ValueError`` for anything else (the bytes
        come from a store directory: untrusted)."""
        n = struct.calcsize("<4sIIIQd")
        if len(data) < n:
            raise ValueError("return predictor state: too short")
        magic, version, dims, min_labels, seen, rate = struct.unpack_from("<4sIIIQd", data)
        if magic != _MAGIC or version != _VERSION:
            raise ValueError("return predictor state: not a predictor of this version")
        if not 8 <= dims <= 1 << 20 or len(data) != n + 8 * dims:
            raise ValueError(f"return predictor state: {len(data)} bytes for {dims} dims")
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError("return predictor state: bad rate")
        p = cls(dims=dims, rate=rate, min_labels=min_labels)
        w = np.frombuffer(data, dtype=np.float32, count=dims, offset=n).copy()
        g = np.frombuffer(data, dtype=np.float32, count=dims, offset=n + 4 * dims).copy()
        if not (np.isfinite(w).all() and np.isfinite(g).all() and (g > 0).all()):
            raise ValueError("return predictor state: weights not finite")
        p.weights, p.grad_sq, p.seen = w, g, int(seen)
        return p


class ProgressiveScores:
    """How well a predictor predicts labels it has not learned yet (progressive validation):
    each label is scored by the predictor as it stands when the label arrives, before it
    learns from it. Two histograms of the predicted probability (:attr:`BINS` bins per
    label), so the memory is constant and the AUC exact but for ties within a bin.
    Thread-safety: none; the owner serializes access."""

    BINS = 1000

    def __init__(self) -> None:
        self.counts = np.zeros((2, self.BINS), dtype=np.int64)  # [label, bin]

    def add(self, p: float, label: int) -> None:
        self.counts[label, min(int(p * self.BINS), self.BINS - 1)] += 1

    @property
    def labels(self) -> int:
        return int(self.counts.sum())

    def auc(self) -> float:
        """The area under the ROC curve of the scored labels (ties, here a shared bin,
        count half); NaN without both labels."""
        neg, pos = self.counts[0].astype(np.float64), self.counts[1].astype(np.float64)
        n_neg, n_pos = neg.sum(), pos.sum()
        if n_neg == 0 or n_pos == 0:
            return math.nan
        below = np.cumsum(neg) - neg  # [bins] negatives in lower bins
        return float((pos * (below + neg / 2)).sum() / (n_pos * n_neg))

    def summary(self) -> dict[str, float | int | None]:
        """``labels`` scored, their ``auc`` (None until both labels were seen) and
        ``continue_rate`` (the share that came back; None before any)."""
        n = self.labels
        a = self.auc()
        return {"labels": n, "auc": None if math.isnan(a) else a,
                "continue_rate": None if n == 0 else int(self.counts[1].sum()) / n}


def _logit(p: float | None) -> float:
    if p is None:
        return 0.0
    p = min(max(p, 1e-4), 1.0 - 1e-4)
    return math.log(p / (1.0 - p))


def auc(labels: Sequence[int] | np.ndarray, scores: Sequence[float] | np.ndarray) -> float:
    """Area under the ROC curve (ties count half); NaN without both labels."""
    y = np.asarray(labels, dtype=bool)
    s = np.asarray(scores, dtype=np.float64)
    assert y.shape == s.shape, (y.shape, s.shape)
    pos = int(y.sum())
    neg = len(y) - pos
    if pos == 0 or neg == 0:
        return math.nan
    _, inv, cnt = np.unique(s, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(cnt) - (cnt - 1) / 2.0)[inv]  # average rank of each tie group, 1-based
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))
