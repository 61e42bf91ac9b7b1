"""``Store.delete`` on the shared tiers, against a real redis-server and a real SeaweedFS: a
namespace's delete removes its values (and its partial chunks' kids entries) from the shared
tier, and no value another namespace put, whatever tokens the two share; a context's delete
keeps the values other contexts of its namespace still hold."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from kvstore.format.hashing import chain_seed, chunk_hash
from tests.support.kvgen import SMALL, assert_get_exact, put_causal
from tests.support.shared_tier_calls import toks

C = 4


def keys_of(t: list[int], ns: str | None) -> list[bytes]:
    parent, out = chain_seed(SMALL.fingerprint, ns), []
    for i in range(0, len(t), C):
        parent = chunk_hash(parent, np.asarray(t[i:i + C], dtype=np.uint32))
        out.append(parent)
    return out


@pytest.fixture(params=["remote", "objects"])
def shared(request):
    """(tier kind, the open_small keyword that attaches the shared tier)."""
    kind = request.param
    url = request.getfixturevalue("redis_server").url if kind == "remote" \
        else request.getfixturevalue("bucket_url")()
    return kind, {kind: url}


def test_delete_of_a_namespace_removes_exactly_its_values_from_the_shared_tier(open_small,
                                                                                shared):
    kind, tier = shared
    a = open_small("a", **tier)
    t = toks(1, 3 * C + 2)  # three whole chunks and a partial one
    other = toks(2, 2 * C)
    for ns in ("x", "y"):
        put_causal(a, t, namespace=ns)
    put_causal(a, other, namespace="x")
    a.flush(remote=True)
    assert a.stats()[kind]["written_chunks"] == 4 + 4 + 2
    assert a.delete(namespace="x") == 2
    st = a.stats()[kind]
    assert st["deleted_chunks"] == 6 and st["delete_failed"] == 0
    b = open_small("b", **tier)  # another machine: only the shared tier
    assert b.match(t, namespace="x") == 0
    assert b.match(t + [7, 7], namespace="x") == 0  # the partial chunk's kids entry too
    assert b.match(other, namespace="x") == 0
    assert b.match(t, namespace="y") == len(t)  # the same tokens in another namespace
    assert b.match(t + [7, 7], namespace="y") == len(t)
    assert_get_exact(b, t, namespace="y")
    if kind == "remote":
        r = redis.Redis.from_url(tier["remote"])
        left = {k for k in r.keys("kvstore:*") if b":kids:" not in k}
        assert left == {b"kvstore:" + k.hex().encode() for k in keys_of(t, "y")}
        r.close()


def test_delete_of_a_context_keeps_the_values_its_namespace_still_holds(open_small, shared):
    kind, tier = shared
    a = open_small("a", **tier)
    base = toks(3, 2 * C)
    one, two = base + toks(4, C + 1), base + toks(5, C + 2)
    put_causal(a, one, namespace="x")
    put_causal(a, two, namespace="x")
    a.flush(remote=True)
    assert a.delete(one, namespace="x")
    assert a.stats()[kind]["deleted_chunks"] == 2  # its own two chunks, not the shared two
    b = open_small("b", **tier)
    assert b.match(one, namespace="x") == 2 * C
    assert b.match(two, namespace="x") == len(two)
    # tokens another machine does not store: the values they address go all the same
    assert not b.delete(two, namespace="x")
    assert b.stats()[kind]["deleted_chunks"] == 4
    assert open_small("c", **tier).match(two, namespace="x") == 0
    assert a.match(two, namespace="x") == len(two)  # a's own tiers are a's
