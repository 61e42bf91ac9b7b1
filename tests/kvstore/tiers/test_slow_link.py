"""The shared tiers across a real slow link: network namespaces joined through a bridge by veth
pairs that ``tc tbf`` shapes (tests/support/netns.py). A store in the producer's namespace
writes through to a redis-server (or a SeaweedFS) in the tier's namespace, a fresh store in the
consumer's namespace reads it back over its own link, and the bytes are the causal KV's, bit
for bit. That the traffic crossed the shaped links is read from the kernel's own counters (the
tbf qdiscs' bytes) and the tier's (Redis's network bytes); the rates are asserted only in the
serial tests, alone on the machine. Skipped with the reason where namespaces cannot be made."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.link_worker import CHUNK_TOKENS, LINK_LAYOUT
from tests.support.netns import Hub, Shaping, measure_tcp, require_netns
from tests.support.paths import ROOT
from tests.support.redis_servers import Server
from tests.support.seaweed import ACCESS_KEY, BUCKET, SECRET_KEY, Weed

N_TOKENS = 16 * CHUNK_TOKENS  # 4 MiB of KV in LINK_LAYOUT
WORKER_S = 180


@pytest.fixture
def hub():
    require_netns()
    with Hub(members={"producer": Shaping(rate_mbit=100), "consumer": Shaping(rate_mbit=100)}
             ) as h:
        yield h


def run_worker(hub: Hub, member: str, *args: str, env: dict | None = None) -> dict:
    """``python -m tests.support.link_worker ARGS`` inside ``member``'s namespace; its
    RESULT."""
    p = hub.popen(member, [sys.executable, "-m", "tests.support.link_worker", *args],
                  cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                  env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    out, err = p.communicate(timeout=WORKER_S)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"worker {args[0]} failed ({p.returncode}): {err[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def redis_net_bytes(hub: Hub, server: Server) -> tuple[int, int]:
    """The tier's own counters: bytes Redis read from and wrote to its clients."""
    info = hub.call_in("tier", server.cli, "info", "stats")
    fields = dict(ln.split(":", 1) for ln in info.splitlines() if ":" in ln)
    return int(fields["total_net_input_bytes"]), int(fields["total_net_output_bytes"])


def test_the_link_is_no_faster_than_its_tbf_rate():
    """Both directions of a 40 Mbit/s link carry a 2 MB transfer no faster than 40 Mbit/s
    (load only slows a transfer; a link that were not shaped would run at memory speed), and
    the tbf qdiscs on both ends counted those bytes."""
    require_netns()
    rate = 40.0
    with Hub(members={"a": Shaping(rate_mbit=rate)}) as h:
        before = h.qdisc_sent_bytes("a")
        up = measure_tcp(h, "a", "tier", 2_000_000)
        down = measure_tcp(h, "tier", "a", 2_000_000)
        after = h.qdisc_sent_bytes("a")
    assert up.mbit_per_s <= rate * 1.05, up
    assert down.mbit_per_s <= rate * 1.05, down
    assert after["up"] - before["up"] >= 2_000_000
    assert after["down"] - before["down"] >= 2_000_000


@pytest.mark.serial
@pytest.mark.parametrize("rate", [20.0, 200.0])
def test_the_link_runs_at_its_tbf_rate(rate):
    """Alone on the machine, a TCP transfer through the link reaches its tbf rate within the
    headers' share (about 3%) and a margin: between 0.85 and 1.03 of it, both directions."""
    require_netns()
    nbytes = int(rate * 1e6 / 8 * 1.5)  # 1.5 s at the rate: the bucket's burst weighs little
    with Hub(members={"a": Shaping(rate_mbit=rate), "b": Shaping(rate_mbit=rate),
                      "c": None}) as h:
        for src, dst in (("a", "tier"), ("tier", "a"), ("a", "b")):
            m = measure_tcp(h, src, dst, nbytes)
            assert 0.85 * rate <= m.mbit_per_s <= 1.03 * rate, (src, dst, m, m.mbit_per_s)
        unshaped = measure_tcp(h, "c", "tier", nbytes)
    assert unshaped.mbit_per_s > rate * 1.5, unshaped  # the bridge itself is not the limit


def _shared_redis(hub: Hub, tmp_path) -> Server:
    return hub.call_in("tier", Server, tmp_path / "redis", host=hub.address("tier"))


def test_a_store_reads_what_another_namespace_wrote_through_redis_in_the_tier(hub, tmp_path):
    server = _shared_redis(hub, tmp_path)
    try:
        before_q = {m: hub.qdisc_sent_bytes(m) for m in ("producer", "consumer")}
        in0, out0 = redis_net_bytes(hub, server)
        put = run_worker(hub, "producer", "put", "--store", str(tmp_path / "a"),
                         "--remote", server.url, "--tokens", str(N_TOKENS), "--seed", "3")
        in1, out1 = redis_net_bytes(hub, server)
        got = run_worker(hub, "consumer", "get", "--store", str(tmp_path / "b"),
                         "--remote", server.url, "--tokens", str(N_TOKENS), "--seed", "3")
        in2, out2 = redis_net_bytes(hub, server)
        after_q = {m: hub.qdisc_sent_bytes(m) for m in ("producer", "consumer")}
    finally:
        server.stop()
    payload = N_TOKENS * LINK_LAYOUT.token_bytes
    assert put["stats"]["written_chunks"] == N_TOKENS // CHUNK_TOKENS, put
    assert got["matched"] == N_TOKENS and got["equal"], got
    assert got["stats"]["fetched_bytes"] >= payload, got
    # the tier received the KV from the producer's side and sent it to the consumer's
    assert in1 - in0 >= payload and out2 - out1 >= payload
    # ... across the shaped links: the kernel's tbf counters saw those bytes
    assert after_q["producer"]["up"] - before_q["producer"]["up"] >= payload
    assert after_q["consumer"]["down"] - before_q["consumer"]["down"] >= payload
    # ... and not across the other member's link
    assert after_q["consumer"]["up"] - before_q["consumer"]["up"] < payload // 4
    assert after_q["producer"]["down"] - before_q["producer"]["down"] < payload // 4


def test_a_store_reads_what_another_namespace_wrote_to_seaweedfs_in_the_tier(hub, tmp_path):
    weed = hub.call_in("tier", Weed, tmp_path / "weed", host=hub.address("tier"))
    try:
        env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        url = weed.url(BUCKET, "link")
        before = {m: hub.qdisc_sent_bytes(m) for m in ("producer", "consumer")}
        put = run_worker(hub, "producer", "put", "--store", str(tmp_path / "a"), "--objects",
                         url, "--tokens", str(N_TOKENS), "--seed", "5", env=env)
        got = run_worker(hub, "consumer", "get", "--store", str(tmp_path / "b"), "--objects",
                         url, "--tokens", str(N_TOKENS), "--seed", "5", env=env)
        after = {m: hub.qdisc_sent_bytes(m) for m in ("producer", "consumer")}
    finally:
        weed.stop()
    payload = N_TOKENS * LINK_LAYOUT.token_bytes
    assert put["stats"]["written_chunks"] == N_TOKENS // CHUNK_TOKENS, put
    assert got["matched"] == N_TOKENS and got["equal"], got
    assert after["producer"]["up"] - before["producer"]["up"] >= payload
    assert after["consumer"]["down"] - before["consumer"]["down"] >= payload


@pytest.mark.serial
def test_a_transfer_through_redis_takes_the_links_time(tmp_path):
    """Alone on the machine: the consumer's read of 4 MiB over a 20 Mbit/s link takes at least
    the bytes' time at that rate (it cannot beat the link) and at most three times it plus
    the store's start (it is the link, not something else, that the time is spent on)."""
    require_netns()
    rate = 20.0
    with Hub(members={"producer": Shaping(rate_mbit=rate), "consumer": Shaping(rate_mbit=rate)}
             ) as h:
        server = _shared_redis(h, tmp_path)
        try:
            run_worker(h, "producer", "put", "--store", str(tmp_path / "a"), "--remote",
                       server.url, "--tokens", str(N_TOKENS), "--seed", "7")
            got = run_worker(h, "consumer", "get", "--store", str(tmp_path / "b"), "--remote",
                             server.url, "--tokens", str(N_TOKENS), "--seed", "7")
        finally:
            server.stop()
    assert got["equal"], got
    link_s = got["stats"]["fetched_bytes"] / (rate * 1e6 / 8)
    assert link_s * 0.95 <= got["seconds"] <= link_s * 3 + 1.0, (got["seconds"], link_s)


def test_a_batch_longer_on_the_link_than_the_stall_timeout_is_written_through(tmp_path):
    """``timeout_s`` bounds a stall, ``deadline_s`` a call: chunks of 256 KiB over a 0.6 Mbit/s
    link (3.5 s of sending each) with a stall timeout of 2.5 s (above what TCP's
    retransmissions of tbf's drops pause a transfer) and a deadline of 60 s are written
    whole, and read back bit for bit (a send bounded as a whole by the stall timeout failed
    every such chunk: a producer behind a slow link wrote nothing)."""
    require_netns()
    rate, n = 0.6, 3 * CHUNK_TOKENS
    with Hub(members={"producer": Shaping(rate_mbit=rate), "consumer": Shaping(rate_mbit=100)}
             ) as h:
        server = _shared_redis(h, tmp_path)
        try:
            limits = ("--remote-timeout-s", "2.5", "--remote-deadline-s", "60")
            put = run_worker(h, "producer", "put", "--store", str(tmp_path / "a"), "--remote",
                             server.url, "--tokens", str(n), "--seed", "11", *limits)
            got = run_worker(h, "consumer", "get", "--store", str(tmp_path / "b"), "--remote",
                             server.url, "--tokens", str(n), "--seed", "11", *limits)
        finally:
            server.stop()
    assert put["stats"]["written_chunks"] == n // CHUNK_TOKENS, json.dumps(put["stats"])
    assert put["stats"]["write_failed"] == 0, json.dumps(put["stats"])
    assert got["matched"] == n and got["equal"], got
