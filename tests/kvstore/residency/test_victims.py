"""The one victim chooser (kvstore.residency.victims.choose_victims) against a brute force over
the same priorities: the shortest walk in heap order that frees the need (refused when it
reaches a context ranked above the put's own), then, size-aware, the set of put-backs that the
rule's order prefers among every subset of the walk that still frees the need."""

import itertools

from hypothesis import given, seed, settings
from hypothesis import strategies as st

from kvstore.eviction.policies import PriorityHeap
from kvstore.residency.victims import choose_victims


class BytesFreed:
    """Each context frees its own bytes (the simulator's unit: no shared chunks)."""

    def __init__(self, sizes: dict[int, int]) -> None:
        self.sizes = sizes
        self.victims: set[int] = set()

    def add(self, key: int) -> int:
        assert key not in self.victims
        self.victims.add(key)
        return self.sizes[key]

    def marginal(self, key: int) -> int:
        assert key in self.victims
        return self.sizes[key]

    def put_back(self, key: int) -> None:
        self.victims.remove(key)


def brute_force(prio, sizes, need, *, mine, size_aware, skip, freed):
    """(victims in walk order, what they free, how many were put back), or None: refused."""
    order = sorted(prio, key=lambda k: (prio[k], k))  # heap order: pushed in key order
    candidates = [k for k in order if k not in skip]
    walk = candidates
    for j in range(len(candidates) + 1):  # the shortest prefix that frees the need
        if freed + sum(sizes[k] for k in candidates[:j]) >= need:
            walk = candidates[:j]
            break
    if mine is not None and any(mine < prio[k] for k in walk):
        return None  # the walk reached a context ranked above the put's own
    total = freed + sum(sizes[k] for k in walk)
    if not size_aware or total < need:
        return walk, total, 0
    # put-backs: every subset of the walk whose removal still frees the need; the rule
    # prefers putting back higher-priority contexts first (lexicographic in that order)
    by_prio = sorted(walk, key=lambda k: (-prio[k], walk.index(k)))
    best = ()
    for r in range(len(walk) + 1):
        for back in itertools.combinations(walk, r):
            if total - sum(sizes[k] for k in back) < need:
                continue
            vec = tuple(k in back for k in by_prio)
            if vec > tuple(k in best for k in by_prio):
                best = back
    kept = [k for k in walk if k not in best]
    return kept, total - sum(sizes[k] for k in best), len(best)


_CASE = st.integers(1, 8).flatmap(lambda n: st.fixed_dictionaries({
    "prio": st.lists(st.integers(0, 6), min_size=n, max_size=n),
    "sizes": st.lists(st.sampled_from([1, 2, 3, 5, 8, 13]), min_size=n, max_size=n),
    "need": st.integers(0, 5 * n + 4),
    "mine": st.one_of(st.none(), st.none(), st.integers(-1, 7)),
    "size_aware": st.booleans(),
    "skip": st.sets(st.integers(0, n - 1), max_size=2),
    "freed": st.integers(0, 3),
}))


def _check(case):
    prio = dict(enumerate(case["prio"]))
    sizes = dict(enumerate(case["sizes"]))
    heap = PriorityHeap()
    for k in sorted(prio):
        heap.push(k, prio[k])
    before = sorted((heap.priority_of(k), k) for k in prio)
    freeing = BytesFreed(sizes)
    got = choose_victims(heap, case["need"], freeing, mine=case["mine"],
                         size_aware=case["size_aware"], skip=case["skip"], freed=case["freed"])
    want = brute_force(prio, sizes, case["need"], mine=case["mine"],
                       size_aware=case["size_aware"], skip=case["skip"], freed=case["freed"])
    if want is None:
        assert got is None
    else:
        assert got is not None
        assert (got.victims, got.freed, got.kept_back) == want
        assert freeing.victims == set(got.victims)  # every put-back told to the freeing
        assert not set(got.victims) & case["skip"]
    # pure: nothing left the heap, no priority changed
    assert len(heap) == len(prio)
    assert sorted((heap.priority_of(k), k) for k in prio) == before
    return want


@seed(20261)
@settings(max_examples=300, deadline=None)
@given(case=_CASE)
def test_choose_victims_picks_what_a_brute_force_picks(case):
    _check(case)


# size-aware without admission or skipped keys: where put-backs happen, and in which order
_SIZE_AWARE = st.integers(2, 8).flatmap(lambda n: st.fixed_dictionaries({
    "prio": st.permutations(range(n)),
    "sizes": st.lists(st.sampled_from([1, 2, 3, 5, 8, 13, 21]), min_size=n, max_size=n),
    "need": st.integers(1, 8 * n),
    "mine": st.none(), "size_aware": st.just(True), "skip": st.just(frozenset()),
    "freed": st.just(0),
}))


@seed(20262)
@settings(max_examples=300, deadline=None)
@given(case=_SIZE_AWARE)
def test_size_aware_put_backs_are_what_a_brute_force_picks(case):
    _check(case)


def test_size_aware_puts_back_a_small_context_that_a_big_one_makes_needless():
    heap = PriorityHeap()
    sizes = {"small": 1, "big": 10, "later": 5}
    for k, p in (("small", 1), ("big", 2), ("later", 3)):
        heap.push(k, p)
    plain = choose_victims(heap, 10, BytesFreed(sizes))
    assert plain.victims == ["small", "big"] and plain.freed == 11 and plain.kept_back == 0
    aware = choose_victims(heap, 10, BytesFreed(sizes), size_aware=True)
    assert aware.victims == ["big"] and aware.freed == 10 and aware.kept_back == 1


def test_size_aware_puts_back_from_the_highest_priority_down():
    heap = PriorityHeap()
    sizes = {"a": 2, "b": 5, "c": 8}  # the walk frees 15 for a need of 9
    for k, p in (("a", 1), ("b", 2), ("c", 3)):
        heap.push(k, p)
    got = choose_victims(heap, 9, BytesFreed(sizes), size_aware=True)
    # c is needed (7 < 9 without it); b goes back (10 left), then a is needed (8 < 9)
    assert got.victims == ["a", "c"] and got.freed == 10 and got.kept_back == 1


def test_admission_refuses_when_the_walk_reaches_a_context_above_the_put():
    heap = PriorityHeap()
    sizes = {"a": 4, "b": 4}
    heap.push("a", 1)
    heap.push("b", 5)
    assert choose_victims(heap, 8, BytesFreed(sizes), mine=3) is None
    assert choose_victims(heap, 4, BytesFreed(sizes), mine=3).victims == ["a"]
    assert choose_victims(heap, 8, BytesFreed(sizes), mine=3, skip={"b"}).victims == ["a"]
    everything = choose_victims(heap, 100, BytesFreed(sizes))
    assert everything.victims == ["a", "b"] and everything.freed == 8  # below need: caller's
