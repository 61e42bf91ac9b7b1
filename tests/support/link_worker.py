"""A store on one end of a slow link (tests/support/netns.py), run inside a network namespace:
``ip netns exec NS python -m tests.support.link_worker put|get --store DIR --remote URL
[--objects URL] --tokens N --seed S [--remote-timeout-s T --remote-deadline-s D]``.
Prints one ``RESULT {json}`` line.

``put`` stores the causal KV (tests/support/kvgen.py) of ``N`` seeded tokens and waits until
the shared tiers hold it (``flush(remote=True)``); ``get`` opens a fresh store (nothing on its
own disk), asks the shared tiers for those tokens and compares what comes back with the causal
KV, bit for bit. Both time their transfer and report the store's own counters of the tier."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from kvstore import KVLayout

# a layout whose tokens are big enough (4 KiB each) that a transfer takes the link's time
LINK_LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16",
                       rope_theta=10000.0, model_id="test-link")
CHUNK_TOKENS = 64


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 49152, n).tolist()


def main(argv: list[str] | None = None) -> None:
    import kvstore
    from tests.support.kvgen import causal_kv

    p = argparse.ArgumentParser()
    p.add_argument("op", choices=("put", "get"))
    p.add_argument("--store", required=True)
    p.add_argument("--remote", default=None)
    p.add_argument("--objects", default=None)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--remote-timeout-s", type=float, default=None,
                   help="RemoteConfig.timeout_s (a stall's bound; default the config's)")
    p.add_argument("--remote-deadline-s", type=float, default=None,
                   help="RemoteConfig.deadline_s (a call's bound; default the config's)")
    a = p.parse_args(argv)
    t = tokens(a.tokens, a.seed)
    k, v = causal_kv(LINK_LAYOUT, t)
    remote = a.remote
    if remote is not None and (a.remote_timeout_s or a.remote_deadline_s):
        limits = {name: x for name, x in (("timeout_s", a.remote_timeout_s),
                                          ("deadline_s", a.remote_deadline_s)) if x}
        remote = kvstore.RemoteConfig(urls=remote, **limits)
    shared = {"remote": remote, "objects": a.objects}
    which = "objects" if a.objects is not None else "remote"
    with kvstore.open(a.store, layout=LINK_LAYOUT, chunk_tokens=CHUNK_TOKENS,
                      dram_bytes=64 << 20, disk_bytes=256 << 20, **shared) as store:
        t0 = time.perf_counter()
        if a.op == "put":
            store.put(t, k, v)
            store.flush(remote=True)
            out = {"seconds": time.perf_counter() - t0}
        else:
            matched = store.match(t)
            gk, gv = store.get(t) if matched == len(t) else (None, None)
            out = {"seconds": time.perf_counter() - t0, "matched": matched,
                   "equal": gk is not None and torch.equal(gk, k) and torch.equal(gv, v)}
        out.update(op=a.op, tokens=len(t), payload_bytes=len(t) * LINK_LAYOUT.token_bytes,
                   tier=which, stats=store.stats()[which])
    print("RESULT " + json.dumps(out, default=str), flush=True)


if __name__ == "__main__":
    main()
