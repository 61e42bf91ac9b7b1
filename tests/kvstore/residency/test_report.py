"""What ``Store.stats()`` reports (kvstore.residency.report, from kvstore.residency.counters and
the look-ahead): checked against a dict model of the operations a test made on a real store,
and every counter the store keeps is reported somewhere."""

import dataclasses
import inspect
import math
import re

import numpy as np
import pytest

from kvstore.eviction.jobs import Windows
from kvstore.residency import report
from kvstore.residency.counters import Counters
from tests.support.kvgen import put_causal

CHUNK = 4  # the open_small fixture's chunk_tokens


def test_every_counter_is_reported():
    source = inspect.getsource(report)
    read = set(re.findall(r"\b(?:cnt|c)\.([a-z_]+)\b", source))
    fields = {f.name for f in dataclasses.fields(Counters)}
    assert fields <= read, sorted(fields - read)


def test_counters_start_at_zero_and_are_typed():
    c = Counters()
    assert all(getattr(c, f.name) == 0 for f in dataclasses.fields(Counters))
    with pytest.raises(AttributeError):
        c.no_such_counter = 1  # slots: a misspelt counter is an error, not a silent 0


def test_stats_match_a_model_of_the_operations(open_small):
    s = open_small()
    rng = np.random.default_rng(7)
    contexts: list[list[int]] = []
    model = {"put_tokens": 0, "gets": 0, "served": 0, "misses": 0, "matches": 0, "matched": 0}
    for c in range(6):  # no two share a first chunk: no chunk is shared
        n = int(rng.integers(1, 15))
        toks = [1000 * (c + 1) + j for j in range(n)]
        put_causal(s, toks)
        contexts.append(toks)
        model["put_tokens"] += n
    for toks in contexts[::2]:
        s.get(toks)
        model["gets"] += 1
        model["served"] += len(toks)
    missing = [999_999, 999_998, 999_997]
    with pytest.raises(KeyError):
        s.get(missing)
    model["misses"] += 1  # a miss, not a get served
    for toks in contexts + [missing]:
        model["matches"] += 1
        model["matched"] += s.match(toks)
    st = s.stats()
    chunks = sum(math.ceil(len(t) / CHUNK) for t in contexts)
    assert st["disk"]["contexts"] == len(contexts)
    assert st["disk"]["tokens"] == sum(len(t) for t in contexts)
    assert st["disk"]["chunks"] == st["requests"]["chunks_written"] == chunks
    assert st["requests"]["puts_tokens"] == model["put_tokens"]
    assert st["requests"]["matches"] == model["matches"]
    assert st["requests"]["matched_tokens"] == model["matched"] == sum(len(t) for t in contexts)
    assert st["requests"]["gets"] == model["gets"]
    assert st["requests"]["served_tokens"] == model["served"]
    assert st["misses"] == model["misses"]
    served_chunks = sum(math.ceil(len(t) / CHUNK) for t in contexts[::2])
    assert st["hits"]["dram"] + st["hits"]["disk"] == served_chunks
    assert st["evictions"]["disk_contexts"] == 0 and st["evictions"]["policy"] == "scheduler"
    assert st["remote"] is None and st["queue"]["jobs"] == 0


def test_the_queue_and_its_windows_are_reported(open_small):
    s = open_small(dram_bytes=8 * 4096, disk_bytes=64 * 4096)  # 8 DRAM slots, 64 disk slots
    contexts = [[100 * (c + 1) + j for j in range(8)] for c in range(4)]  # 2 chunks each
    for toks in contexts:
        put_causal(s, toks)
    jobs = [t + [1, 2] for t in contexts[:3]]
    s.set_queue(jobs, running=[contexts[3] + [5]])
    q = s.stats()["queue"]
    st = s.stats()
    want = Windows.derive(dram_slots=st["dram"]["slots"], disk_slots=st["disk"]["slots"],
                          avg_session_slots=2.0)
    assert (q["jobs"], q["running"]) == (3, 1)
    assert (q["prefetch_window"], q["eviction_window"]) == (want.prefetch, want.eviction)
    s.set_queue([])
    q = s.stats()["queue"]
    assert (q["jobs"], q["running"]) == (0, 0)
