"""Retention hints through the public API: pins survive any load of other puts and leave after
unpin or their TTL, caps per namespace and per store refuse what cannot fit, pins live in the
catalog (reopen, other processes), and ``delete`` of a namespace removes exactly its contexts.

Stores are tiny (4-token chunks of 4 KiB slots): a load "far beyond capacity" is a few hundred
puts. Every get is checked byte for byte against the causal KV of its tokens."""

from __future__ import annotations

import numpy as np
import pytest

import kvstore
from kvstore.format.records import PinRecord
from kvstore.tools.verify import verify_store
from tests.support.clock import Clock
from tests.support.kvgen import SMALL, assert_get_exact, put_causal
from tests.support.mp_worker import Workers

C = 4
SLOT = 4096  # a 4-token chunk of SMALL, page-aligned


def toks(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def load(store, seed: int, n: int = 40, ns=None) -> None:
    """``n`` puts of distinct 9-token contexts (3 chunks each: 120 slots, six times the
    load tests' disk)."""
    for i in range(n):
        put_causal(store, toks(seed * 1000 + i, 9), namespace=ns)


@pytest.fixture
def small(open_small):
    """A store of 40 disk slots: about 13 contexts of the load fit at once."""
    def _open(name="s", **kw):
        kw.setdefault("disk_bytes", 40 * SLOT)
        kw.setdefault("dram_bytes", 4 * SLOT)
        return open_small(name, **kw)
    return _open


@pytest.mark.parametrize("policy", ["scheduler", "lru", "fifo", "belady", "reuse", "learned"])
def test_a_pinned_context_survives_any_load_and_leaves_only_after_unpin(small, policy):
    s = small(policy=policy, disk_bytes=20 * SLOT)
    t = toks(1, 10)
    put_causal(s, t)
    rec = s.pin(t)
    assert rec.expires is None and rec.n_tokens == 10 and rec.nbytes == 3 * SLOT
    load(s, 2)
    assert s.stats()["evictions"]["disk_contexts"] > 0 or policy == "belady"
    assert s.match(t) == len(t)
    assert_get_exact(s, t)
    assert [p.key for p in s.pins()] == [rec.key]
    assert s.unpin(t) and not s.unpin(t)
    assert s.pins() == []
    load(s, 3)
    assert s.match(t) < len(t)  # evictable again, and evicted
    assert verify_store(s)["ok"]


def test_a_ttl_pin_holds_until_its_ttl_then_the_context_is_evictable(small):
    s = small(policy="lru", disk_bytes=20 * SLOT)
    clock = Clock()
    clock.t = 1000.0
    s.wall_clock = clock
    t = toks(5, 7)
    put_causal(s, t)
    rec = s.pin(t, ttl_s=30)
    assert rec.expires == 1030.0
    clock.t = 1029.0
    load(s, 6)
    assert s.match(t) == len(t)  # still inside its TTL
    # pinning again keeps the later expiry, never a shorter one
    assert s.pin(t, ttl_s=0.5).expires == 1030.0
    assert s.pin(t, ttl_s=60).expires == 1089.0
    clock.t = 1089.5
    assert s.pins() == []  # expired: ignored
    load(s, 7)
    assert s.match(t) < len(t)
    with pytest.raises(ValueError, match="ttl_s"):
        s.pin(toks(6, 9), ttl_s=0)
    with pytest.raises(TypeError, match="ttl_s"):
        s.pin(toks(6, 9), ttl_s="5m")


def test_a_tenant_cannot_pin_beyond_its_cap_and_others_are_unaffected(small):
    # 40 slots: a namespace may pin 10 (0.25), the store 20 (0.5)
    s = small()
    tenant = [toks(10 + i, 9) for i in range(4)]  # 3 slots each
    for t in tenant:
        put_causal(s, t, namespace="a")
    for t in tenant[:3]:
        s.pin(t, namespace="a")  # 9 slots
    with pytest.raises(kvstore.PinRefused, match="pin_namespace_fraction") as e:
        s.pin(tenant[3], namespace="a")  # 12 > 10
    assert isinstance(e.value, kvstore.CapacityError)
    assert "namespace 'a'" in str(e.value) and str(10 * SLOT) in str(e.value)
    assert len(s.pins()) == 3
    other = toks(20, 9)
    put_causal(s, other, namespace="b")
    assert s.pin(other, namespace="b").namespace == "b"  # another tenant pins freely
    # a chunk two pinned contexts share counts once: an extension of a pinned context
    put_causal(s, tenant[0] + [1, 2, 3], namespace="a")  # 3 more tokens: one more slot
    s.pin(tenant[0] + [1, 2, 3], namespace="a")  # 10 slots: exactly the cap
    assert s.match(tenant[0], namespace="a") == 9  # the pinned prefix was not superseded
    assert len(s.list_contexts("a")) == 5
    # unpinning makes room again
    assert s.unpin(tenant[1], namespace="a")
    s.pin(tenant[3], namespace="a")


def test_every_namespace_together_is_capped_too(small):
    s = small(pin_namespace_fraction=0.2, pin_total_fraction=0.3)  # 8 slots each, 12 all
    for i, ns in enumerate(["a", "b", "c"]):
        for j in range(2):
            put_causal(s, toks(30 + 2 * i + j, 8), namespace=ns)  # 2 slots each
            if i < 2 or j == 0:
                s.pin(toks(30 + 2 * i + j, 8), namespace=ns)
    # 10 slots pinned; 2 more would reach 12: allowed; then nothing more
    s.pin(toks(35, 8), namespace="c")
    put_causal(s, toks(40, 4), namespace="d")
    with pytest.raises(kvstore.PinRefused, match="pin_total_fraction"):
        s.pin(toks(40, 4), namespace="d")


def test_a_context_larger_than_a_cap_cannot_be_pinned(small):
    s = small()
    big = toks(50, 11 * C)  # 11 slots: more than one namespace may pin (10)
    put_causal(s, big)
    with pytest.raises(kvstore.PinRefused, match="cannot be pinned") as e:
        s.pin(big)
    assert str(11 * SLOT) in str(e.value)
    assert s.pins() == []
    with pytest.raises(KeyError, match="put it first"):
        s.pin(toks(51, 5))  # not stored
    with pytest.raises(KeyError):
        s.pin(big[:8])  # servable, but not a stored context of exactly these tokens


def test_puts_that_only_evicting_pinned_contexts_could_fit_are_refused(small):
    s = small(pin_namespace_fraction=1.0, pin_total_fraction=1.0)
    pinned = [toks(60 + i, 12) for i in range(12)]  # 36 of the 40 slots
    for t in pinned:
        put_causal(s, t)
        s.pin(t)
    with pytest.raises(kvstore.CapacityError, match="pinned contexts"):
        put_causal(s, toks(99, 20))  # 5 slots
    assert all(s.match(t) == len(t) for t in pinned)
    put_causal(s, toks(98, 16))  # 4 slots still fit


def test_pins_are_in_the_catalog_after_reopen_and_for_other_processes(tmp_path):
    path = tmp_path / "s"
    kw = {"chunk_tokens": C, "dram_bytes": 4 * SLOT, "disk_bytes": 20 * SLOT}
    t = toks(70, 10)
    with kvstore.open(path, layout=SMALL, **kw) as s:
        put_causal(s, t, namespace="a")
        s.pin(t, namespace="a", ttl_s=3600)
    with kvstore.open(path, **kw) as s:
        (p,) = s.pins()
        assert p.namespace == "a" and p.expires is not None and p.n_tokens == 10
        (info,) = s.list_contexts()
        assert info.pinned and info.named and info.namespace == "a"
        assert s.context_tokens(info.key).tolist() == t
    workers = Workers(1)
    try:
        workers.call(0, "open", str(path), {**kw, "policy": "lru"})
        for i in range(20):  # another process's evictions honour the pin
            workers.call(0, "put", toks(80 + i, 9), None)
        assert workers.call(0, "match", t, "a") == len(t)
        assert workers.call(0, "get", t, "a")
        with kvstore.open(path, **kw) as s:
            assert s.unpin(t, namespace="a")
        for i in range(10):
            workers.call(0, "put", toks(200 + i, 9), None)
        assert workers.call(0, "match", t, "a") < len(t)
    finally:
        workers.close()


def test_delete_of_a_namespace_removes_exactly_its_contexts(small):
    s = small(disk_bytes=200 * SLOT, dram_bytes=64 * SLOT)
    shared = toks(90, 9)
    mine = [shared, shared + [5, 6], toks(91, 6)]
    for ns in ("a", "b", None):
        for t in mine:
            put_causal(s, t, namespace=ns)
    s.pin(mine[2], namespace="a")
    s.pin(mine[2], namespace="b")
    before = s.stats()["disk"]["chunks"]
    assert {c.namespace for c in s.list_contexts()} == {"a", "b", None}  # named by pins
    assert s.delete(namespace="a") == 2  # shared was superseded by its extension
    assert s.delete(namespace="a") == 0
    assert s.list_contexts("a") == []
    for t in mine:
        assert s.match(t, namespace="a") == 0
        assert s.residency(t, namespace="a")["missing"] == len(t)
        with pytest.raises(KeyError):
            s.get(t, namespace="a")
        for ns in ("b", None):
            assert_get_exact(s, t, namespace=ns)
    assert s.stats()["disk"]["chunks"] == before * 2 // 3
    assert [p.namespace for p in s.pins()] == ["b"]
    # one context of a namespace
    assert s.delete(mine[2], namespace="b") and not s.delete(mine[2], namespace="b")
    assert s.pins() == []
    assert s.match(mine[2]) == len(mine[2])
    with pytest.raises(ValueError, match="tokens .* or a namespace"):
        s.delete()
    assert verify_store(s)["ok"]


def test_pin_records_round_trip_and_refuse_what_is_malformed():
    key = bytes(range(16))
    for rec in (PinRecord(key, None, None, 4096, 3, 1.5),
                PinRecord(key, "tenant ü", 99.25, 8192, 9, 2.0)):
        assert PinRecord.decode(key, rec.encode()) == rec
    raw = PinRecord(key, "t", None, 1, 1, 0.0).encode()
    for bad in (raw[:-1], raw + b"x", b"\x02" + raw[1:], raw[:1] + b"\x08" + raw[2:]):
        with pytest.raises(kvstore.FormatError):
            PinRecord.decode(key, bad)


def test_a_namespace_too_long_to_record_or_a_ttl_beyond_floats_is_refused(small):
    s = small()
    ns = "n" * 5000
    put_causal(s, toks(7, 9), namespace=ns)
    with pytest.raises(ValueError, match="namespace of a pin must be at most 4096 bytes"):
        s.pin(toks(7, 9), namespace=ns)
    put_causal(s, toks(8, 9))
    with pytest.raises(ValueError, match="ttl_s"):
        s.pin(toks(8, 9), ttl_s=10**400)
    assert s.pins() == []


def test_bad_caps_are_refused_by_name(tmp_path):
    for name, bad, err in (("pin_namespace_fraction", 0, ValueError),
                           ("pin_total_fraction", 1.5, ValueError),
                           ("pin_total_fraction", "half", TypeError)):
        with pytest.raises(err, match=name):
            kvstore.open(tmp_path / "s", layout=SMALL, **{name: bad})
    with kvstore.open(tmp_path / "s", layout=SMALL, pin_total_fraction=0.75) as s:
        assert s.config.pin_total_fraction == 0.75
    with kvstore.open(tmp_path / "s") as s:  # persisted like the sizes
        assert s.config.pin_total_fraction == 0.75
        assert s.config.pin_namespace_fraction == 0.25
