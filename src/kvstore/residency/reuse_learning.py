"""What a learning eviction policy (``reuse``) learns from this process's puts.

A put whose tokens strictly extend a context saved earlier is that conversation coming back:
``now - saved_at`` of the earlier context is one think-time sample at its turn count, and the
new context has one turn more. It is learned as the put is planned (before it makes room),
whether or not admission then stores it. The earlier context need not still be stored (it may
have been superseded or evicted): saved contexts are remembered by their last chunk's address,
which a longer put's chain contains when that chunk is full; a partial last chunk is found
through its parent's address and its length (one hash per candidate). Contexts this process
did not save (found at open, or put by another process) are ranked from when it first saw
them, with one turn, and never counted as returns or ends.

Time is the policy's ``clock`` (seconds; injectable), and priorities that depend on it are
re-ranked (unqueued ones in one vectorized pass) at most every twentieth of the mean think
time seen, before an eviction (the tree's heap replaces a key's priority on push: no loop
runs in the background).

Thread-safety: none of its own; every method is called with the store's metadata lock held.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvstore.eviction.policies import AccessStats, LearnedReturn, Queued, ReuseProbability
from kvstore.eviction.reranking import Reranking
from kvstore.eviction.return_predictor import CONTENT_TOKENS, TurnFeatures
from kvstore.eviction.returns import MAX_PENDING_LABELS, ReturnTracker
from kvstore.format.hashing import chunk_hash
from kvstore.format.records import ContextRecord
from kvstore.view.prefix_tree import ContextTree


class PutLearner:
    """Feeds ``policy.model`` from puts and gives the policy each context's statistics."""

    def __init__(self, policy: ReuseProbability, tree: ContextTree) -> None:
        self.policy = policy
        self.tree = tree
        self.tracker = ReturnTracker(policy.model)
        self._partial: dict[bytes, dict[bytes, int]] = {}  # parent -> {context: its tokens}
        self._parent: dict[bytes, bytes] = {}  # context (partial last chunk) -> parent
        self.reranking = Reranking(policy, self.tracker)
        # ``learned``: what each tracked context's last turn looked like (its put)
        self._features: dict[bytes, TurnFeatures] | None = \
            {} if isinstance(policy, LearnedReturn) else None

    def now(self) -> float:
        t = float(self.policy.clock())
        self.policy.now = t
        return t

    # ------------------------------------------------------------------ statistics
    def stats(self, rec: ContextRecord) -> AccessStats:
        """The policy's view of a stored context (first seen now if it was not saved here)."""
        info = self.tracker.info(rec.key)
        if info is None:
            self._track(rec.key, self.now(), 1, learn=False)
            info = self.tracker.info(rec.key)
        at, turns = info  # type: ignore[misc]
        return AccessStats(inserted=rec.created, last_access=rec.last_access,
                           tokens=rec.n_tokens, turns=turns, saved_at=at, key=rec.key,
                           features=None if self._features is None
                           else self._features.get(rec.key))

    def _track(self, key: bytes, now: float, turns: int, *, learn: bool,
               partial: tuple[bytes, int] | None = None,
               features: TurnFeatures | None = None) -> None:
        """``partial``: (parent, tokens) of the context's last chunk when it is not full (else
        looked up in the tree, where a stored context's last chunk is); ``features``: what its
        last turn looked like (``learned``)."""
        self.tracker.saved(key, now, turns, learn=learn, features=features)
        if partial is None:
            last = self.tree.chunks.get(key)
            if last is not None and last.n_tokens < self.tree.chunk_tokens:
                partial = (last.parent, last.n_tokens)
        if partial is not None:
            self._untrack_partial(key)
            self._partial.setdefault(partial[0], {})[key] = partial[1]
            self._parent[key] = partial[0]

    def _untrack_partial(self, key: bytes) -> None:
        parent = self._parent.pop(key, None)
        if parent is not None:
            kids = self._partial[parent]
            del kids[key]
            if not kids:
                del self._partial[parent]

    # ------------------------------------------------------------------ puts
    def extended(self, toks: np.ndarray, chain: list[bytes], namespace: str | None
                 ) -> list[tuple[bytes, int]]:
        """Remembered contexts whose tokens are a strict prefix of ``toks`` (``chain``: its
        chunks' addresses), stored or not, with their lengths."""
        c = self.tree.chunk_tokens
        parent = self.tree.seed(namespace)
        out = []
        for i, key in enumerate(chain):
            if key in self.tracker and (i + 1) * c < len(toks):
                out.append((key, (i + 1) * c))  # a context ending with this full chunk
            for ctx, m in self._partial.get(parent, {}).items():
                if i * c + m < len(toks) and chunk_hash(parent, toks[i * c : i * c + m]) == ctx:
                    out.append((ctx, i * c + m))
            parent = key
        return out

    def arrived(self, toks: np.ndarray, chain: list[bytes], namespace: str | None,
                clock: int, *, learn: bool = True) -> AccessStats:
        """A put of ``toks`` (``chain``: its chunks' addresses) is being planned, before it
        makes room, whether or not it is then stored (the simulator learns at every save too):
        the conversations it continues came back now, and this save is tracked with one turn
        more. Returns the statistics the new context gets (``clock``: the store's logical
        clock), which admission ranks it by.

        Not ``learn``: the put is a copy of a context saved elsewhere (a remote fill, after
        another server served the conversation's turn). It is no return seen here, and a
        return from it or from the contexts it extends would time the other server's service,
        not a think time: all of them are tracked as teaching nothing (their turns carry)."""
        now = self.now()
        turns = 0
        prev_len = 0
        prev_at: float | None = None
        for key, n in self.extended(toks, chain, namespace):
            if n > prev_len and (info := self.tracker.info(key)) is not None:
                prev_len, prev_at = n, info[0]
            if learn:
                t = self.tracker.returned(key, now)
                self._untrack_partial(key)
                if self._features is not None:
                    self._features.pop(key, None)
            elif (info := self.tracker.info(key)) is not None:
                t = info[1]
                self.tracker.saved(key, *info, learn=False)  # stays, teaching nothing
            else:
                t = None
            turns = max(turns, t or 0)
        c = self.tree.chunk_tokens
        m = len(toks) - (len(chain) - 1) * c
        parent = chain[-2] if len(chain) > 1 else self.tree.seed(namespace)
        features = None
        if self._features is not None:
            if self.tracker.pending_labels > MAX_PENDING_LABELS:  # no evictions for long
                self.tracker.sweep_labels(now)
            if len(self._features) > 2 * len(self.tree.contexts) + 1024:
                # features are kept for ranking stored contexts: drop those that left
                self._features = {k: f for k, f in self._features.items()
                                  if k in self.tree.contexts}
            # the turn this put ends: what it added to the context it extends
            new = toks[prev_len:]
            features = self.policy.predictor.features(  # type: ignore[attr-defined]
                turns=turns + 1, new_tokens=len(new), history_tokens=len(toks),
                gap_s=None if prev_at is None else now - prev_at,
                head=new[:CONTENT_TOKENS].tolist(), tail=new[-CONTENT_TOKENS:].tolist())
            self._features[chain[-1]] = features
        self._track(chain[-1], now, turns + 1, learn=learn,
                    partial=(parent, m) if m < c else None, features=features)
        return AccessStats(inserted=clock, last_access=clock, tokens=len(toks),
                           turns=turns + 1, saved_at=now, key=chain[-1], features=features)

    def refused(self, kept: list[bytes], last: bytes) -> None:
        """Admission refused the put whose last chunk is ``last`` (planned by
        :meth:`arrived`): the stored contexts ``kept`` it would have superseded stay, as the
        latest stored state of a conversation saved now with the refused save's turns (ranked
        so; they teach nothing: the refused save is the one a later return counts from)."""
        info = self.tracker.info(last)
        if info is None:
            return
        for key in kept:
            self._track(key, info[0], info[1], learn=False)
        self.tree.reprioritize(kept)

    # ------------------------------------------------------------------ time
    def refresh(self, queued: Callable[[bytes], Queued | None]) -> None:
        """Before an eviction: count conversations gone longer than any think time seen as
        ended and re-rank every context, at most every 1/20 of the mean think time (and at
        once when the model first has statistics: until then the policy is LRU); the rule is
        :class:`~kvstore.eviction.reranking.Reranking`'s. ``queued``: where a context is next
        needed; unqueued ones are ranked in one vectorized pass."""
        if not self.policy.model.ready:
            return  # without reading the clock
        tree = self.tree
        self.reranking.refresh(
            self.now(), tree.contexts, unqueued=lambda key: queued(key) is None,
            stats=lambda key: self.stats(tree.contexts[key]), reprioritize=tree.reprioritize,
            push=tree.heap.push)
