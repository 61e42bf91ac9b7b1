"""The ShareGPT replay: workload, server, simulated and real executors, outputs, CLI."""

import dataclasses
import json
import random

import pytest

from engine.replay.costs import PRESETS, parse_bytes
from engine.replay.metrics import rows, summarize
from engine.replay.run import ReplayConfig, plan, replay
from engine.replay.server import METHOD_KINDS, Method, MethodKind, serve
from engine.replay.simulated import SimulatedExecutor
from engine.replay.workload import WorkloadConfig, build_trace
from tests.support.replay_tables import real_table, synthetic_table
from tests.support.truncation_reference import reference_kept

# LLaMA-13B with a small batch, so jobs queue: the scheduler's hints need a queue to see.
COST = dataclasses.replace(PRESETS["llama-13b"], max_batch=4)


def sim(trace, method, **cap):
    jobs, stats = serve(trace, SimulatedExecutor(Method.parse(method), COST.with_capacity(**cap)))
    return jobs, summarize(rows(method, jobs), stats)


@pytest.fixture(scope="module")
def trace():
    return build_trace(synthetic_table(600), WorkloadConfig(arrival_rate=1.0, think_s=60.0),
                       context_window=COST.context_window)


@pytest.mark.parametrize("ratio", [0.5, 0.2])
def test_jobs_keep_what_the_truncation_rule_keeps(ratio):
    """Every turn fits the window; a turn's history is truncated exactly when it overflows,
    to the length the step-by-step reference of the rule (tests/engine/test_truncation.py)
    keeps."""
    table = synthetic_table(200, mean_user=300, mean_reply=500)
    wl = WorkloadConfig(context_window=2048, truncation_ratio=ratio, sink_tokens=4)
    tr = build_trace(table, wl, context_window=4096)
    jobs, _ = sim(tr, "as")
    assert sum(j.truncated for j in jobs) > 20
    for j in jobs:
        needed = j.user_len + j.reply_len
        assert j.context_after <= 2048
        assert j.truncated == (j.history + needed > 2048)
        assert j.kept == len(reference_kept(j.history, needed, 2048, ratio, 4))


def test_trace_is_deterministic_and_follows_the_rules():
    table = synthetic_table(50)
    cfg = WorkloadConfig(max_message_tokens=400, max_turns=5, min_turns=2, seed=3)
    a = build_trace(table, cfg, context_window=1024)
    b = build_trace(table, cfg, context_window=1024)
    assert a == b
    assert a != build_trace(table, WorkloadConfig(max_message_tokens=400, max_turns=5,
                                                  min_turns=2, seed=4), context_window=1024)
    for c in a.conversations:
        assert 2 <= len(c.turns) <= 5
        assert all(max(t.user_len, t.reply_len) <= 400 for t in c.turns)
    arr = [c.arrival_s for c in a.conversations]
    assert arr == sorted(arr) and arr[0] == 0.0


@pytest.mark.parametrize("text,kind,label", [
    ("re", MethodKind.RE, "RE"), ("as", MethodKind.AS, "AS-scheduler"),
    ("of:fifo", MethodKind.OF, "OF-fifo"), ("belady:all", MethodKind.AS, "AS-belady-loadall"),
    (" RE ", MethodKind.RE, "RE"),
])
def test_method_kinds_are_an_enum_that_keeps_its_strings(text, kind, label):
    m = Method.parse(text)
    assert m.kind is kind and m.label == label and m.caches == (kind is not MethodKind.RE)
    assert m == Method(kind.value, m.policy, m.load) == Method(kind, m.policy, m.load)
    assert hash(m) == hash(Method(kind.value, m.policy, m.load))
    assert json.loads(json.dumps({"kind": m.kind})) == {"kind": kind.value}  # JSON: the string
    assert f"{m.kind}" == str(m.kind) == kind.value  # CLI, labels and paths: the string
    assert METHOD_KINDS == ("re", "as", "of") == tuple(MethodKind)


def test_bad_workload_and_methods_are_named():
    with pytest.raises(ValueError, match="arrival_rate"):
        WorkloadConfig(arrival_rate=0)
    with pytest.raises(ValueError, match="drop_ratio"):
        WorkloadConfig(truncation_ratio=1.0)
    with pytest.raises(ValueError, match="method"):
        Method.parse("xx")
    with pytest.raises(ValueError, match="policy"):
        Method.parse("as:nope")
    with pytest.raises(ValueError, match="mode"):
        ReplayConfig(mode="fast")
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("12 apples")
    assert parse_bytes("2TB") == 2 * 10**12 and parse_bytes("512MiB") == 512 << 20


def test_server_is_fcfs_and_turns_follow_replies(trace):
    jobs, _ = sim(trace, "as")
    starts = [j.start_s for j in jobs]  # jobs are in arrival order
    assert starts == sorted(starts)
    by_conv = {}
    for j in jobs:
        assert j.arrival_s <= j.start_s <= j.first_token_s <= j.finish_s
        by_conv.setdefault(j.conv.index, []).append(j)
    for js in by_conv.values():
        for a, b in zip(js, js[1:], strict=False):
            assert b.turn == a.turn + 1
            assert b.arrival_s == pytest.approx(a.finish_s + a.conv.turns[a.turn].think_s)
            assert b.history == a.context_after


def test_same_seed_same_decisions(trace):
    a, _ = sim(trace, "as", disk_bytes=parse_bytes("300GB"))
    b, _ = sim(trace, "as", disk_bytes=parse_bytes("300GB"))
    assert [(j.conv.index, j.turn, j.hit, j.reused, j.start_s) for j in a] == \
        [(j.conv.index, j.turn, j.hit, j.reused, j.start_s) for j in b]


def test_policy_ordering_under_capacity_pressure(trace):
    """Fig. 21 shape: scheduler-aware beats LRU and FIFO, mostly with DRAM hits, and Belady
    bounds it; RE never hits."""
    cap = {"disk_bytes": parse_bytes("200GB"), "dram_bytes": parse_bytes("32GB")}
    s = {m: sim(trace, m, **cap)[1] for m in ("scheduler", "lru", "fifo", "belady")}
    assert s["scheduler"]["hit_rate"] > s["lru"]["hit_rate"] + 0.05
    assert s["scheduler"]["hit_rate"] > s["fifo"]["hit_rate"] + 0.05
    assert s["belady"]["hit_rate"] >= s["scheduler"]["hit_rate"]
    assert s["scheduler"]["dram_hit_rate"] > 2 * s["lru"]["dram_hit_rate"]
    re = sim(trace, "re")[1]
    assert re["hit_rate"] == 0 and re["prefilled_tokens"] == re["prompt_tokens"]
    assert s["scheduler"]["ttft_s_turn2plus"]["mean"] < re["ttft_s_turn2plus"]["mean"]


def test_of_loses_hits_on_overflow():
    """Fig. 22: with positions baked in, a truncated history's KV is useless."""
    table = synthetic_table(200, mean_user=300, mean_reply=500)
    tr = build_trace(table, WorkloadConfig(context_window=2048), context_window=4096)
    as_jobs, as_s = sim(tr, "as")
    of_jobs, of_s = sim(tr, "of")
    assert as_s["truncated_turns"] > 20
    assert of_s["hit_rate"] < as_s["hit_rate"] - 0.05
    of_missed = {(j.conv.index, j.turn) for j in of_jobs if j.hit == "miss"}
    truncated = {(j.conv.index, j.turn) for j in of_jobs if j.truncated}
    assert truncated <= of_missed  # every overflow is a miss for OF
    assert all(j.hit in ("dram", "disk") for j in as_jobs if j.truncated and j.turn > 0)


def test_plan_finds_the_smallest_capacity(trace):
    cfg = ReplayConfig(methods=(Method("as"),), preset="llama-13b", dram_bytes=32 * 10**9)
    res = plan(trace, cfg, Method("as"), 0.8, lo=parse_bytes("10GB"), hi=parse_bytes("20TB"))
    assert res["reached"]
    tried = res["tried"]
    ok = [p["disk_bytes"] for p in tried if p["hit_rate"] >= 0.8]
    bad = [p["disk_bytes"] for p in tried if p["hit_rate"] < 0.8]
    assert res["disk_bytes"] == min(ok) and max(bad) < res["disk_bytes"]
    assert res["disk_bytes"] <= 1.2 * max(bad)  # bisection narrowed it down


# --------------------------------------------------------------------------- real mode
def test_real_replay_reuses_exactly_and_truncates(model, tmp_path):
    """Real SmolLM2: AS reuses the whole history on turns >= 2 and its first token equals
    recompute's wherever no truncation happened; with a small window, histories overflow, AS
    keeps its hits (truncated in the store) and OF loses them."""
    table = real_table(model)
    wl = WorkloadConfig(min_turns=3, context_window=300, warmup_fraction=0.0, think_s=1.0,
                        arrival_rate=0.5)
    # load="all": the store path's exactness (engine/test_loadcompute.py checks the decision)
    cfg = ReplayConfig(mode="real", methods=(Method("re"), Method("as", load="all"),
                                             Method("of", load="all")),
                       workload=wl, store_dir=str(tmp_path / "store"))
    summary = replay(cfg, str(tmp_path / "out"), model=model, table=table, progress=False)
    import pyarrow.parquet as pq

    t = pq.read_table(tmp_path / "out" / "turns.parquet").to_pylist()
    by = {(r["method"], r["conv"], r["turn"]): r for r in t}
    assert len(t) == 3 * 9
    assert summary["methods"]["AS-scheduler-loadall"]["hit_rate"] == 1.0
    assert any(r["truncated"] for r in t)
    for r in t:
        if r["method"] != "AS-scheduler-loadall" or r["turn"] == 0:
            continue
        assert r["reused_tokens"] == r["kept_tokens"]  # the whole (kept) history
        re = by[("RE", r["conv"], r["turn"])]
        assert re["prompt_tokens"] == r["prompt_tokens"]
        if not r["truncated"]:
            assert r["first_token"] == re["first_token"]  # reused KV is exact
        of = by[("OF-scheduler-loadall", r["conv"], r["turn"])]
        if r["truncated"]:
            assert of["hit"] == "miss" and of["reused_tokens"] == 0
    for name in ("turns.parquet", "summary.json", "ttft_cdf.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["mode"] == "real"


def test_cli_replay_sweep_and_plan(tmp_path, capsys):
    """``kvstore replay`` (simulated, with a capacity sweep) and ``kvstore plan`` on a small
    ShareGPT-format file."""
    from engine.cli import main

    rng = random.Random(1)
    recs = [{"id": f"r{i}", "conversations": [
        {"from": "human" if k % 2 == 0 else "gpt",
         "value": " ".join(rng.choice(["kv", "cache", "disk", "tier"]) for _ in range(
             rng.randint(5, 80)))} for k in range(2 * rng.randint(1, 5))]} for i in range(40)]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(recs))
    common = ["--data", str(data), "--cache-dir", str(tmp_path / "cache"), "--rate", "5",
              "--dram", "64MB", "--disk", "256MB", "--no-progress"]
    out = tmp_path / "out"
    rc = main(["replay", *common[:-1], "--methods", "re,as,lru,of", "--out", str(out),
               "--sweep-disk", "64MB,1GB", "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "AS-scheduler" in text and "OF-scheduler" in text and "vs RE" in text
    for name in ("turns.parquet", "summary.json", "ttft_cdf.png", "sweep.json",
                 "hit_rate_vs_capacity.png"):
        assert (out / name).stat().st_size > 0
    sweep = json.loads((out / "sweep.json").read_text())
    assert {p["method"] for p in sweep} == {"AS-scheduler", "AS-lru", "OF-scheduler"}
    rc = main(["plan", *common[:4], "--dram", "64MB", "--target", "0.5",
               "--min-disk", "1MB", "--max-disk", "10GB"])
    assert rc == 0
    assert "reaches a 50% hit rate" in capsys.readouterr().out
    assert main(["replay", "--rate", "0", "--data", str(data)]) == 2
    assert "arrival_rate" in capsys.readouterr().err


def hand_trace(*convs, window=4096):
    """A trace from (arrival_s, [(user_len, reply_len, think_s), ...]) tuples."""
    from engine.replay.workload import ConvSpec, Trace, TurnSpec

    specs = tuple(ConvSpec(index=i, conv_id=f"h{i}", arrival_s=at, turns=tuple(
        TurnSpec(user_len=u, reply_len=r, think_s=th) for u, r, th in turns))
        for i, (at, turns) in enumerate(convs))
    return Trace(config=WorkloadConfig(warmup_fraction=0.0), context_window=window,
                 conversations=specs, cut_turns=0)


def test_running_jobs_respect_accelerator_memory():
    """Three 1000-token jobs where the accelerator holds the KV of 1500 tokens: they run one
    after another, even though the batch has room."""
    cost = dataclasses.replace(COST, max_batch=8, hbm_kv_bytes=1500 * COST.token_bytes)
    tr = hand_trace(*[(0.01 * i, [(500, 500, 1.0)]) for i in range(3)])
    jobs, _ = serve(tr, SimulatedExecutor(Method("re"), cost))
    spans = sorted((j.start_s, j.finish_s) for j in jobs)
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert start >= end


def test_idle_disk_bandwidth_is_not_banked_for_a_late_arrival():
    """A's context leaves DRAM while A's user thinks; when A's next turn arrives at an idle
    server, there was no queued job to prefetch for, so it is read from disk."""
    cost = COST.with_capacity(dram_bytes=int(1.5 * 1100 * COST.token_bytes))
    tr = hand_trace((0.0, [(100, 1000, 100.0), (50, 10, 0.0)]),  # A: back ~100 s later
                    (50.0, [(100, 1000, 0.0)]))  # B: its save pushes A out of DRAM
    jobs, _ = serve(tr, SimulatedExecutor(Method("as"), cost))
    a2 = next(j for j in jobs if j.conv.index == 0 and j.turn == 1)
    assert a2.start_s == a2.arrival_s and a2.hit == "disk"


def test_vllm_replay_reuses_exactly(model, tmp_path):
    """``--engine vllm``: RE is vLLM alone, AS vLLM with the KVStoreConnector, each on a fresh
    engine. AS reuses all of each history (its whole blocks from vLLM's own cache or the store,
    whichever still holds them, its last partial block from the store) and samples the first
    token RE samples."""
    table = real_table(model)
    wl = WorkloadConfig(conversations=2, max_turns=2, context_window=1024, warmup_fraction=0.0,
                        think_s=1.0, arrival_rate=0.5)
    cfg = ReplayConfig(mode="real", engine="vllm", methods=(Method("re"), Method("as")),
                       workload=wl, store_dir=str(tmp_path / "store"))
    summary = replay(cfg, str(tmp_path / "out"), model=model, table=table, progress=False)
    import pyarrow.parquet as pq

    t = pq.read_table(tmp_path / "out" / "turns.parquet").to_pylist()
    by = {(r["method"], r["conv"], r["turn"]): r for r in t}
    assert len(t) == 2 * 4 and set(summary["methods"]) == {"RE", "AS-scheduler"}
    for r in t:
        if r["method"] != "AS-scheduler" or r["turn"] == 0:
            continue
        re = by[("RE", r["conv"], r["turn"])]
        assert re["prompt_tokens"] == r["prompt_tokens"] and not r["truncated"]
        assert r["first_token"] == re["first_token"]  # reused KV is exact
        assert r["reused_tokens"] == r["history_tokens"]
        assert r["hit"] in ("dram", "disk")  # at least the history's tail
    assert summary["methods"]["AS-scheduler"]["store"]["disk"]["chunks"] > 0
    with pytest.raises(ValueError, match="--mode real"):
        ReplayConfig(mode="simulated", engine="vllm")


def test_vllm_replay_without_the_engine_cache(model, tmp_path):
    """``--engine-cache off``: both methods' engines run without vLLM's prefix cache, as if
    every turn came to a restarted server. RE recomputes every history; AS loads each
    history from the store, its last partial block too, and samples RE's first token."""
    table = real_table(model)
    wl = WorkloadConfig(conversations=1, min_turns=3, max_turns=3, context_window=1024,
                        warmup_fraction=0.0, think_s=1.0, arrival_rate=0.5)
    cfg = ReplayConfig(mode="real", engine="vllm", methods=(Method("re"), Method("as")),
                       workload=wl, store_dir=str(tmp_path / "store"), engine_cache=False)
    summary = replay(cfg, str(tmp_path / "out"), model=model, table=table, progress=False)
    import pyarrow.parquet as pq

    t = pq.read_table(tmp_path / "out" / "turns.parquet").to_pylist()
    by = {(r["method"], r["turn"]): r for r in t}
    assert summary["engine_cache"] is False and len(t) == 6
    for turn in (1, 2):
        re, as_ = by[("RE", turn)], by[("AS-scheduler", turn)]
        assert re["reused_tokens"] == 0 and re["hit"] == "miss"
        assert as_["reused_tokens"] == as_["history_tokens"] > 0  # all of it
        assert as_["hit"] == "dram"
        assert as_["first_token"] == re["first_token"]
    with pytest.raises(ValueError, match="engine='vllm'"):
        ReplayConfig(mode="real", engine_cache=False)


def test_vllm_replay_on_servers_shares_one_store(model, tmp_path):
    """``--engine vllm --servers 2``: two fresh engines per method, each turn on the server
    ``ScaleOut.server_of`` picks. RE's engines have only their own prefix caches; AS's engines
    share one store directory, so a turn routed away from its conversation's previous server
    reuses that server's saved blocks, where RE's engine has nothing of that history. First
    tokens equal RE's on every turn."""
    from engine.replay.multi import ScaleOut

    table = real_table(model)
    wl = WorkloadConfig(conversations=3, max_turns=3, context_window=1024, warmup_fraction=0.0,
                        think_s=1.0, arrival_rate=0.5, seed=0)
    scale = ScaleOut(servers=2, seed=0)
    cfg = ReplayConfig(mode="real", engine="vllm", methods=(Method("re"), Method("as")),
                       workload=wl, store_dir=str(tmp_path / "store"), scale=scale)
    summary = replay(cfg, str(tmp_path / "out"), model=model, table=table, progress=False)
    import pyarrow.parquet as pq

    t = pq.read_table(tmp_path / "out" / "turns.parquet").to_pylist()
    by = {(r["method"], r["conv"], r["turn"]): r for r in t}
    assert set(summary["methods"]) == {"RE", "AS-scheduler"} and summary["servers"] == 2
    assert len(t) == 2 * 9
    for r in t:
        re = by[("RE", r["conv"], r["turn"])]
        assert r["first_token"] == re["first_token"]  # reused KV is exact
    moved = 0
    for (method, conv, turn), r in by.items():
        if method != "AS-scheduler" or turn == 0:
            continue
        job = dict(conv=conv, turn=turn)
        here, before = (scale.server_of(_JobAt(**job)),
                        scale.server_of(_JobAt(conv=conv, turn=turn - 1)))
        re = by[("RE", conv, turn)]
        if here != before and r["history_tokens"] >= 128:
            moved += 1  # the other server saved this history: AS loads it from the store
            assert r["hit"] in ("dram", "disk")
            assert r["reused_tokens"] == r["history_tokens"]
            assert re["hit"] in ("miss", "engine") and re["reused_tokens"] < r["reused_tokens"]
    assert moved >= 2  # seed 0 routes three turns away from their previous server
    store = summary["methods"]["AS-scheduler"]["store"]
    assert store["disk"]["chunks"] > 0 and store["scale_out"]["servers"] == 2
    with pytest.raises(ValueError, match="--remote"):
        ReplayConfig(mode="real", engine="vllm", scale=ScaleOut(servers=2, shared=True,
                                                                url="redis://localhost"))


def test_vllm_methods_take_turns():
    """The vLLM replay's methods serve side by side, one turn each in turn; a method that is
    done is skipped; after one failed, the others stop at their next turn."""
    import threading

    from engine.replay.vllm import Alternation, PartyFailed

    turns, log = Alternation(["RE", "AS"]), []

    def serve(who, n):
        for i in range(n):
            with turns.turn(who):
                log.append((who, i))
        turns.leave(who)

    threads = [threading.Thread(target=serve, args=a) for a in (("AS", 3), ("RE", 5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert log == [("RE", 0), ("AS", 0), ("RE", 1), ("AS", 1), ("RE", 2), ("AS", 2),
                   ("RE", 3), ("RE", 4)]
    turns = Alternation(["RE", "AS"])
    turns.leave("RE", failed=True)
    with pytest.raises(PartyFailed, match="RE failed"), turns.turn("AS"):
        pass


@dataclasses.dataclass
class _JobAt:
    """What ``ScaleOut.server_of`` reads of a job: its conversation's index and its turn."""

    conv: object
    turn: int

    def __post_init__(self):
        self.conv = type("Conv", (), {"index": self.conv})()
