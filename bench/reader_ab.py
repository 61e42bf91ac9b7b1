"""A/B of a get's miss reader: this tree's ``Reader._read_misses`` against the one of an earlier
commit, loaded beside it in the same process and alternated round by round (cold gets).

The earlier method is taken from ``git show REV:src/kvstore/pipelines/get.py`` and run in this
tree's
``kvstore.pipelines.get`` namespace, so it must use only names this tree still has (true of
2aabfb2, the
two-helper reader before the sequential one). Stores: raw (no codec), and int8 on disk in
int8-sized slots with DRAM copies coded (``--dram-coded``, default) or decoded. Random fp16 KV
in SmolLM2-135M's layout. Prints and writes GB/s p50 of decoded bytes per (reader, store).

Usage (the numbers in docs/benchmarks.md):
    PYTHONPATH=src:. .venv/bin/python bench/reader_ab.py --before 2aabfb2 --tokens 2048 --reps 15
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import machine_info, summarize  # noqa: E402

import kvstore  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402
from kvstore.pipelines import get as read_path  # noqa: E402


def earlier_reader(rev: str):
    """``Reader._read_misses`` as of commit ``rev``."""
    src = subprocess.run(["git", "show", f"{rev}:src/kvstore/pipelines/get.py"], check=True,
                         capture_output=True, text=True).stdout
    a = src.index("    def _read_misses(")
    b = re.search(r"\n(class|def) \w", src[a:]).start() + a  # the next top-level name
    ns = dict(vars(read_path))
    exec(textwrap.dedent(src[a:b]), ns)  # noqa: S102 - the project's own earlier code
    return ns["_read_misses"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", required=True, help="git revision of the earlier reader")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--reps", type=int, default=15, help="measured rounds (after 1 warmup)")
    p.add_argument("--dram-decoded", action="store_true",
                   help="the int8 store keeps DRAM copies decoded (default: coded)")
    p.add_argument("--dir", default=None)
    p.add_argument("--out", default="bench/results/reader_ab.json")
    args = p.parse_args(argv)
    before, after = earlier_reader(args.before), read_path.Reader._read_misses
    lay = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16")
    g = torch.Generator().manual_seed(0)
    n = args.tokens
    k = (torch.randn(30, 3, n, 64, generator=g) * 2).half()
    v = torch.randn(30, 3, n, 64, generator=g).half()
    toks = list(range(1000, 1000 + n))
    work = tempfile.mkdtemp(prefix="kvstore-reader-ab-", dir=args.dir)
    kw = {"layout": lay, "chunk_tokens": 256, "disk_bytes": 4 << 30}
    codecs = {"disk": "int8"} if args.dram_decoded else {"disk": "int8", "dram": "int8"}
    samples: dict[str, list[float]] = {}
    load = os.getloadavg()
    try:
        with kvstore.open(os.path.join(work, "int8"), codecs=codecs, slot_codec="int8",
                          **kw) as coded, kvstore.open(os.path.join(work, "raw"), **kw) as raw:
            for s in (coded, raw):
                s.put(toks, k, v)
            for i in range(args.reps + 1):  # the first round warms up
                for reader, fn in (("before", before), ("after", after)):
                    read_path.Reader._read_misses = fn
                    for name, s in (("raw", raw), ("int8", coded)):
                        s.drop_caches()
                        t = time.perf_counter()
                        s.get(toks)
                        if i:
                            samples.setdefault(f"{reader}/{name}", []).append(
                                time.perf_counter() - t)
    finally:
        read_path.Reader._read_misses = after
        shutil.rmtree(work, ignore_errors=True)
    nbytes = 2 * k.numel() * 2
    out = {"command": "python bench/reader_ab.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "machine": machine_info(),
        "load_before": load, "load_after": os.getloadavg(),
        "gets": {key: summarize(x, nbytes) for key, x in samples.items()}}
    print(f"{n} tokens, load {load[0]:.2f}: " + "  ".join(
        f"{key} {r['gbps_p50']:.2f}" for key, r in out["gets"].items()) + " GB/s p50")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
