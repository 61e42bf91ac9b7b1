"""The replay through vLLM: what a turn counts as a hit (what the connector loaded, not what
the scheduler matched), and a shared system prompt (``--system-prompt``) that every
conversation opens with and each engine serves alone first."""

from __future__ import annotations

import pytest

from engine.replay.cli import config_of
from engine.replay.run import ReplayConfig, load_table, replay
from engine.replay.server import Job, Method
from engine.replay.vllm import hit_of
from engine.replay.workload import ConvSpec, TurnSpec, WorkloadConfig

SYSTEM = ("You answer questions about a storage engine for the key/value caches of language "
          "models. Keep answers short, name the module that does the work, and say when a "
          "feature is not built yet.")


def job(turn: int, reused: int) -> Job:
    conv = ConvSpec(index=0, conv_id="c", arrival_s=0.0,
                    turns=(TurnSpec(user_len=4, reply_len=4, think_s=0.0),) * 3)
    return Job(conv=conv, turn=turn, seq=0, arrival_s=0.0, warmup=False, history=10,
               kept=10, reused=reused)


def test_a_hit_is_what_the_connector_loaded_not_what_it_matched():
    loaded = {"loaded_tokens": 8, "loaded_from": {"dram": 0, "disk": 8, "remote": 0},
              "load_failed": False}
    failed = {"loaded_tokens": 0, "loaded_from": {}, "load_failed": True}
    assert hit_of(job(1, 8), loaded) == "disk"
    # matched, then the load failed: vLLM recomputed the turn, whatever it counts as cached
    assert hit_of(job(1, 8), failed) == "miss"
    assert hit_of(job(1, 4), {}) == "engine"  # no connector: vLLM's own prefix cache
    assert hit_of(job(1, 8), {**loaded, "loaded_from": {"dram": 8}}) == "dram"
    assert hit_of(job(1, 12), {**loaded, "loaded_from": {}}) == "engine"  # 4 beyond its own
    assert hit_of(job(1, 0), {}) == "miss"
    # a first turn has no history: "none", unless it loaded a prefix (a system prompt)
    assert hit_of(job(0, 0), {}) == "none"
    assert hit_of(job(0, 8), loaded) == "disk"
    assert hit_of(job(0, 0), failed) == "none"


def test_the_system_prompt_option_is_checked_and_opens_every_conversation(model, tmp_path):
    import argparse

    from engine.replay.cli import add_workload_args

    p = argparse.ArgumentParser()
    add_workload_args(p)
    path = tmp_path / "system.txt"
    path.write_text(SYSTEM)
    args = p.parse_args(["--mode", "real", "--system-prompt", f"@{path}"])
    cfg = config_of(args, (Method("re"),))
    assert cfg.system_prompt == SYSTEM
    with pytest.raises(ValueError, match="--system-prompt @"):
        config_of(p.parse_args(["--mode", "real", "--system-prompt", "@/nonexistent/x"]),
                  (Method("re"),))
    with pytest.raises(ValueError, match="--mode real"):
        ReplayConfig(mode="simulated", system_prompt=SYSTEM)
    with pytest.raises(ValueError, match="non-empty"):
        ReplayConfig(mode="real", system_prompt="  ")
    wl = WorkloadConfig(conversations=3, max_message_tokens=256)
    table = load_table(model, ReplayConfig(mode="real", workload=wl, system_prompt=SYSTEM),
                       None)
    system = model.chat_template([{"role": "system", "content": SYSTEM}],
                                 add_generation_prompt=False)
    first = [ids for ids, turn in zip(table.column("user_ids").to_pylist(),
                                      table.column("turn").to_pylist(), strict=True)
             if turn == 0]
    assert len(first) >= 3 and all(ids[:len(system)] == system for ids in first)
    assert len({tuple(ids[len(system):]) for ids in first}) == len(first)


def test_vllm_replay_shares_the_primed_system_prompt(model, tmp_path):
    """Each engine serves the system prompt alone first; AS's first turns then load it from
    the store (the connector's account, not a match), no load fails, and every first token
    equals RE's."""
    from engine.sharegpt import ShareGPTConversation, Turn, turn_table

    words = "cache store layer token reuse disk memory query answer model".split()
    convs = [ShareGPTConversation(id=f"c{i}", system=SYSTEM, turns=tuple(
        Turn(user=" ".join(words[(i + t + k) % 10] for k in range(25)),
             assistant=" ".join(words[(3 * i + t + k) % 10] for k in range(40)))
        for t in range(2))) for i in range(2)]
    wl = WorkloadConfig(conversations=2, max_turns=2, context_window=1024, warmup_fraction=0.0,
                        think_s=1.0, arrival_rate=0.5)
    cfg = ReplayConfig(mode="real", engine="vllm", methods=(Method("re"), Method("as")),
                       workload=wl, store_dir=str(tmp_path / "store"), engine_cache=False,
                       system_prompt=SYSTEM)
    summary = replay(cfg, str(tmp_path / "out"), model=model, table=turn_table(model, convs),
                     progress=False)
    import pyarrow.parquet as pq

    t = pq.read_table(tmp_path / "out" / "turns.parquet").to_pylist()
    by = {(r["method"], r["conv"], r["turn"]): r for r in t}
    store = summary["methods"]["AS-scheduler"]["store"]
    assert store["connector"] == {"loads_failed": 0, "first_turns_loaded": 2}
    assert summary["methods"]["AS-scheduler"]["hit_rate"] == 1.0
    system = model.chat_template([{"role": "system", "content": SYSTEM}],
                                 add_generation_prompt=False)
    for (method, conv, turn), r in by.items():
        assert r["first_token"] == by[("RE", conv, turn)]["first_token"]
        if method == "AS-scheduler" and turn == 0:  # the primed system prompt, all of it
            # (the second conversation's also the user-turn opening the first one stored)
            assert r["hit"] in ("dram", "disk") and r["reused_tokens"] >= len(system)
