"""Writer process for the crash tests: puts deterministic contexts and reports each one.

Usage: python -m tests.kvstore.crash_writer STORE_DIR SEED DISK_SLOTS MAX_TOKENS
Prints "ready" once the store is open, then "ok <i>" after put number i has returned.
"""

import random
import sys

import kvstore
from tests.kvstore.kvgen import SMALL, causal_kv


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
    s = kvstore.open(path, layout=SMALL, chunk_tokens=4, dram_bytes=8 * 4096,
                     disk_bytes=slots * 4096)
    print("ready", flush=True)
    for i in range(100_000):
        toks = context(seed, i, max_tokens)
        k, v = causal_kv(SMALL, toks)
        s.put(toks, k, v)
        print(f"ok {i}", flush=True)


if __name__ == "__main__":
    main()
