"""KV events never slow the store: durable put throughput with the store publishing its KV events
(``kvstore.open(..., events=...)``) to a subscriber that reads nothing, against the same puts
without events, measured in one run.

Conditions, interleaved round by round (their order rotates) on fresh stores of the same sizes
(a disk budget of ``--disk-contexts`` contexts, so the puts evict all along and the events
announce removals too):

  none          no events (the baseline)
  idle_sub      events on a ZMQ endpoint whose one subscriber is connected and never reads
                (ZMQ drops beyond the high-water mark: the store never waits for it)
  reading_sub   events read by a subscriber thread in this process (decoding every batch)

Each round puts ``--warmup`` contexts untimed, then ``--puts`` timed ones of ``--tokens`` new
token ids each (SmolLM2's layout, fp16 KV); a round's throughput is puts per second over its
timed puts (compared as the median over rounds, and as the median of each round's ratio to the
same round's baseline). The ceiling is measured in the same run: ``write`` + ``fdatasync`` of
the same bytes to a new file (what a durable put cannot beat), reported as each condition's
ratio to it. The claim: median(idle_sub) / median(none) >= 0.98.

    python bench/events.py [--tokens 1024] [--puts 20] [--rounds 5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time

import numpy as np
import torch
import zmq
from benchutil import machine_info, new_tokens, summarize

import kvstore
from kvstore import KVLayout
from kvstore.events.records import batch_decoder

SMOL = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16",
                rope_theta=100000.0, model_id="smollm2-135m-instruct")
CONDITIONS = ("none", "idle_sub", "reading_sub")


class Reader:
    """A subscriber thread that decodes every batch it receives."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.stop = threading.Event()
        self.batches = self.events = 0
        self.thread = threading.Thread(target=self._run, name="bench-reader")
        self.thread.start()

    def _run(self) -> None:
        dec = batch_decoder()
        while not self.stop.is_set():
            if self.sock.poll(50):
                _topic, _seq, payload = self.sock.recv_multipart()
                self.events += len(dec.decode(payload).events)
                self.batches += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()


def one_round(root: str, cond: str, args, k: torch.Tensor, v: torch.Tensor,
              rng: np.random.Generator, first: list[int]) -> dict[str, object]:
    path = os.path.join(root, f"{cond}-{first[0]}")
    endpoint = f"ipc://{root}/{cond}-{first[0]}.sock"
    ctx = zmq.Context()
    idle = reader = None
    ctx_bytes = args.tokens * SMOL.token_bytes
    chunk_bytes = SMOL.token_bytes * 256
    disk = (args.tokens // 256 + 1) * args.disk_contexts * (-(-chunk_bytes // 4096) * 4096)
    events = None
    if cond != "none":
        events = kvstore.EventsConfig(endpoint=endpoint, hwm=args.hwm)
        if cond == "idle_sub":
            idle = ctx.socket(zmq.SUB)
            idle.setsockopt(zmq.LINGER, 0)
            idle.setsockopt(zmq.RCVHWM, args.hwm)
            idle.connect(endpoint)
            idle.setsockopt(zmq.SUBSCRIBE, b"")
        else:
            reader = Reader(ctx, endpoint)
    store = kvstore.open(path, layout=SMOL, dram_bytes=args.dram_contexts * ctx_bytes * 2,
                         disk_bytes=disk, events=events)
    samples = []
    try:
        for i in range(args.warmup + args.puts):
            toks = new_tokens(rng, args.tokens, first[0])
            first[0] += 1
            t0 = time.perf_counter()
            store.put(toks, k, v)
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                samples.append(dt)
        stats = store.stats()
        ev = stats.get("events")
    finally:
        store.close()
        if idle is not None:
            idle.close()
        if reader is not None:
            reader.close()
        ctx.term()
        shutil.rmtree(path, ignore_errors=True)
    out: dict[str, object] = {"put_s": samples, "puts_per_s": len(samples) / sum(samples),
                              "evicted_contexts": stats["evictions"]}
    if ev is not None:
        out["events"] = {k2: ev[k2] for k2 in ("stored_events", "removed_events", "batches",
                                                "dropped_changes", "events")}
    if reader is not None:
        out["reader_batches"] = reader.batches
    return out


def ceiling_round(root: str, nbytes: int, buf: np.ndarray, puts: int) -> list[float]:
    """write + fdatasync of ``nbytes`` to a new file, ``puts`` times."""
    out = []
    for i in range(puts):
        p = os.path.join(root, f"ceiling-{i}")
        t0 = time.perf_counter()
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(buf)[:nbytes]
            while view:
                view = view[os.write(fd, view):]
            os.fdatasync(fd)
        finally:
            os.close(fd)
        out.append(time.perf_counter() - t0)
        os.unlink(p)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per put")
    p.add_argument("--puts", type=int, default=20, help="timed puts per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed puts first, each round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--disk-contexts", type=int, default=12,
                   help="the disk budget in contexts (the puts evict beyond it)")
    p.add_argument("--dram-contexts", type=int, default=4)
    p.add_argument("--hwm", type=int, default=1000, help="ZMQ high-water mark (messages)")
    p.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    p.add_argument("--out", default="bench/results/events.json")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    shape = (SMOL.num_layers, SMOL.num_kv_heads, args.tokens, SMOL.head_dim)
    k = torch.randn(shape, dtype=torch.float32).to(torch.float16)  # [L, H, T, D]
    v = torch.randn(shape, dtype=torch.float32).to(torch.float16)  # [L, H, T, D]
    nbytes = args.tokens * SMOL.token_bytes
    buf = np.frombuffer(np.random.default_rng(1).bytes(nbytes), dtype=np.uint8)
    root = tempfile.mkdtemp(prefix="kvstore-bench-events-", dir=args.dir)
    first = [1]
    rounds: dict[str, list[dict]] = {c: [] for c in CONDITIONS}
    ceiling: list[float] = []
    try:
        for r in range(args.rounds):
            order = CONDITIONS[r % 3:] + CONDITIONS[:r % 3]
            for cond in order:
                rounds[cond].append(one_round(root, cond, args, k, v, rng, first))
            ceiling += ceiling_round(root, nbytes, buf, args.puts // 2)
            print(f"round {r}: " + ", ".join(
                f"{c} {rounds[c][-1]['puts_per_s']:.2f} puts/s" for c in CONDITIONS),
                flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ceil_pps = 1.0 / statistics.median(ceiling)
    result: dict[str, object] = {
        "command": "python bench/events.py " + " ".join(argv or []),
        "args": vars(args), "bytes_per_put": nbytes, "machine": machine_info(),
        "ceiling_write_fdatasync": {**summarize(ceiling, nbytes), "puts_per_s": ceil_pps},
    }
    base = statistics.median(x["puts_per_s"] for x in rounds["none"])
    for cond in CONDITIONS:
        pps = [x["puts_per_s"] for x in rounds[cond]]
        all_puts = [s for x in rounds[cond] for s in x["put_s"]]
        result[cond] = {"rounds": rounds[cond], "puts_per_s_rounds": pps,
                        "puts_per_s_median": statistics.median(pps),
                        "vs_none": statistics.median(pps) / base,
                        "vs_ceiling": statistics.median(pps) / ceil_pps,
                        "put": summarize(all_puts, nbytes)}
    for cond in CONDITIONS[1:]:  # each round's ratio to the same round's baseline
        per_round = [a["puts_per_s"] / b["puts_per_s"]
                     for a, b in zip(rounds[cond], rounds["none"], strict=True)]
        result[cond]["vs_none_rounds"] = per_round
        result[cond]["vs_none_round_median"] = statistics.median(per_round)
    result["claim_idle_sub_vs_none"] = result["idle_sub"]["vs_none"]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for cond in CONDITIONS:
        c = result[cond]
        print(f"{cond:12s} {c['puts_per_s_median']:6.2f} puts/s  vs none {c['vs_none']:.3f}  "
              f"vs ceiling {c['vs_ceiling']:.3f}  put p50 {c['put']['p50_s'] * 1e3:.1f} ms")
    print(f"ceiling: write+fdatasync {ceil_pps:.2f} per s of the same bytes; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
