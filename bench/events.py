"""KV events never slow the store: durable put throughput with the store publishing its KV events
(``kvstore.open(..., events=...)``) to a subscriber that reads nothing, against the same puts
without events, measured in one run.

Conditions, each a store of the same sizes open for the whole run (a disk budget of
``--disk-contexts`` contexts, so the puts evict all along and the events announce removals
too), put to in phases of ``--puts`` puts, one phase each per round (their order rotates), so
that what else the machine does meanwhile falls on all of them alike:

  none          no events (the baseline)
  idle_sub      events on a ZMQ endpoint whose one subscriber is connected and never reads
                (ZMQ drops beyond the high-water mark: the store never waits for it)
  reading_sub   events read by a subscriber thread in this process (decoding every batch)

Each store first puts ``--warmup`` contexts untimed; every put holds ``--tokens`` new token
ids (SmolLM2's layout, fp16 KV); a phase's throughput is puts per second over its puts
(compared as the median over phases, as the median of each round's ratio to the same round's
baseline, and over all puts). The ceiling is measured in the same run: ``write`` + ``fdatasync`` of
the same bytes to a new file (what a durable put cannot beat), reported as each condition's
ratio to it. The claim: median(idle_sub) / median(none) >= 0.98. Throughput on a shared,
noisy disk varies by more than 2% between phases, so the run also reports what the events
cost in CPU, which noise does not blur: the publisher threads' CPU seconds (``/proc``) per put,
against this process's CPU per put without events.

    python bench/events.py [--tokens 1024] [--puts 6] [--rounds 12] [--out FILE.json]
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


class Condition:
    """One store (fresh directory) and what its events go to: the store stays open for the
    whole run, and puts phase after phase."""

    def __init__(self, root: str, cond: str, args, ctx: zmq.Context) -> None:
        self.cond = cond
        self.path = os.path.join(root, cond)
        endpoint = f"ipc://{root}/{cond}.sock"
        self.idle = self.reader = None
        events = None
        if cond != "none":
            events = kvstore.EventsConfig(endpoint=endpoint, hwm=args.hwm)
            if cond == "idle_sub":  # connected, never reads
                self.idle = ctx.socket(zmq.SUB)
                self.idle.setsockopt(zmq.LINGER, 0)
                self.idle.setsockopt(zmq.RCVHWM, args.hwm)
                self.idle.connect(endpoint)
                self.idle.setsockopt(zmq.SUBSCRIBE, b"")
            else:
                self.reader = Reader(ctx, endpoint)
        ctx_bytes = args.tokens * SMOL.token_bytes
        slot = -(-SMOL.token_bytes * 256 // 4096) * 4096
        disk = -(-args.tokens // 256) * args.disk_contexts * slot
        self.store = kvstore.open(self.path, layout=SMOL, disk_bytes=disk, events=events,
                                  dram_bytes=args.dram_contexts * ctx_bytes * 2)
        self.put_s: list[float] = []
        self.phases: list[float] = []  # puts per second of each phase
        self.cpu_s = 0.0  # this process's CPU seconds during the timed phases

    def phase(self, n: int, k, v, rng, first: list[int], *, timed: bool) -> None:
        times = []
        c0 = time.process_time()
        for _ in range(n):
            toks = new_tokens(rng, len(k[0, 0]), first[0])
            first[0] += 1
            t0 = time.perf_counter()
            self.store.put(toks, k, v)
            times.append(time.perf_counter() - t0)
        if timed:
            self.cpu_s += time.process_time() - c0
            self.put_s += times
            self.phases.append(n / sum(times))

    def close(self) -> dict[str, object]:
        stats = self.store.stats()
        self.store.close()
        if self.idle is not None:
            self.idle.close()
        out: dict[str, object] = {"evictions": stats["evictions"]}
        if self.reader is not None:
            self.reader.close()
            out["reader_batches"] = self.reader.batches
            out["reader_events"] = self.reader.events
        ev = stats.get("events")
        if ev is not None:
            out["events"] = {k2: ev[k2] for k2 in ("stored_events", "removed_events",
                                                    "batches", "dropped_changes", "events")}
        shutil.rmtree(self.path, ignore_errors=True)
        return out


def publisher_cpu_s() -> float:
    """CPU seconds the store publishers' threads of this process spent (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for t in threading.enumerate():
        if t.name.startswith("kvstore-events-") and t.native_id is not None:
            try:
                with open(f"/proc/self/task/{t.native_id}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


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
    p.add_argument("--puts", type=int, default=6, help="timed puts per phase")
    p.add_argument("--warmup", type=int, default=4, help="untimed puts first, each store")
    p.add_argument("--rounds", type=int, default=12, help="phases of each condition")
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
    ceiling: list[float] = []
    ctx = zmq.Context()
    conds = {c: Condition(root, c, args, ctx) for c in CONDITIONS}
    closed: dict[str, dict] = {}
    try:
        for c in CONDITIONS:  # warmup: segment files made, DRAM touched, evictions begun
            conds[c].phase(args.warmup, k, v, rng, first, timed=False)
        for r in range(args.rounds):
            order = CONDITIONS[r % 3:] + CONDITIONS[:r % 3]
            for c in order:
                conds[c].phase(args.puts, k, v, rng, first, timed=True)
            ceiling += ceiling_round(root, nbytes, buf, max(1, args.puts // 2))
            print(f"round {r}: " + ", ".join(
                f"{c} {conds[c].phases[-1]:.2f} puts/s" for c in CONDITIONS), flush=True)
        events_cpu = publisher_cpu_s()  # both publishers, warmup included
    finally:
        for c in CONDITIONS:
            closed[c] = conds[c].close()
        ctx.term()
        shutil.rmtree(root, ignore_errors=True)
    ceil_pps = 1.0 / statistics.median(ceiling)
    result: dict[str, object] = {
        "command": "python bench/events.py " + " ".join(argv or []),
        "args": vars(args), "bytes_per_put": nbytes, "machine": machine_info(),
        "ceiling_write_fdatasync": {**summarize(ceiling, nbytes), "puts_per_s": ceil_pps},
    }
    base = statistics.median(conds["none"].phases)
    for c in CONDITIONS:
        cd = conds[c]
        med = statistics.median(cd.phases)
        result[c] = {"puts_per_s_phases": cd.phases, "puts_per_s_median": med,
                     "puts_per_s_all": len(cd.put_s) / sum(cd.put_s),
                     "vs_none": med / base, "vs_ceiling": med / ceil_pps,
                     "put": summarize(cd.put_s, nbytes), **closed[c]}
    for c in CONDITIONS[1:]:  # each round's ratio to the same round's baseline
        per_round = [a / b for a, b in zip(conds[c].phases, conds["none"].phases, strict=True)]
        result[c]["vs_none_rounds"] = per_round
        result[c]["vs_none_round_median"] = statistics.median(per_round)
        result[c]["vs_none_all_puts"] = (result[c]["puts_per_s_all"]
                                         / result["none"]["puts_per_s_all"])
    puts_with_events = sum(len(conds[c].put_s) for c in CONDITIONS[1:]) \
        + 2 * args.warmup
    none_cpu = conds["none"].cpu_s / len(conds["none"].put_s)
    result["cpu"] = {
        "put_cpu_s_none": none_cpu,  # this process's CPU per put, no events
        "publisher_cpu_s_per_put": events_cpu / puts_with_events,
        "publisher_vs_put": events_cpu / puts_with_events / none_cpu,
    }
    result["claim_idle_sub_vs_none"] = result["idle_sub"]["vs_none"]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for cond in CONDITIONS:
        c = result[cond]
        print(f"{cond:12s} {c['puts_per_s_median']:6.2f} puts/s  vs none {c['vs_none']:.3f}  "
              f"vs ceiling {c['vs_ceiling']:.3f}  put p50 {c['put']['p50_s'] * 1e3:.1f} ms")
    cpu = result["cpu"]
    print(f"CPU per put: {cpu['put_cpu_s_none'] * 1e3:.2f} ms (no events); the publisher "
          f"thread {cpu['publisher_cpu_s_per_put'] * 1e3:.3f} ms per put "
          f"({cpu['publisher_vs_put']:.4f} of it)")
    print(f"ceiling: write+fdatasync {ceil_pps:.2f} per s of the same bytes; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
