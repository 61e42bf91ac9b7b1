"""Writer process for the crash tests: puts deterministic contexts and reports each one.

Usage: python -m tests.support.crash_writer STORE_DIR SEED DISK_SLOTS MAX_TOKENS [INDEX_KIND]
Prints "ready" once the store is open, then "ok <i>" after put number i has returned. With
INDEX_KIND every put also builds and stores that kind of per-head indexes.
"""

import random
import sys

import kvstore
from kvstore.index import IndexSpec
from tests.support.kvgen import SMALL, causal_kv


def context(seed: int, i: int, max_tokens: int) -> list[int]:
    """The i-th context of a run: often an extension of an earlier one (shared prefixes)."""
    rng = random.Random(seed * 100_003 + i)
    if i > 0 and rng.random() < 0.5:
        base = context(seed, rng.randrange(i), max_tokens)
    else:
        base = [1000 + i]
    return (base + [rng.randrange(5) for _ in range(rng.randrange(1, 24))])[:max_tokens]


def main() -> None:
    path = sys.argv[1]
    seed, slots, max_tokens = (int(x) for x in sys.argv[2:5])
    index = IndexSpec(kind=sys.argv[5], pq_subspaces=4) if len(sys.argv) > 5 else None
    s = kvstore.open(path, layout=SMALL, chunk_tokens=4, dram_bytes=8 * 4096,
                     disk_bytes=slots * 4096)
    print("ready", flush=True)
    for i in range(100_000):
        toks = context(seed, i, max_tokens)
        k, v = causal_kv(SMALL, toks)
        s.put(toks, k, v, index=index)
        print(f"ok {i}", flush=True)


if __name__ == "__main__":
    main()
