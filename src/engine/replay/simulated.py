"""Simulated mode: the store's placement rules over metadata-only tiers
(:class:`engine.replay.simstore.SimStore`), times from a :class:`~engine.replay.costs.CostModel`.
No payload bytes move, so the whole ShareGPT file replays in minutes."""

from __future__ import annotations

from collections import deque

from engine.replay.costs import CostModel
from engine.replay.offline import RequestLog
from engine.replay.server import Job, Method, MethodKind
from engine.replay.simstore import SimStore
from kvstore.eviction.policies import EvictionPolicy, LearnedReturn, make_policy
from kvstore.eviction.return_predictor import TurnFeatures, auc


class CostLimits:
    """The server's batch limits, from ``self.cost`` (a :class:`CostModel`): shared by the
    simulated executors."""

    cost: CostModel

    @property
    def max_batch(self) -> int:
        return self.cost.max_batch

    @property
    def max_prefill_tokens(self) -> int:
        return self.cost.max_prefill_tokens

    def fits(self, running: list[Job], job: Job) -> bool:
        tokens = sum(j.context_after for j in running) + job.context_after
        return tokens * self.cost.token_bytes <= self.cost.hbm_kv_bytes


def place_load(cost: CostModel, job: Job, tier: str, stored: int, begin: float, *,
               split: bool) -> float | None:
    """Cost ``job`` reusing the first ``stored`` tokens of its (kept) history from ``tier``,
    whose load may begin at ``begin``: with ``split``, the front ``m`` of them is computed
    while the rest loads from the back (:meth:`CostModel.split`), else all of them load. Sets
    ``job.recomputed``, ``reused``, ``compute_s`` and ``load_s``; returns when the load ends
    (None: nothing is loaded)."""
    assert 0 < stored <= job.kept, "the stored prefix lies inside the kept history"
    new = job.prompt_len - stored
    m = cost.split(stored, new, tier, head_start_s=job.start_s - begin)[0] if split else 0
    cn = cost.prefill_s(new, stored)  # the new tokens over the whole prefix
    job.recomputed, job.reused = m, stored - m
    job.compute_s = cn if m == 0 else cost.prefill_s(m, 0) + cn - cost.prefill_s_fixed
    job.load_s = 0.0
    if not job.reused:
        return None
    end = begin + cost.load_s(job.reused, tier)
    done = max(job.start_s + job.compute_s, end + cn / cost.num_layers)  # last layer after load
    job.load_s = done - job.start_s - job.compute_s
    return end


class SimulatedExecutor(CostLimits):
    """``policy``: the store's eviction policy object (default: the one ``method`` names).
    Thread-safety: none (the server's one thread)."""

    def __init__(self, method: Method, cost: CostModel, *, log: RequestLog | None = None,
                 hints: bool = True, policy: EvictionPolicy | None = None) -> None:
        self.method = method
        self.hints = hints  # the turns' retention hints (TurnSpec.ttl_s) reach the store
        self.cost = cost
        self.store: SimStore | None = None
        if method.caches:
            policy = policy if policy is not None else make_policy(method.policy)
            self.store = SimStore(dram_bytes=cost.dram_bytes, disk_bytes=cost.disk_bytes,
                                  token_bytes=cost.token_bytes, policy=policy,
                                  disk_bandwidth=cost.disk_to_dram_bps, log=log)
        self._link_free = 0.0  # when the load link (DRAM/disk -> accelerator) is next free
        self._prev_start = 0.0  # start of the latest prefill
        self.predictions = ReturnPredictions()
        self._saved_at: dict[int, float] = {}

    def arrive(self, job: Job) -> None:
        if self.store is not None:
            self.store.advance(job.arrival_s)  # the prefetcher's time up to now, for the others
            self.store.enqueue(job.conv.index)

    def prefill(self, job: Job, waiting: deque[Job], running: list[Job]) -> float:
        store, cost = self.store, self.cost
        key = job.conv.index
        tier = None
        if store is not None:
            store.advance(job.start_s)  # background prefetch up to now
            store.start(key)
            if job.turn > 0:
                if job.truncated and self.method.kind is MethodKind.OF:
                    store.drop(key)  # positions baked in: the truncated KV is useless
                tier = store.lookup(key)
        if job.turn == 0:
            job.hit = "none"
        elif tier is None:
            job.hit = "miss"
        else:
            job.hit = tier
            job.reused = job.kept  # the stored context covers the whole (kept) history
        if job.reused:
            # The read buffer: a job's KV starts loading once the previous iteration started
            # (and the link is free), so it overlaps the jobs ahead of it, then its own
            # prefill layer by layer (AttentionStore §3.2.1). With the split, the front of
            # the history is computed while its back loads (CostModel.split).
            begin = max(job.arrival_s, self._link_free, self._prev_start)
            end = place_load(cost, job, tier, job.reused, begin,
                             split=self.method.load == "split")
            if end is not None:
                self._link_free = end
        else:
            job.compute_s = cost.prefill_s(job.prompt_len, 0)
        if job.start_s > self._prev_start:
            self._prev_start = job.start_s
        return job.compute_s + job.load_s

    def decode(self, running: list[Job], steps: int) -> float:
        ctx = sum(j.context_after - j.remaining for j in running)
        return self.cost.decode_s(steps, ctx, len(running))

    def finish(self, job: Job, next_arrival: float | None) -> None:
        if self.store is not None:
            features = None
            if isinstance(self.store.policy, LearnedReturn):
                features = self._features(job)
                self.predictions.add(self.store.policy, features, job)
            ttl = job.conv.turns[job.turn].ttl_s if self.hints else None
            self.store.put(job.conv.index, job.context_after, now=job.finish_s,
                           next_use=next_arrival, features=features, ttl_s=ttl)
            self.store.finish(job.conv.index, next_arrival)

    def _features(self, job: Job) -> TurnFeatures:
        """What a store sees of the turn that ended: its position, lengths, the time since
        the conversation's previous save, the ids at the ends of what it added."""
        key = job.conv.index
        spec = job.conv.turns[job.turn]
        prev = self._saved_at.get(key)
        self._saved_at[key] = job.finish_s
        return self.store.policy.predictor.features(  # type: ignore[union-attr]
            turns=job.turn + 1, new_tokens=spec.user_len + spec.reply_len,
            history_tokens=job.context_after,
            gap_s=None if prev is None else job.finish_s - prev, head=spec.head, tail=spec.tail)


class ReturnPredictions:
    """The learned policy's predictions as it made them (before the label was known) against
    what the trace holds: whether each conversation had another turn."""

    def __init__(self) -> None:
        self.scores: list[float] = []
        self.labels: list[int] = []
        self.turns: list[int] = []

    def add(self, policy: LearnedReturn, features: TurnFeatures, job: Job) -> None:
        if not policy.predictor.ready:
            return  # the policy falls back to the rate per turn count until then
        self.scores.append(policy.predictor.predict(
            features, policy.model.return_rate(job.turn + 1)))
        self.labels.append(int(job.turn + 1 < len(job.conv.turns)))
        self.turns.append(job.turn + 1)

    def summary(self) -> dict[str, float] | None:
        """AUC of the predictions, and of the rate per turn count alone (the ``reuse``
        policy's feature) on the same saves."""
        if not self.scores:
            return None
        return {"predictions": len(self.scores), "auc": auc(self.labels, self.scores),
                "auc_turns_only": auc(self.labels, self.turns),
                "continue_rate": sum(self.labels) / len(self.labels)}
