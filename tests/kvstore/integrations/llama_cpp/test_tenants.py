"""``kvstore serve``'s keys and tenants without a model: the keys file and options checked as
untrusted input, the key check (:class:`tenants.Gate`) in front of a real app, and the admin
routes on a real store driven by two tenants, a tenant of the default namespace, the admin
and strangers against a model of what each may see and change (a hypothesis state machine:
after every call, the store's contexts and pins are exactly the model's)."""

from __future__ import annotations

import argparse
import itertools
import json
import os

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvstore.format.records import MAX_NAMESPACE_BYTES
from kvstore.integrations.llama_cpp import tenants
from tests.support.kvgen import put_causal

pytest.importorskip("fastapi")

KEYS = {"sk-alice-1": "alice", "sk-alice-2": "alice", "sk-bob": "bob", "sk-shared": None}
ADMIN = "sk-admin"
TOKENS = (tuple(range(100, 110)), tuple(range(200, 213)))  # every namespace stores both
NAMESPACES = ("alice", "bob", None)


def options(tmp_path, keys: dict | None = None, **kw) -> argparse.Namespace:
    """Parsed ``kvstore serve`` key options: ``keys`` written as the --api-keys file."""
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    tenants.add_options(p)
    argv = ["--host", kw.pop("host", "127.0.0.1")]
    if keys is not None:
        path = tmp_path / "keys.json"
        path.write_text(json.dumps(keys))
        argv += ["--api-keys", str(path)]
    for name, value in kw.items():
        flag = "--" + name.replace("_", "-")
        argv += [flag] if value is True else [flag, value]
    return p.parse_args(argv)


def test_a_keys_file_maps_keys_to_namespaces(tmp_path):
    ring = tenants.key_ring(options(tmp_path, KEYS, admin_key=ADMIN))
    assert not ring.open and ring.has_admin
    assert ring.namespaces == {"alice", "bob", None}
    assert ring.caller("sk-alice-1") == ring.caller("sk-alice-2") == \
        tenants.Caller(namespace="alice")
    assert ring.caller("sk-shared") == tenants.Caller(namespace=None)
    assert ring.caller(ADMIN) == tenants.Caller(namespace=None, admin=True)
    for wrong in ("sk-bo", "sk-bobb", "SK-BOB", "", None, "sk-bob\u00e9", "sk-admin "):
        assert ring.caller(wrong) is None
    text = repr(ring) + tenants.describe(ring, "http://127.0.0.1:1")
    assert not any(k in text for k in (*KEYS, ADMIN))
    one = tenants.key_ring(options(tmp_path, api_key="sk-one"))
    assert one.caller("sk-one") == tenants.Caller(namespace=None) and not one.has_admin
    assert tenants.key_ring(options(tmp_path)).open


@pytest.mark.parametrize("content,message", [
    (b"{", "not a JSON object"),
    (b"\xff\xfe", "not a JSON object"),
    (b'["sk-a"]', "must be a JSON object"),
    (b"{}", "holds no keys"),
    (b'{"sk-a": "x", "sk-a": "y"}', "the 2nd entry repeats an earlier key"),
    (b'{"": "x"}', "the 1st entry's key must be a non-empty string"),
    (b'{"sk a": "x"}', "the 1st entry's key may hold printable ASCII only"),
    (b'{"sk-a": "x", "sk-\\u00e9": "y"}', "the 2nd entry's key may hold printable ASCII"),
    (b'{"sk-a": 3}', "the 1st entry's namespace must be a non-empty string or null"),
    (b'{"sk-a": {"ns": "x"}}', "the 1st entry's namespace must be a non-empty string"),
    (b'{"sk-a": ""}', "namespace must be a non-empty string or null, got an empty one"),
    (b'{"sk-a": "\\ud800"}', "namespace is not text UTF-8 can encode"),
    (('{"sk-a": "%s"}' % ("n" * (MAX_NAMESPACE_BYTES + 1))).encode(), "namespace is longer"),
    (('{"%s": null}' % ("k" * 1025)).encode(), "key is longer than 1024"),
])
def test_a_bad_keys_file_is_refused_naming_the_option_never_a_key(tmp_path, content, message):
    path = tmp_path / "keys.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="--api-keys") as e:
        tenants.load_keys_file(str(path))
    assert message in str(e.value)
    assert "sk-a" not in str(e.value) and "sk a" not in str(e.value)


def test_keys_files_that_are_not_files_and_conflicting_options_are_refused(tmp_path):
    for path, message in ((tmp_path / "none.json", "cannot read it"),
                          (tmp_path, "not a regular file")):
        with pytest.raises(ValueError, match=f"--api-keys .*{message}"):
            tenants.load_keys_file(str(path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # refused at once, not read (which would block until a writer came)
    with pytest.raises(ValueError, match="not a regular file"):
        tenants.load_keys_file(str(fifo))
    with pytest.raises(ValueError, match="--api-key is also a key of --api-keys"):
        tenants.key_ring(options(tmp_path, KEYS, api_key="sk-bob"))
    with pytest.raises(ValueError, match="--admin-key is also a tenant's key"):
        tenants.key_ring(options(tmp_path, KEYS, admin_key="sk-bob"))
    with pytest.raises(ValueError, match="--api-key may hold printable ASCII only"):
        tenants.key_ring(options(tmp_path, api_key="two words"))
    with pytest.raises(ValueError, match="--admin-key must be a non-empty"):
        tenants.key_ring(options(tmp_path, admin_key=""))


def test_without_keys_only_loopback_is_served_unless_opened_on_purpose(tmp_path):
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert tenants.key_ring(options(tmp_path, host=host)).open
    for host in ("0.0.0.0", "::", "10.1.2.3", "192.0.2.1"):
        with pytest.raises(ValueError, match=f"--host '{host}' is not a loopback address"):
            tenants.key_ring(options(tmp_path, host=host))
        assert tenants.key_ring(options(tmp_path, host=host, allow_unauthenticated=True)).open
        assert not tenants.key_ring(options(tmp_path, host=host, api_key="sk-one")).open
    line = tenants.describe(tenants.KeyRing(), "http://127.0.0.1:8000")
    assert "open to every client that can reach http://127.0.0.1:8000" in line


def _app(store, ring: tenants.KeyRing):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kvstore.integrations.llama_cpp import admin

    app = FastAPI()
    admin.add_routes(app, lambda: store, stats_of=lambda: {"lookups": 7},
                     namespaces=ring.namespaces)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    def chat() -> dict:  # what the completion would run in
        return {"namespace": tenants.NAMESPACE.get()}

    app.add_middleware(tenants.Gate, keys=ring)
    return TestClient(app)


def _snapshot(store) -> tuple:
    return (sorted((c.key, c.n_tokens) for c in store.list_contexts()),
            sorted((p.key, p.namespace) for p in store.pins()))


ROUTES = [("GET", "/kvstore/contexts", None), ("GET", "/kvstore/stats", None),
          ("POST", "/kvstore/pin", {"tokens": list(TOKENS[0]), "namespace": "alice"}),
          ("POST", "/kvstore/unpin", {"tokens": list(TOKENS[0]), "namespace": "alice"}),
          ("POST", "/kvstore/delete", {"namespace": "alice"}),
          ("POST", "/kvstore/delete", {"tokens": list(TOKENS[1])}),
          ("POST", "/v1/chat/completions", {"messages": []}),
          ("GET", "/v1/models", None), ("GET", "/docs", None), ("GET", "/openapi.json", None),
          ("POST", "/no/such/route", {})]


def test_requests_without_a_valid_key_are_refused_401_and_change_nothing(open_small):
    s = open_small(disk_bytes=100 * 4096)
    for ns in NAMESPACES:
        for t in TOKENS:
            put_causal(s, t, namespace=ns)
    s.pin(TOKENS[1], namespace="alice")
    before = _snapshot(s)
    client = _app(s, tenants.KeyRing.of(KEYS, ADMIN))
    strangers = [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Bearer"},
                 {"Authorization": "Basic c2stYm9i"}, {"Authorization": "sk-bob"},
                 {"Authorization": "Bearer sk-bob2"}, {"X-Api-Key": "sk-bob"}]
    for headers in strangers:
        for method, path, body in ROUTES:
            r = client.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (headers, path)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] in ("missing_api_key", "invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
    r = client.get("/kvstore/contexts", headers=[("Authorization", "Bearer sk-bob"),
                                                 ("Authorization", "Bearer sk-admin")])
    assert r.status_code == 401 and "more than one" in r.json()["error"]["message"]
    assert _snapshot(s) == before
    # the open route and a CORS preflight pass without a key; a key of a tenant works
    assert client.get("/health").json() == {"status": "ok"}
    assert client.options("/v1/chat/completions", headers={
        "Origin": "http://x", "Access-Control-Request-Method": "POST"}).status_code != 401
    assert client.options("/v1/chat/completions").status_code == 401
    r = client.post("/v1/chat/completions", json={}, headers={"Authorization":
                                                             "bearer  sk-bob "})
    assert r.json() == {"namespace": "bob"}
    r = client.post("/v1/chat/completions", json={}, headers={"Authorization":
                                                             f"Bearer {ADMIN}"})
    assert r.json() == {"namespace": None}
    r = client.get("/kvstore/stats", headers={"Authorization": "Bearer sk-alice-1"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only"
    assert client.get("/kvstore/stats", headers={"Authorization": f"Bearer {ADMIN}"}
                      ).json() == {"lookups": 7}


def test_an_open_server_lets_everyone_in_as_the_admin_of_the_default_namespace(open_small):
    s = open_small()
    put_causal(s, TOKENS[0], namespace="alice")
    client = _app(s, tenants.KeyRing())
    assert client.post("/v1/chat/completions", json={}).json() == {"namespace": None}
    assert client.get("/kvstore/stats").status_code == 200
    assert client.post("/kvstore/delete", json={"namespace": "alice"}).json() == {"deleted": 1}


CALLERS = {"alice": "sk-alice-2", "bob": "sk-bob", "shared": "sk-shared", "admin": ADMIN}
CALLER_NS = {"alice": "alice", "bob": "bob", "shared": None, "admin": None}


class TenantRoutes(RuleBasedStateMachine):
    """The admin routes as each caller uses them, against a model: ``stored[(ns, i)]`` is
    whether context ``TOKENS[i]`` of namespace ``ns`` is stored, and whether it is pinned."""

    open_store = None  # set by the test: open_small
    names = itertools.count()
    checked = {"forbidden": 0, "not_found": 0, "applied": 0}  # over every run: not vacuous

    def __init__(self):
        super().__init__()
        self.store = self.open_store(f"m{next(self.names)}", disk_bytes=200 * 4096)
        self.stored: dict[tuple[str | None, int], bool] = {}  # -> pinned
        self.keys: dict[tuple[str | None, int], str] = {}
        for ns in NAMESPACES:
            for i in range(len(TOKENS)):
                self._put(ns, i)
        self.client = _app(self.store, tenants.KeyRing.of(KEYS, ADMIN))

    def _put(self, ns: str | None, i: int) -> None:
        put_causal(self.store, TOKENS[i], namespace=ns)
        self.stored.setdefault((ns, i), False)
        (c,) = [c for c in self.store.list_contexts(ns) if c.n_tokens == len(TOKENS[i])]
        self.keys[(ns, i)] = c.key.hex()

    def _call(self, who: str, path: str, body: dict):
        r = self.client.post(path, json=body, headers={"Authorization":
                                                       f"Bearer {CALLERS[who]}"})
        if r.status_code != 200:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        return r

    def _body(self, who, ns, i, by, spec) -> tuple[dict, str | None, bool]:
        """The request body, the namespace it acts in, and whether the caller reaches it."""
        body = {"key": self.keys[(ns, i)]} if by == "key" else {"tokens": list(TOKENS[i])}
        acts = CALLER_NS[who]
        if spec == "target":
            body["namespace"] = acts = ns
        elif spec == "null":
            body["namespace"] = acts = None
        reaches = who == "admin" or acts == CALLER_NS[who]
        return body, acts, reaches

    def _expect_refused(self, r, reaches: bool, ns, acts, by, i) -> bool:
        """Check a refusal the model predicts; True if the call is to apply."""
        if not reaches:
            assert r.status_code == 403 and r.json()["error"]["param"] == "namespace"
            self.checked["forbidden"] += 1
            return False
        if by == "key" and (ns != acts or (ns, i) not in self.stored):
            assert r.status_code == 404  # another namespace's key: as if never stored
            self.checked["not_found"] += 1
            return False
        return True

    target = dict(who=st.sampled_from(sorted(CALLERS)), ns=st.sampled_from(NAMESPACES),
                  i=st.sampled_from(range(len(TOKENS))), by=st.sampled_from(["key", "tokens"]),
                  spec=st.sampled_from(["absent", "target", "null"]))

    @rule(**target)
    def pin(self, who, ns, i, by, spec):
        body, acts, reaches = self._body(who, ns, i, by, spec)
        r = self._call(who, "/kvstore/pin", body)
        if not self._expect_refused(r, reaches, ns, acts, by, i):
            return
        if (acts, i) not in self.stored:
            assert r.status_code == 404
            return
        assert r.status_code == 200 and r.json()["namespace"] == acts
        self.stored[(acts, i)] = True
        self.checked["applied"] += 1

    @rule(**target)
    def unpin(self, who, ns, i, by, spec):
        body, acts, reaches = self._body(who, ns, i, by, spec)
        r = self._call(who, "/kvstore/unpin", body)
        if not self._expect_refused(r, reaches, ns, acts, by, i):
            return
        was = self.stored.get((acts, i), False)
        assert r.status_code == 200 and r.json() == {"unpinned": was}
        if (acts, i) in self.stored:
            self.stored[(acts, i)] = False
            self.checked["applied"] += 1

    @rule(**target)
    def delete(self, who, ns, i, by, spec):
        body, acts, reaches = self._body(who, ns, i, by, spec)
        r = self._call(who, "/kvstore/delete", body)
        if not self._expect_refused(r, reaches, ns, acts, by, i):
            return
        assert r.status_code == 200
        assert r.json() == {"deleted": int((acts, i) in self.stored)}
        if self.stored.pop((acts, i), None) is not None:
            self.checked["applied"] += 1

    @rule(who=st.sampled_from(sorted(CALLERS)), ns=st.sampled_from(NAMESPACES))
    def delete_namespace(self, who, ns):
        r = self._call(who, "/kvstore/delete", {"namespace": ns})
        if not (who == "admin" or ns == CALLER_NS[who]):
            assert r.status_code == 403
            self.checked["forbidden"] += 1
            return
        if ns is None:  # the default namespace is never deleted whole
            assert r.status_code == 422
            return
        gone = [k for k in self.stored if k[0] == ns]
        assert r.status_code == 200 and r.json() == {"deleted": len(gone)}
        for k in gone:
            del self.stored[k]

    @rule(ns=st.sampled_from(NAMESPACES), i=st.sampled_from(range(len(TOKENS))))
    def put_again(self, ns, i):
        self._put(ns, i)

    @rule(who=st.sampled_from(sorted(CALLERS)))
    def listing(self, who):
        r = self.client.get("/kvstore/contexts", headers={"Authorization":
                                                          f"Bearer {CALLERS[who]}"})
        assert r.status_code == 200
        got = {(c["namespace"], c["tokens"], c["pinned"]) for c in r.json()["contexts"]}
        seen = [k for k in self.stored if who == "admin" or k[0] == CALLER_NS[who]]
        assert got == {(ns, len(TOKENS[i]), self.stored[(ns, i)]) for ns, i in seen}
        assert r.json()["pins"] == sum(self.stored[k] for k in seen)

    @invariant()
    def the_store_is_the_model(self):
        contexts = {(c.namespace, c.n_tokens, c.pinned) for c in
                    self.store.list_contexts(*NAMESPACES)}
        assert contexts == {(ns, len(TOKENS[i]), p) for (ns, i), p in self.stored.items()}
        assert len(self.store.list_contexts()) == len(self.stored)

    def teardown(self):
        self.client.close()
        self.store.close()


def test_each_caller_reaches_only_its_own_namespace(open_small):
    TenantRoutes.open_store = staticmethod(open_small)
    run_state_machine_as_test(TenantRoutes, settings=settings(
        max_examples=25, stateful_step_count=30, deadline=None, derandomize=True))
    c = TenantRoutes.checked
    assert c["forbidden"] > 20 and c["not_found"] > 20 and c["applied"] > 20, c
