"""The look-ahead's policy state (kvstore.residency.lookahead.Hints): what the ``learned`` policy
keeps in the catalog is untrusted input at open: every damaged form is a problem naming it, and
the policy starts afresh; a policy that learned nothing writes nothing."""

import base64
import json

import pytest

import kvstore
from kvstore.residency.lookahead import PREDICTOR_META
from tests.support.kvgen import put_causal


def _forge(path, value) -> None:
    """Write ``value`` as the catalog's predictor state, as a damaged or hostile writer might."""
    with kvstore.open(path, policy="lru") as s:
        with s._core.catalog.write() as txn:
            txn.put_meta(PREDICTOR_META, value)


@pytest.mark.parametrize("value", [
    5, ["a", "list"], {"a": 1}, None,  # not a string
    "not base64 at all!",  # not base64
    base64.b64encode(b"\x00" * 40).decode(),  # base64, not a predictor
    base64.b64encode(json.dumps({"seen": 3}).encode()).decode(),
])
def test_a_damaged_predictor_state_is_a_problem_and_the_policy_starts_afresh(open_small, value):
    s = open_small("st")
    put_causal(s, list(range(9)))
    path = s.path
    s.close()
    _forge(path, value)
    with kvstore.open(path, policy="learned") as again:
        if value is None:  # JSON null: no state at all
            assert again.problems == []
        else:
            assert any(PREDICTOR_META in p for p in again.problems), again.problems
        assert again.debug.policy.predictor.seen == 0
        assert again.match(list(range(9))) == 9  # the store itself is unharmed


def test_a_policy_that_learned_nothing_writes_no_state(open_small):
    s = open_small("st", policy="learned")
    put_causal(s, list(range(9)))
    path = s.path
    s.close()
    with kvstore.open(path, policy="lru") as again:
        assert again._core.catalog.get_meta(PREDICTOR_META) is None
