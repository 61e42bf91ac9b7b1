"""The ``learned`` policy: a return predictor trained online from what the owner sees
(kvstore.eviction.return_predictor), in the simulator and in the real store. Oracles: brute-force
AUC over every pair; a synthetic trace whose ends a content token reveals; the same labels fed
by hand."""

import random

import numpy as np
import pytest

import kvstore
from engine.replay.simstore import SimStore
from kvstore.eviction.policies import LearnedReturn
from kvstore.eviction.return_predictor import (
    ProgressiveScores,
    ReturnPredictor,
    auc,
    turn_features,
)
from kvstore.eviction.returns import ReturnModel, ReturnTracker
from tests.support.clock import Clock
from tests.support.kvgen import put_causal

SLOT = 4096  # bytes of one 4-token chunk of the SMALL layout
END, MORE = 7, 9  # content tokens: a turn ending with END is a conversation's last


def brute_auc(y, s):
    pos = [b for a, b in zip(y, s, strict=True) if a]
    neg = [b for a, b in zip(y, s, strict=True) if not a]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_is_the_pairwise_probability(seed):
    rng = random.Random(seed)
    y = [rng.random() < 0.4 for _ in range(60)]
    s = [rng.choice([0.1, 0.2, 0.3, rng.random()]) for _ in range(60)]  # with ties
    assert auc(y, s) == pytest.approx(brute_auc(y, s))
    assert np.isnan(auc([1, 1], [0.1, 0.2]))


def synthetic(n, seed):
    """Turns of conversations: ``tail`` ends with END on a conversation's last turn, with
    MORE otherwise; everything else is noise. (features kwargs, label)"""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = rng.randint(1, 5)
        for t in range(1, turns + 1):
            last = t == turns
            body = [rng.randrange(100, 5000) for _ in range(rng.randint(3, 40))]
            out.append((dict(turns=t, new_tokens=len(body) + 1, history_tokens=50 * t,
                             gap_s=None if t == 1 else rng.expovariate(1 / 30),
                             head=body, tail=body + [END if last else MORE]), int(not last)))
    return out


def test_training_is_deterministic_and_learns_what_content_says():
    data = synthetic(400, 0)
    a, b = ReturnPredictor(), ReturnPredictor()
    for kw, label in data:
        a.observe(a.features(**kw), label)
        b.observe(b.features(**kw), label)
    assert a.to_bytes() == b.to_bytes() and a.seen == len(data)
    test = synthetic(200, 1)
    scores = [a.predict(a.features(**kw)) for kw, _ in test]
    assert auc([lab for _, lab in test], scores) > 0.95
    # the turn count alone tells far less on this trace
    assert auc([lab for _, lab in test], [kw["turns"] for kw, _ in test]) < 0.8


@pytest.mark.parametrize("seed", [0, 1])
def test_progressive_scores_give_the_auc_of_their_bins(seed):
    """The histogram's AUC is the pairwise AUC of the scores rounded down to their bins
    (scores sharing a bin are ties)."""
    rng = random.Random(seed)
    y = [int(rng.random() < 0.3) for _ in range(300)]
    s = [rng.choice([0.5, 0.5004, rng.random(), 0.9999]) for _ in range(300)]
    ps = ProgressiveScores()
    for label, p in zip(y, s, strict=True):
        ps.add(p, label)
    bins = [min(int(p * ps.BINS), ps.BINS - 1) for p in s]
    assert ps.auc() == pytest.approx(brute_auc(y, bins))
    assert ps.summary() == {"labels": 300, "auc": pytest.approx(brute_auc(y, bins)),
                            "continue_rate": sum(y) / 300}
    one = ProgressiveScores()
    one.add(0.3, 1)
    assert one.summary() == {"labels": 1, "auc": None, "continue_rate": 1.0}


def test_the_predictor_scores_each_label_before_learning_it():
    """From its ``min_labels``-th label on, each label is scored by the predictor as it was
    just before (a correction of an earlier label is not scored again)."""
    p = ReturnPredictor(min_labels=20)
    data = synthetic(200, 4)
    want_p, want_y = [], []
    for i, (kw, label) in enumerate(data):
        f = p.features(**kw)
        if i >= 20:
            want_p.append(p.predict(f))
            want_y.append(label)
        p.observe(f, label)
    p.observe(p.features(**data[0][0]), 1, correction=True)
    assert p.scores.labels == len(data) - 20 and p.seen == len(data) + 1
    bins = [min(int(x * p.scores.BINS), p.scores.BINS - 1) for x in want_p]
    assert p.scores.auc() == pytest.approx(auc(want_y, bins))
    assert p.scores.auc() > 0.9  # the content token tells the ends


def test_state_round_trips_and_damage_is_refused():
    p = ReturnPredictor(dims=64)
    for kw, label in synthetic(50, 3):
        p.observe(p.features(**kw), label)
    q = ReturnPredictor.from_bytes(p.to_bytes())
    assert q.to_bytes() == p.to_bytes() and len(p.to_bytes()) < 1024
    raw = p.to_bytes()
    nan = bytearray(raw)
    nan[-4:] = np.array([np.nan], dtype=np.float32).tobytes()
    for bad in (b"", raw[:20], b"XXXX" + raw[4:], raw + b"\0", bytes(nan)):
        with pytest.raises(ValueError, match="return predictor state"):
            ReturnPredictor.from_bytes(bad)
    with pytest.raises(ValueError, match="turns"):
        turn_features(turns=0, new_tokens=1, history_tokens=1, gap_s=None)


def test_labels_come_in_save_order_once_older_than_every_think_time():
    """The tracker labels a save only once it is older than the horizon: a return (1), else
    an end (0); a late return relabels it; a forgotten save is never labelled."""
    model = ReturnModel(ReturnPredictor(dims=64, min_labels=1))
    tr = ReturnTracker(model)
    f = {k: turn_features(turns=1, new_tokens=k, history_tokens=k, gap_s=None, dims=64)
         for k in range(1, 6)}
    labels: list[tuple[int, int]] = []
    real = model.predictor.observe
    model.predictor.observe = lambda feats, label, prior=None, **kw: (
        labels.append((int(feats.index[2]), label)), real(feats, label, prior, **kw))
    tr.saved("a", 0.0, 1, features=f[1])
    tr.saved("b", 1.0, 1, features=f[2])
    tr.saved("c", 2.0, 1, features=f[3])
    tr.returned("a", 10.0)  # horizon: 10 s
    tr.forget("c")
    assert labels == []  # nothing older than the horizon yet
    tr.sweep(12.5)  # a (saved at 0) and b (1) are older than 10 s; c is forgotten
    assert labels == [(int(f[1].index[2]), 1), (int(f[2].index[2]), 0)]
    tr.returned("b", 40.0)  # b came back after all
    assert labels[-1] == (int(f[2].index[2]), 1)


def sim_trace(seed, n=300):
    """Conversations arriving every 3 s, 1-6 turns, 30 s thinks, whose last turn ends with
    END: (time, conversation, turn, tokens, features kwargs)."""
    rng = random.Random(seed)
    events = []
    for c in range(n):
        t = 3.0 * c
        turns, tokens = rng.randint(1, 6), 0
        for i in range(1, turns + 1):
            tokens += rng.randint(20, 60)
            last = i == turns
            kw = dict(turns=i, new_tokens=40, history_tokens=tokens, gap_s=None,
                      head=[rng.randrange(100, 5000) for _ in range(8)],
                      tail=[rng.randrange(100, 5000) for _ in range(8)] + [END if last else MORE])
            events.append((t, c, i, tokens, kw, last))
            t += 5.0 + rng.expovariate(1 / 30)
    return sorted(events, key=lambda e: e[0])


def replay_sim(policy, events):
    store = SimStore(dram_bytes=0, disk_bytes=2000, token_bytes=1, policy=policy)
    hits = reads = 0
    for t, c, i, tokens, kw, _ in events:
        store.advance(t)
        if i > 1:
            reads += 1
            hits += store.lookup(c) is not None
        feats = policy.predictor.features(**kw) if isinstance(policy, LearnedReturn) else None
        store.put(c, tokens, now=t, features=feats)
    return hits / reads, store


def test_learned_beats_reuse_where_content_tells_the_ends():
    events = sim_trace(0)
    learned = LearnedReturn(disk_min_rate=0.0)
    h_learned, st = replay_sim(learned, events)
    h_reuse, _ = replay_sim(kvstore.eviction.policies.ReuseProbability(), events)
    assert learned.predictor.seen > 300
    assert h_learned > h_reuse + 0.03, (h_learned, h_reuse)
    # DRAM-only admission: with no DRAM the predicted ends are not stored at all
    _, st2 = replay_sim(LearnedReturn(disk_min_rate=0.8), events)
    assert st2.counters.dram_only + st2.counters.bypassed > 0
    assert st2.counters.disk_bytes_written < st.counters.disk_bytes_written


def test_store_learns_from_its_puts_and_keeps_the_predictor(open_small, tmp_path):
    s = open_small(policy="learned", disk_bytes=24 * SLOT)
    clock = Clock()
    s.policy.clock = clock
    ctx: dict[int, list[int]] = {}
    for t, c, _i, _tokens, _kw, last in sim_trace(1, 60):
        clock.t = t
        mine = ctx.setdefault(c, [])  # each turn extends the conversation's context
        mine += [200_000 * (c + 1) + len(mine) + j for j in range(6)] + [END if last else MORE]
        put_causal(s, mine)
    pr = s.policy.predictor
    assert pr.seen > 20  # labels came in as contexts got older than every think time
    ev = s.stats()["evictions"]
    assert ev["policy"] == "learned"
    assert ev["return_prediction"]["trained_labels"] == pr.seen
    assert ev["return_prediction"]["labels"] == pr.scores.labels > 0
    state = pr.to_bytes()
    path = s.path
    s.close()
    with kvstore.open(path, policy="learned") as again:
        assert again.policy.predictor.to_bytes() == state
        assert again.problems == []
    with kvstore.open(path, policy="lru") as other:  # another policy leaves it alone
        assert other.problems == []
        assert other.stats()["evictions"]["return_prediction"] is None
        # a damaged state is a problem, and the policy starts afresh
        with other._core.catalog.write() as txn:
            txn.put_meta("return_predictor", "bm90IGEgcHJlZGljdG9y")
    with kvstore.open(path, policy="learned") as s3:
        assert s3.policy.predictor.seen == 0
        assert any("return_predictor" in p for p in s3.problems)


def test_features_name_their_families_apart():
    a = turn_features(turns=1, new_tokens=1, history_tokens=1, gap_s=None, head=[5], tail=[])
    b = turn_features(turns=1, new_tokens=1, history_tokens=1, gap_s=None, head=[], tail=[5])
    assert set(a.index.tolist()) != set(b.index.tolist())
