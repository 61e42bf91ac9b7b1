"""Token tables (the replay's input) for the replay tests: synthetic ShareGPT-like lengths, or a
few short real conversations tokenized by the model."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa


def synthetic_table(n_convs, seed=0, mean_user=120, mean_reply=300):
    """A token table with ShareGPT-like lengths (ids are arbitrary: simulation uses lengths)."""
    rng = np.random.default_rng(seed)
    cols = {"conv": [], "conv_id": [], "turn": [], "user_ids": [], "reply_ids": []}
    for c in range(n_convs):
        for t in range(int(rng.integers(1, 9))):
            cols["conv"].append(c)
            cols["conv_id"].append(f"c{c}")
            cols["turn"].append(t)
            cols["user_ids"].append([1] * int(rng.geometric(1 / mean_user)))
            cols["reply_ids"].append([2] * int(rng.geometric(1 / mean_reply)))
    return pa.table({
        "conv": pa.array(cols["conv"], pa.int32()), "conv_id": cols["conv_id"],
        "turn": pa.array(cols["turn"], pa.int32()),
        "user_ids": pa.array(cols["user_ids"], pa.list_(pa.int32())),
        "reply_ids": pa.array(cols["reply_ids"], pa.list_(pa.int32())),
    })


def real_table(model):
    """Three short multi-turn conversations, tokenized like the replay does."""
    from engine.sharegpt import ShareGPTConversation, Turn, turn_table

    rng = random.Random(0)
    words = "cache store layer token reuse disk memory query answer model".split()

    def text(n):
        return " ".join(rng.choice(words) for _ in range(n))

    convs = [ShareGPTConversation(id=f"c{i}", system=None, turns=tuple(
        Turn(user=text(30), assistant=text(60)) for _ in range(3))) for i in range(3)]
    return turn_table(model, convs)
