"""A small multi-turn trace for the reuse policy: the store-against-simulator test and
``bench/reuse_admission.py`` replay the same one."""

import numpy as np


def trace(seed: int, n: int) -> list[tuple[float, int, int, int]]:
    """(time, conversation, turn, tokens so far): half the conversations single-turn saves of
    8-16 tokens, half three or four turns of 4 tokens each; exponential think times."""
    rng = np.random.default_rng(seed)
    ev = []
    for c in range(n):
        t = float(rng.uniform(0, 150))
        turns = int(rng.choice([1, 1, 3, 4]))
        total = 0
        for i in range(turns):
            total += 4 * (int(rng.integers(2, 5)) if turns == 1 else 1)
            ev.append((round(t, 3), c, i, total))
            t += 2.0 + float(rng.exponential(20.0))
    return sorted(ev)
