"""Simulated scale-out (engine.replay.multi): N servers without affinity, with and without the
shared tier, against the single-server replay of the same trace."""

import pytest

from engine.replay.costs import preset
from engine.replay.multi import MultiServerExecutor, ScaleOut
from engine.replay.server import Method, serve
from engine.replay.simulated import SimulatedExecutor
from engine.replay.workload import WorkloadConfig, build_trace
from tests.support.replay_tables import synthetic_table


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


def test_wiped_disks_leave_only_what_the_shared_tier_holds(trace):
    """Machines restarted on fresh disks every 2 minutes: alone, a server reuses only what it
    stored since its last wipe; with an object store's link (30 ms, 1 GB/s) shared, what any
    server stored before any wipe still serves."""
    cost = preset("llama-13b")
    wiped = ScaleOut(servers=4, wipe_every_s=120.0)
    alone_ex = MultiServerExecutor(Method("as"), cost, ScaleOut(servers=4))
    alone, _ = serve(trace, alone_ex)
    wiped_ex = MultiServerExecutor(Method("as"), cost, wiped)
    wiped_alone, _ = serve(trace, wiped_ex)
    shared_ex = MultiServerExecutor(Method("as"), cost, ScaleOut(
        servers=4, wipe_every_s=120.0, shared=True, remote_bps=1e9, remote_latency_s=0.03))
    shared, _ = serve(trace, shared_ex)
    assert wiped_ex.wipes >= 8 and wiped_ex.wiped_contexts > 0 and alone_ex.wipes == 0
    assert hits(wiped_alone) < hits(alone)  # the wipes cost hits
    assert hits(shared) > 1.5 * hits(wiped_alone)
    assert shared_ex.remote_hits > 0
    for j in shared:
        assert 0 <= j.reused <= j.kept


def test_scale_out_arguments_are_named():
    with pytest.raises(ValueError, match="wipe_every_s"):
        ScaleOut(wipe_every_s=0)
    with pytest.raises(ValueError, match="remote_latency_s"):
        ScaleOut(remote_latency_s=-1)
    with pytest.raises(ValueError, match="servers"):
        ScaleOut(servers=0)
    with pytest.raises(ValueError, match="caching"):
        MultiServerExecutor(Method("re"), preset("llama-13b"), ScaleOut())


def test_remote_tier_in_the_cost_model():
    """The shared tier's link: latency plus bytes over the slower of the remote link and PCIe;
    the split over it meets where compute from the front equals the fetch of the back,
    latency included, and is never slower than either pure strategy."""
    import dataclasses
    import math

    c = dataclasses.replace(preset("llama-13b"), prefill_s_per_pair=0.0, prefill_s_fixed=0.0,
                            remote_bps=12.5e9, remote_latency_s=0.002)
    beta = c.token_bytes / 12.5e9
    assert c.load_s(1000, "remote") == pytest.approx(0.002 + 1000 * beta)
    assert c.load_s(0, "remote") == 0.0
    fast = dataclasses.replace(c, remote_bps=1e12)  # bounded by PCIe on to the accelerator
    assert fast.load_s_per_token("remote") == pytest.approx(c.token_bytes / c.dram_to_hbm_bps)
    with pytest.raises(ValueError, match="tier"):
        c.load_s(1, "tape")
    with pytest.raises(ValueError, match="remote_latency_s"):
        dataclasses.replace(c, remote_latency_s=-1.0)
    reused, a = 3000, c.prefill_s_per_token
    m = c.meeting_point(reused, "remote", budget_s=c.remote_latency_s)
    assert m == pytest.approx((reused * beta + 0.002) / (a + beta))
    assert c.front_s(m) == pytest.approx(c.load_s(reused - m, "remote"))
    for name in ("llama-13b", "falcon-40b", "smollm2-cpu"):
        p = dataclasses.replace(preset(name), remote_bps=12.5e9)
        for stored in (1, 300, 3000):
            for new in (1, 200):
                for head in (-0.01, 0.0, 0.01):
                    k, took = p.split(stored, new, "remote", head_start_s=head)
                    load_all = max(p.prefill_s(new, stored), p.load_s(stored, "remote") - head
                                   + p.prefill_s(new, stored) / p.num_layers)
                    assert 0 <= k <= stored
                    assert took <= min(load_all, p.prefill_s(stored + new, 0)) + 1e-12
    assert math.isfinite(took)


def test_split_fetches_part_of_a_prefix_where_fetching_all_does_not_pay(trace):
    """LLaMA-13B over 100 Gbit/s: the KV arrives slower than four A100s recompute it, so
    fetching whole prefixes never pays (load=all declines every one). The split computes the
    front while the back arrives: every remote hit loads part of its prefix, and turns are
    served sooner than by the servers alone."""
    cost = preset("llama-13b")
    scale = ScaleOut(servers=4, shared=True, remote_bps=12.5e9)
    alone, _ = serve(trace, MultiServerExecutor(Method("as"), cost,
                                                ScaleOut(servers=4, remote_bps=12.5e9)))
    whole = MultiServerExecutor(Method("as", load="all"), cost, scale)
    serve(trace, whole)
    assert whole.remote_hits == 0 and whole.declined > 0
    ex = MultiServerExecutor(Method("as"), cost, scale)
    shared, _ = serve(trace, ex)
    assert ex.remote_hits > 0
    remote = [j for j in shared if j.hit == "remote"]
    assert len(remote) == ex.remote_hits
    for j in remote:  # something loaded, never beyond the kept history
        assert j.reused > 0 and j.reused + j.recomputed <= j.kept
    # mostly part of the prefix: the front computed (a load begun while the job queued can
    # bring a short prefix whole)
    assert sum(j.recomputed > 0 for j in remote) > len(remote) / 2
    assert hits(shared) >= 0.9 * hits(serve(trace, SimulatedExecutor(Method("as"), cost))[0])

    def mean_service(jobs):
        later = [j for j in jobs if j.turn > 0]
        return sum(j.compute_s + j.load_s for j in later) / len(later)

    assert mean_service(shared) < mean_service(alone)


# --------------------------------------------------------------------------- real mode
def test_real_replay_on_servers_sharing_redis(model, tmp_path, redis_server):
    """Real SmolLM2, two servers with their own store directories, turns routed without
    affinity. Alone, a turn whose previous turn ran on the other server finds little there;
    with the shared tier (a real redis-server) every later turn reuses its history, some of it
    fetched from Redis, and the first tokens equal recompute's."""
    import pyarrow.parquet as pq

    from engine.replay.run import ReplayConfig, replay
    from tests.support.replay_tables import real_table

    wl = WorkloadConfig(min_turns=3, context_window=300, warmup_fraction=0.0,
                        think_s=1.0, arrival_rate=0.5)
    cfg = ReplayConfig(mode="real", methods=(Method("re"), Method("as", load="all")),
                       workload=wl, store_dir=str(tmp_path / "store"),
                       scale=ScaleOut(servers=2, shared=True, url=redis_server.url, seed=1))
    summary = replay(cfg, str(tmp_path / "out"), model=model, table=real_table(model),
                     progress=False)
    alone = summary["methods"]["AS-scheduler-loadall x2"]
    shared = summary["methods"]["AS-scheduler-loadall x2+shared"]
    assert shared["hit_rate"] == 1.0
    # some turns land where the previous one did not run: that server holds at most the
    # chat template's prefix, which every conversation shares
    assert alone["reused_tokens"] < shared["reused_tokens"]
    assert alone["remote_hit_rate"] == 0 < shared["remote_hit_rate"]
    rows = pq.read_table(tmp_path / "out" / "turns.parquet").to_pylist()
    by = {(r["method"], r["conv"], r["turn"]): r for r in rows}
    for r in rows:
        if r["method"] != "AS-scheduler-loadall x2+shared" or r["turn"] == 0:
            continue
        assert r["reused_tokens"] == r["kept_tokens"]  # the whole (kept) history
        re = by[("RE", r["conv"], r["turn"])]
        if not r["truncated"]:
            assert r["first_token"] == re["first_token"]  # KV from Redis is exact
    assert (tmp_path / "store" / "AS-scheduler-loadall-x2-shared" / "server1").is_dir()


def test_real_shared_tier_needs_its_url():
    from engine.replay.run import ReplayConfig

    with pytest.raises(ValueError, match="URL"):
        ReplayConfig(mode="real", scale=ScaleOut(servers=2, shared=True))


def test_disk_read_bps_is_a_real_mode_setting_named_in_errors():
    from engine.replay.run import ReplayConfig

    assert ReplayConfig(mode="real", disk_read_bps=12e6).disk_read_bps == 12e6
    with pytest.raises(ValueError, match="disk_read_bps"):
        ReplayConfig(mode="real", disk_read_bps=-1.0)
    with pytest.raises(ValueError, match="disk_read_bps"):
        ReplayConfig(mode="simulated", disk_read_bps=12e6)
