"""Hypothesis strategies the store's state machines share: short token lists over a tiny
alphabet (so prefixes are shared often) and namespaces."""

from hypothesis import strategies as st

tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=14)
ns_st = st.sampled_from([None, "t1"])
