"""Simulated scale-out (engine.replay.multi): N servers without affinity, with and without the
shared tier, against the single-server replay of the same trace."""

import pytest

from engine.replay.costs import preset
from engine.replay.multi import MultiServerExecutor, ScaleOut
from engine.replay.server import Method, serve
from engine.replay.simulated import SimulatedExecutor
from engine.replay.workload import WorkloadConfig, build_trace
from tests.engine.test_replay import synthetic_table


@pytest.fixture(scope="module")
def trace():
    return build_trace(synthetic_table(300), WorkloadConfig(arrival_rate=1.0, think_s=60.0),
                       context_window=4096)


def hits(jobs):
    later = [j for j in jobs if j.turn > 0]
    return sum(j.hit in ("dram", "disk", "remote") for j in later) / len(later)


def test_shared_tier_recovers_the_single_server_hit_rate(trace):
    cost = preset("llama-13b")
    one, _ = serve(trace, SimulatedExecutor(Method("as"), cost))
    alone, _ = serve(trace, MultiServerExecutor(Method("as"), cost, ScaleOut(servers=4)))
    ex = MultiServerExecutor(Method("as"), cost,
                             ScaleOut(servers=4, shared=True, remote_bps=1e12))
    shared, _ = serve(trace, ex)
    assert hits(alone) < 0.75 * hits(one)  # the next turn rarely lands where the last ran
    assert hits(shared) >= 0.9 * hits(one)
    assert ex.remote_hits > 0
    for j in shared:  # a reused prefix never exceeds the kept history
        assert 0 <= j.reused <= j.kept
    # a link slower than recompute is never used: the fetch must pay
    slow = MultiServerExecutor(Method("as"), cost,
                               ScaleOut(servers=4, shared=True, remote_bps=1e6))
    jobs, _ = serve(trace, slow)
    assert slow.remote_hits == 0 and slow.declined > 0
    assert hits(jobs) == pytest.approx(hits(alone))


def test_scale_out_arguments_are_named():
    with pytest.raises(ValueError, match="servers"):
        ScaleOut(servers=0)
    with pytest.raises(ValueError, match="caching"):
        MultiServerExecutor(Method("re"), preset("llama-13b"), ScaleOut())
