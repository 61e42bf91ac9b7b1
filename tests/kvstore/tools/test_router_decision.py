"""The router's pure parts (src/kvstore/tools/router/): the per-request decision against times
computed by hand, the crossover bandwidth, the exponentially weighted fits against a brute
force least squares, the prefix memory, and the request checks and bodies of the
``kv_transfer_params`` convention."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvstore.tools.router import prefixes, protocol
from kvstore.tools.router.decision import (
    Estimates,
    KVBytes,
    Prefill,
    Prompt,
    crossover_bytes_per_s,
    decide,
)
from kvstore.tools.router.estimates import Priors, RouterState
from kvstore.tools.router.fits import LinearFit, RatioFit
from kvstore.tools.router.protocol import BadRequest

MB = 1e6


def est(**kw) -> Estimates:
    base = dict(producer=Prefill(fixed_s=0.0, tokens_per_s=4000.0),
                consumer=Prefill(fixed_s=0.0, tokens_per_s=1000.0),
                link_bytes_per_s=25 * MB, kv=KVBytes(per_token=10_000.0))
    return Estimates(**{**base, **kw})


def test_a_long_prompt_goes_remote_when_the_link_beats_the_consumers_prefill():
    # 8000 tokens: local 8000/1000 = 8 s; remote 8000/4000 = 2 s + 80 MB / 25 MB/s = 3.2 s,
    # + the consumer's last token, 1/1000 s
    c = decide(Prompt(n_tokens=8000), est())
    assert c.remote and c.where == "remote"
    assert c.t_local_s == pytest.approx(8.0)
    assert c.t_remote_s == pytest.approx(2.0 + 3.2 + 0.001)
    assert c.transfer_bytes == pytest.approx(80e6)


def test_a_slow_link_keeps_the_prefill_local():
    # 5 MB/s: remote 2 + 16 + 0.001 = 18.001 s > 8 s
    c = decide(Prompt(n_tokens=8000), est(link_bytes_per_s=5 * MB))
    assert not c.remote
    assert c.t_remote_s == pytest.approx(18.001) and c.t_local_s == pytest.approx(8.0)


def test_fixed_costs_keep_short_prompts_local():
    e = est(producer=Prefill(fixed_s=0.05, tokens_per_s=4000.0),
            consumer=Prefill(fixed_s=0.05, tokens_per_s=1000.0), remote_overhead_s=0.1)
    # 40 tokens: local 0.05 + 0.04 = 0.09; remote: the producer 0.05 + 0.01, the link 0.016,
    # the consumer's request 0.05 + 0.001, the overhead 0.1: 0.227
    c = decide(Prompt(n_tokens=40), e)
    assert not c.remote
    assert c.t_local_s == pytest.approx(0.09) and c.t_remote_s == pytest.approx(0.227)


def test_what_the_consumer_holds_is_neither_computed_nor_sent():
    # 8000 tokens, 7000 held by the consumer: local 1 s; remote 2 s + 10 MB / 25 MB/s + 0.001
    c = decide(Prompt(n_tokens=8000, cached_consumer=7000), est())
    assert not c.remote
    assert c.t_local_s == pytest.approx(1.0)
    assert c.t_remote_s == pytest.approx(2.401) and c.transfer_bytes == pytest.approx(10e6)


def test_a_hybrid_models_fixed_state_is_sent_once():
    e = est(kv=KVBytes(per_token=1000.0, fixed=50e6))  # 50 MB of windows and states
    # 2000 tokens: local 2 s; remote 0.5 + (2 MB + 50 MB) / 25 MB/s + 0.001 = 2.581 s
    c = decide(Prompt(n_tokens=2000), e)
    assert not c.remote and c.t_remote_s == pytest.approx(2.581)
    # 8000 tokens: local 8 s; remote 2 + 58 MB / 25 MB/s + 0.001 = 4.321 s
    c = decide(Prompt(n_tokens=8000), e)
    assert c.remote and c.t_remote_s == pytest.approx(4.321)


def test_queues_weigh_on_their_server():
    # 9000 tokens already in flight to the producer: remote 9000/4000 + 2 + 3.2 + 0.001
    c = decide(Prompt(n_tokens=8000, queued_producer=9000), est())
    assert c.remote and c.t_remote_s == pytest.approx(7.451)
    c = decide(Prompt(n_tokens=8000, queued_producer=12000), est())
    assert not c.remote  # 3 + 2 + 3.2 + 0.001 = 8.201 s > 8 s
    # ... and in flight to the consumer, on the local path
    c = decide(Prompt(n_tokens=1000, queued_consumer=20000), est())
    assert c.remote and c.t_local_s == pytest.approx(21.0)


def test_misses_make_remote_prefill_cost_the_producers_time_plus_a_recompute():
    # miss 0.5: 0.5 * 5.201 + 0.5 * (2 + 8) = 7.6005 s < 8 s; miss 0.6: 2.0804 + 6 = 8.0804 s
    assert decide(Prompt(n_tokens=8000), est(remote_miss_rate=0.5)).t_remote_s \
        == pytest.approx(7.6005)
    assert not decide(Prompt(n_tokens=8000), est(remote_miss_rate=0.6)).remote


def test_a_remote_prefill_still_costs_the_consumers_request_and_a_tie_stays_local():
    free_link = dict(kv=KVBytes(per_token=0.0))
    same = est(producer=Prefill(fixed_s=0.0, tokens_per_s=1000.0), **free_link)
    c = decide(Prompt(n_tokens=1000), same)  # the producer's 1 s + the consumer's 1 ms
    assert not c.remote and c.t_remote_s == pytest.approx(1.001)
    # 2 tokens: local 2 ms; remote 1 ms at the producer + 1 ms for the consumer's last token
    tie = est(producer=Prefill(fixed_s=0.0, tokens_per_s=2000.0), **free_link)
    c = decide(Prompt(n_tokens=2), tie)
    assert c.t_remote_s == c.t_local_s and not c.remote


def test_the_crossover_bandwidth():
    # 8000 tokens: local 8 s, producer 2 s, the consumer's last token 1 ms: 80 MB must cross
    # in 5.999 s -> 13.3 MB/s
    assert crossover_bytes_per_s(8000, est()) == pytest.approx(80e6 / 5.999)
    # just above it remote pays, just below it does not
    for factor, remote in ((1.01, True), (0.99, False)):
        bw = crossover_bytes_per_s(8000, est()) * factor
        assert decide(Prompt(n_tokens=8000), est(link_bytes_per_s=bw)).remote is remote
    # a producer no faster than the consumer never pays
    same = est(producer=Prefill(fixed_s=0.0, tokens_per_s=1000.0))
    assert crossover_bytes_per_s(8000, same) is None


@pytest.mark.parametrize("bad", [
    dict(n_tokens=-1), dict(n_tokens=10, cached_consumer=11), dict(n_tokens=1.5),
    dict(n_tokens=10, queued_producer=-3)])
def test_a_bad_prompt_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=next(iter(k for k in bad if k != "n_tokens"),
                                              "n_tokens")):
        Prompt(**bad)


def test_bad_estimates_are_refused_by_name():
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        est(link_bytes_per_s=0.0)
    with pytest.raises(ValueError, match="remote_miss_rate"):
        est(remote_miss_rate=1.5)
    with pytest.raises(ValueError, match="tokens_per_s"):
        Prefill(fixed_s=0.0, tokens_per_s=float("nan"))


# --- the fits ------------------------------------------------------------------------------


def test_the_linear_fit_is_weighted_least_squares_with_the_prior_as_two_half_points():
    rng = np.random.default_rng(0)
    fit = LinearFit(fixed_s=0.1, tokens_per_s=500.0, alpha=0.25, span=2048.0)
    pts = [(0.0, 0.1, 0.5), (2048.0, 0.1 + 2048 / 500, 0.5)]
    for i in range(12):
        n = float(rng.integers(10, 9000))
        t = 0.3 + n / 2000.0 + float(rng.normal(0, 0.01))
        keep = 1 - max(0.25, 1 / (i + 2))
        pts = [(a, b, w * keep) for a, b, w in pts] + [(n, t, 1.0)]
        fit.observe(n, t)
    x = np.array([p[0] for p in pts])
    y = np.array([p[1] for p in pts])
    w = np.array([p[2] for p in pts])
    a_mat = np.stack([np.ones_like(x), x], 1) * np.sqrt(w)[:, None]
    (a, b), *_ = np.linalg.lstsq(a_mat, y * np.sqrt(w), rcond=None)
    assert fit.line == pytest.approx((a, b), rel=1e-9)
    assert 1 / fit.line[1] == pytest.approx(2000.0, rel=0.05)  # it found the new rate


def test_the_linear_fit_keeps_the_priors_slope_when_the_samples_give_none():
    fit = LinearFit(fixed_s=0.0, tokens_per_s=1000.0, alpha=0.5)
    for n, t in ((1000, 5.0), (2000, 1.0), (3000, 0.5)):  # longer prompts faster: noise
        fit.observe(n, t)
    a, b = fit.line
    assert b == pytest.approx(1 / 1000)
    # the fixed part: the weighted mean of t - n / 1000 over the prior's points and these
    w = [0.5 * 0.5 * 0.5 * 0.5, 0.5 * 0.5 * 0.5 * 0.5, 0.5 * 0.5, 0.5, 1.0]
    r = [0.0, 0.0, 5.0 - 1.0, 1.0 - 2.0, 0.5 - 3.0]
    assert a == pytest.approx(max(0.0, sum(x * y for x, y in zip(w, r, strict=True)) / sum(w)))


def test_an_unmeasured_server_compares_with_the_measured_one_as_the_priors_say():
    st = RouterState(Priors(kv_bytes_per_token=1.0, producer_tokens_per_s=2000.0,
                            consumer_tokens_per_s=1000.0, producer_fixed_s=0.05,
                            consumer_fixed_s=0.1))
    req = protocol.parse("/v1/completions", json.dumps({"prompt": list(range(100))}).encode())
    c = st.count(req)
    for n, t in ((100, 0.6), (1000, 1.5), (3000, 3.5)):  # 0.5 s + 1 ms a token
        st.observe_local(c, protocol.Reply(prompt_tokens=n, cached_tokens=0), t, 0)
    e = st.estimates()
    # the producer: twice the consumer's measured rate, half its fixed cost (the priors')
    assert e.producer.tokens_per_s == pytest.approx(2 * e.consumer.tokens_per_s)
    assert e.producer.fixed_s == pytest.approx(e.consumer.fixed_s / 2)
    assert e.consumer.fixed_s > 0.2  # measured, not the prior's 0.1


def test_a_ratio_fit_starts_at_its_prior_and_moves_by_alpha():
    f = RatioFit(value=100.0, alpha=0.25)
    assert f.current == 100.0
    f.observe(400.0, 1.0)  # the first sample halves the prior's weight: (50 + 400) / 1.5
    assert f.current == pytest.approx(300.0)
    f.observe(float("nan"), 1.0)
    f.observe(5.0, 0.0)
    assert f.samples == 1  # ignored
    for _ in range(30):
        f.observe(400.0, 1.0)
    assert f.current == pytest.approx(400.0, rel=1e-3)


# --- the prefix memory and the counting -------------------------------------------------------


def test_the_prefix_memory_finds_leading_blocks_only():
    mem = prefixes.PrefixMemory(capacity=8)
    a = "x" * 1000
    mem.remember(prefixes.blocks(a))
    assert mem.held(prefixes.blocks(a + "y" * 300)) == 1000 // prefixes.TEXT_BLOCK
    assert mem.held(prefixes.blocks("z" + a)) == 0  # another first block: nothing
    ids = list(range(100))
    mem.remember(prefixes.blocks(ids))
    assert mem.held(prefixes.blocks(ids[:64] + [7] * 40)) == 2
    assert len(mem) == 8  # bounded: the oldest blocks forgotten


def test_the_state_counts_tokens_and_what_each_server_holds():
    st = RouterState(Priors(kv_bytes_per_token=1.0, tokens_per_char=0.25))
    req = protocol.parse("/v1/completions", json.dumps({"prompt": "a" * 1024}).encode())
    c = st.count(req)
    assert c.prompt.n_tokens == 256 and c.prompt.cached_consumer == 0
    st.remember("consumer", c)
    longer = protocol.parse("/v1/completions", json.dumps({"prompt": "a" * 2048}).encode())
    c2 = st.count(longer)
    assert c2.prompt.n_tokens == 512 and c2.prompt.cached_consumer == 256
    assert c2.prompt.cached_producer == 0
    ids = protocol.parse("/v1/completions", json.dumps({"prompt": list(range(70))}).encode())
    assert st.count(ids).prompt.n_tokens == 70  # token ids are counted exactly
    with st.in_flight("producer", 300):
        assert st.count(req).prompt.queued_producer == 300
    assert st.count(req).prompt.queued_producer == 0


# --- the requests ---------------------------------------------------------------------------


def parse(body, path="/v1/completions"):
    return protocol.parse(path, body if isinstance(body, bytes) else json.dumps(body).encode())


@pytest.mark.parametrize("body, param, status", [
    (b"{not json", "body", 400),
    ([1, 2], "body", 400),
    ({"max_tokens": 4}, "prompt", 400),
    ({"prompt": 7}, "prompt", 400),
    ({"prompt": [1, -2]}, "prompt", 400),
    ({"prompt": "hi", "stream": "yes"}, "stream", 400),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", 400),
    ({"prompt": "hi", "kv_transfer_params": 3}, "kv_transfer_params", 400),
    ({"prompt": "hi", "kv_transfer_params": {"kvstore": []}}, "kv_transfer_params.kvstore",
     400),
    ({"prompt": "hi", "kv_transfer_params": {"kvstore": {"produced": {}}}},
     "kv_transfer_params.kvstore", 400),
])
def test_a_bad_completion_request_names_its_field(body, param, status):
    with pytest.raises(BadRequest) as e:
        parse(body)
    assert e.value.param == param and e.value.status == status
    assert e.value.body()["error"]["param"] == param


def test_a_bad_chat_request_names_its_field():
    for body, param in (({"messages": []}, "messages"),
                        ({"messages": [{"content": "hi"}]}, "messages[0]"),
                        ({"messages": [{"role": "user", "content": 5}]},
                         "messages[0].content")):
        with pytest.raises(BadRequest) as e:
            parse(body, "/v1/chat/completions")
        assert e.value.param == param
    with pytest.raises(BadRequest) as e:
        parse({"prompt": "x"}, "/v1/embeddings")
    assert e.value.status == 404


def test_what_cannot_be_prefilled_remotely_is_named():
    assert parse({"prompt": ["a", "b"]}).local_only == "a batch of prompts"
    assert parse({"prompt": "a", "echo": True}).local_only == "echo"
    img = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    assert parse(img, "/v1/chat/completions").local_only == "content other than text"
    assert parse({"prompt": "a"}).local_only is None


def test_the_producer_gets_one_token_unstreamed_and_the_consumer_the_producers_params():
    req = parse({"prompt": "hello", "max_tokens": 50, "stream": True,
                 "stream_options": {"include_usage": True},
                 "kv_transfer_params": {"kvstore": {"pin": True}}})
    p = protocol.producer_body(req)
    assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                       "kvstore": {"pin": True, "produce": True}}
    produced = {"do_remote_prefill": True, "do_remote_decode": False,
                "prompt_token_ids": [1, 2, 3],
                "kvstore": {"produced": {"num_tokens": 3, "durable": "remote"}}}
    c = protocol.consumer_body(req, produced, 2.5)
    assert c["max_tokens"] == 50 and c["stream"] is True  # the client's own request
    assert c["kv_transfer_params"] == {
        "do_remote_prefill": True, "do_remote_decode": False, "prompt_token_ids": [1, 2, 3],
        "kvstore": {"produced": {"num_tokens": 3, "durable": "remote"}, "pin": True,
                    "deadline_s": 2.5}}
    assert produced["kvstore"] == {"produced": {"num_tokens": 3, "durable": "remote"}}
    local = protocol.consumer_body(req, None, None)
    assert local["kv_transfer_params"] == {"kvstore": {"pin": True}}
    assert "kv_transfer_params" not in protocol.consumer_body(parse({"prompt": "x"}), None,
                                                              None)


def test_a_servers_reply_is_read_only_where_its_fields_have_their_types():
    r = protocol.read_reply({
        "usage": {"prompt_tokens": 100, "completion_tokens": 5,
                  "prompt_tokens_details": {"cached_tokens": 64}},
        "kv_transfer_params": {"kvstore": {"produced": {"num_tokens": 100, "bytes": 2300},
                                           "loaded_tokens": 99, "loaded_bytes": "lots",
                                           "load_failed": False}},
        "metrics": {"time_to_first_token_ms": 250.0, "queue_time_ms": 3.0}})
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (100, 5, 64)
    assert (r.produced_tokens, r.produced_bytes, r.loaded_tokens) == (100, 2300, 99)
    assert r.loaded_bytes is None and r.load_failed is False
    assert r.server_ttft_s == pytest.approx(0.25)
    bad = protocol.read_reply({"usage": {"prompt_tokens": -4}, "kv_transfer_params": [1],
                               "metrics": {"time_to_first_token_ms": "soon"}})
    assert bad.prompt_tokens is None and bad.params is None and bad.server_ttft_s is None
    assert protocol.read_reply("nonsense") == protocol.Reply()


def test_a_stream_event_with_text_is_told_from_one_without():
    assert protocol.sse_has_token(b'data: {"choices": [{"text": " Hi"}]}')
    assert protocol.sse_has_token(b'data: {"choices": [{"delta": {"content": "x"}}]}')
    assert not protocol.sse_has_token(b'data: {"choices": [{"delta": {"role": "assistant"}}]}')
    assert not protocol.sse_has_token(b"data: [DONE]")
    assert not protocol.sse_has_token(b": keep-alive")
