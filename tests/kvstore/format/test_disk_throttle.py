"""The slow-disk knob: a token bucket on segment reads (kvstore.format.disk_throttle)."""

import time

import pytest
import torch

import kvstore
from kvstore.format.disk_throttle import ReadThrottle, TokenBucket
from tests.support.kvgen import causal_kv, put_causal

LAYOUT = kvstore.KVLayout(num_layers=6, num_kv_heads=2, head_dim=8, model_id="thr")


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def test_bucket_due_times_by_hand():
    clk = FakeClock()
    b = TokenBucket(ReadThrottle(bytes_per_s=1000.0, burst_bytes=500), clock=clk,
                    sleep=clk.sleep)
    assert b.reserve(400) == 100.0  # within the burst: due now
    assert b.reserve(600) == pytest.approx(100.5)  # 100 left, 500 in debt: 0.5 s at 1000 B/s
    assert b.reserve(1000) == pytest.approx(101.5)  # queued behind the debt
    b.wait(101.5)
    assert clk.slept == [pytest.approx(1.5)] and clk.t == pytest.approx(101.5)
    b.wait(101.0)  # already due: no sleep
    assert len(clk.slept) == 1
    clk.t += 10.0  # idle: the bucket refills to the burst, not beyond
    assert b.reserve(500) == clk.t
    assert b.reserve(100) == pytest.approx(clk.t + 0.1)


@pytest.mark.parametrize(("kw", "name"), [
    ({"bytes_per_s": 0}, "bytes_per_s"), ({"bytes_per_s": float("inf")}, "bytes_per_s"),
    ({"bytes_per_s": True}, "bytes_per_s"),
    ({"bytes_per_s": 1e6, "burst_bytes": -1}, "burst_bytes"),
    ({"bytes_per_s": 1e6, "burst_bytes": 1.5}, "burst_bytes")])
def test_bad_throttle_config(kw, name):
    with pytest.raises(ValueError, match=name):
        ReadThrottle(**kw)


def test_throttled_store_reads_the_same_bytes_slower(tmp_path):
    with kvstore.open(tmp_path / "st", layout=LAYOUT, chunk_tokens=16, dram_bytes=0,
                      disk_bytes=1 << 22) as s:
        toks = list(range(160))  # 10 chunks, 3 KiB each
        put_causal(s, toks)
        k, v = causal_kv(LAYOUT, toks)
        nbytes = len(toks) * LAYOUT.token_bytes
        rate = nbytes / 0.25  # the whole context in 0.25 s
        with pytest.raises(TypeError, match="throttle"):
            s.throttle_disk_reads(1e6)
        s.throttle_disk_reads(kvstore.ReadThrottle(bytes_per_s=rate, burst_bytes=0))
        s.drop_caches()
        t = time.perf_counter()
        gk, gv = s.get(toks)
        slow = time.perf_counter() - t
        assert torch.equal(gk, k) and torch.equal(gv, v)
        assert slow >= 0.25 * 0.95  # never faster than the emulated device
        t = time.perf_counter()
        with s.load_layers(toks) as load:
            lk, _ = load.wait(LAYOUT.num_layers - 1)
            assert torch.equal(lk, k[-1])
        assert time.perf_counter() - t >= 0.25 * 0.95
        assert load.load_s >= 0.25 * 0.95  # the loader's own time counts the throttle
        s.throttle_disk_reads(None)
        gk, _ = s.get(toks)
        assert torch.equal(gk, k)
