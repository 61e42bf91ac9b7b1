"""Retention hints per request, without an engine: the parsing of ``cache_control`` and of
vLLM's ``kv_transfer_params``, ``kvstore serve``'s middleware carrying a request's hint to the
thread that saves its context, and the admin routes (a bare FastAPI app on a real store)."""

from __future__ import annotations

import pytest

import kvstore
from kvstore.integrations import retention
from kvstore.integrations.retention import Hint
from tests.support.kvgen import put_causal

T = list(range(100, 110))


def test_cache_control_and_kv_transfer_params_parse_to_one_hint():
    body = retention.from_request_body
    assert body({"prompt": "hi"}) is None
    assert body({"cache_control": {"type": "pinned"}}) == Hint(None)
    assert body({"cache_control": {"type": "ephemeral"}}) == Hint(300.0)
    assert body({"kvstore": {"cache_control": {"type": "ephemeral", "ttl": "1h"}}}) == \
        Hint(3600.0)
    assert body({"cache_control": {"type": "pinned", "ttl_s": 40}}) == Hint(40.0)
    for bad, field in (({"cache_control": {"type": "forever"}}, "cache_control.type"),
                       ({"cache_control": {"type": "pinned", "ttl_s": -1}},
                        "cache_control.ttl_s"),
                       ({"kvstore": {"cache_control": {"type": "ephemeral", "ttl": "soon"}}},
                        "kvstore.cache_control.ttl"),
                       ({"cache_control": "pinned"}, "cache_control"),
                       ({"cache_control": {"type": "pinned", "size": 1}}, "cache_control"),
                       ({"kvstore": 3}, "kvstore")):
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            body(bad)
    kv = retention.from_kv_transfer_params
    assert kv(None) is None and kv({"other": 1}) is None
    assert kv({"kvstore": {"pin": False}}) is None
    assert kv({"kvstore": {"pin": True}}) == Hint(None)
    assert kv({"kvstore": {"pin": True, "ttl_s": 40}}) == Hint(40.0)
    assert kv({"kvstore": {"ttl_s": 40}}) == Hint(40.0)
    assert kv({"kvstore": {"cache_control": {"type": "ephemeral"}}}) == Hint(300.0)
    with pytest.raises(ValueError, match="kv_transfer_params.kvstore.pin"):
        kv({"kvstore": {"pin": "yes"}})
    with pytest.raises(ValueError, match="pin false with a ttl_s"):
        kv({"kvstore": {"pin": False, "ttl_s": 40}})
    with pytest.raises(ValueError, match="ttl"):
        body({"cache_control": {"type": "pinned", "ttl_s": 10**400}})


def test_apply_pins_or_reports_why_not(open_small):
    s = open_small(disk_bytes=40 * 4096)
    put_causal(s, T)
    assert retention.apply(s, T, None, None) is None
    assert retention.apply(s, T, None, Hint(60.0)) == "pinned"
    assert s.pins()[0].expires is not None
    big = list(range(48))
    put_causal(s, big)
    assert retention.apply(s, big, None, Hint()).startswith("refused: PinRefused")
    assert retention.apply(s, [1, 2], None, Hint()).startswith("refused: KeyError")


@pytest.fixture
def client_and_store(open_small):
    pytest.importorskip("fastapi")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kvstore.integrations.llama_cpp import admin, tenants

    s = open_small(disk_bytes=40 * 4096)
    app = FastAPI()
    admin.add_routes(app, lambda: s)
    app.add_middleware(tenants.Gate, keys=tenants.KeyRing())  # a server without keys
    with TestClient(app) as client:
        yield client, s


def test_admin_routes_list_pin_unpin_and_delete(client_and_store):
    client, s = client_and_store
    put_causal(s, T)
    put_causal(s, T, namespace="t")
    (c,) = client.get("/kvstore/contexts").json()["contexts"][:1]
    assert set(c) == {"key", "namespace", "named", "tokens", "bytes", "pinned", "expires"}
    r = client.post("/kvstore/pin", json={"tokens": T, "namespace": "t", "ttl_s": 60})
    assert r.status_code == 200 and r.json()["namespace"] == "t"
    listed = client.get("/kvstore/contexts").json()
    assert listed["pins"] == 1
    (mine,) = [c for c in listed["contexts"] if c["pinned"]]
    assert mine["namespace"] == "t" and mine["tokens"] == 10
    r = client.post("/kvstore/unpin", json={"key": mine["key"], "namespace": "t"})
    assert r.json() == {"unpinned": True}
    assert client.post("/kvstore/pin", json={"key": mine["key"]}).status_code == 404
    assert client.post("/kvstore/pin", json={"key": "xyz"}).status_code == 422
    assert client.post("/kvstore/pin", content=b"{").status_code == 400
    put_causal(s, list(range(48)))
    r = client.post("/kvstore/pin", json={"tokens": list(range(48))})
    assert r.status_code == 409 and r.json()["error"]["type"] == "pin_refused"
    assert client.post("/kvstore/delete", json={"namespace": "t"}).json() == {"deleted": 1}
    assert client.post("/kvstore/delete", json={}).status_code == 422
    assert s.match(T, namespace="t") == 0 and s.match(T) == len(T)


def test_the_servers_middleware_hands_the_hint_to_the_saving_thread(open_small):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("fastapi")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kvstore.integrations.llama_cpp.server import checked_body

    s = open_small(disk_bytes=40 * 4096)
    app = FastAPI()

    @app.post("/v1/completions")
    def complete() -> dict:  # a sync route runs in the thread pool, as the
        put_causal(s, T)  # llama-cpp-python server's completion (and its cache save) does
        req = retention.REQUEST.get()
        if req is not None:
            req.outcome = retention.apply(s, T, None, req.hint)
        return {"ok": True}

    app.middleware("http")(checked_body)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 200 and "x-kvstore-retention" not in r.headers
        assert s.pins() == []
        r = client.post("/v1/completions", json={"prompt": "hi", "cache_control": {
            "type": "ephemeral", "ttl_s": 90}})
        assert r.headers["x-kvstore-retention"] == "pinned"
        (p,) = s.pins()
        assert p.expires is not None and p.key == s.list_contexts()[0].key
        r = client.post("/v1/completions", json={"prompt": "hi", "cache_control": {
            "type": "always"}})
        assert r.status_code == 422
        assert r.json()["error"]["param"] == "cache_control.type"
    assert isinstance(p, kvstore.PinRecord)
