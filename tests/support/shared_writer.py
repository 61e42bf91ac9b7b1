"""One of several writer processes sharing a store, for the multi-process crash test.

Usage: python -m tests.support.shared_writer STORE_DIR SEED DISK_SLOTS MAX_TOKENS

Prints "ready" once the store is open, then "ok <seed> <i>" after put number i has returned.
Between puts it reads contexts of other writers (any earlier seed) and checks their bytes
("bad ..." on a mismatch), and hands the store a queue of its next contexts (prefetching).
It stops, closing the store, when its standard input closes; it prints its counters then.
A store that finds itself tampered with (:class:`kvstore.StoreTampered`) stops it too, with
"refused <message>" (at open) or "stopped <message>" (later) first.

:class:`Writer` starts one such process and follows what it prints (the tests' side).
"""

import faulthandler
import json
import queue
import random
import select
import signal
import sys
import threading
import time

import torch

import kvstore
from tests.support.crash_writer import context
from tests.support.forked import WRITERS
from tests.support.kvgen import SMALL, causal_kv
from tests.support.paths import ROOT


class Writer:
    """A shared_writer process on ``path`` (started here), its acknowledged puts and lines."""

    def __init__(self, path, seed, slots, max_tokens):
        self.seed = seed
        # forked from a warm Python (tests/support/forked.py), a process of its own
        self.proc = WRITERS.popen("tests.support.shared_writer", [path, seed, slots, max_tokens],
                                  cwd=ROOT, stdin=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.acked: list[int] = []
        self.bad: list[str] = []
        self.stats: dict | None = None
        self.ended: str | None = None  # "refused ..." or "stopped ...": a StoreTampered
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            line = line.strip()
            if line == "ready":
                self.ready.set()
            elif line.startswith("ok "):
                self.acked.append(int(line.split()[2]))
            elif line.startswith("bad "):
                self.bad.append(line)
            elif line.startswith(("refused ", "stopped ")):
                self.ended = line
            elif line.startswith("stats "):
                self.stats = json.loads(line[6:])
            self.lines.put(line)
        self.lines.put(None)

    def acks_after(self, n, timeout=180.0):
        """Wait until this writer has acknowledged more than ``n`` puts (a liveness check, not
        a time bound: on a loaded 2-core machine a writer once acknowledged nothing for over a
        minute, then went on; :meth:`report` shows where a writer that does not is)."""
        deadline = time.monotonic() + timeout
        while len(self.acked) <= n:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                return False
            try:
                self.lines.get(timeout=0.5)
            except queue.Empty:
                pass
        return True

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._reader.join(30)

    def report(self) -> str:
        """For a failure message: the writer's stacks as it is now (it dumps them on
        SIGUSR1), then its standard error to the end, once it is killed (reading the error
        of a live writer would wait for ever). The writer is gone afterwards."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)  # the dump is written by the writer's own signal handler
            self.kill()
        return f"last lines: {list(self.lines.queue)[-5:]}\n{self.proc.stderr.read()[-6000:]}"

    def stop(self):
        self.proc.stdin.close()
        self.proc.wait(60)
        self._reader.join(30)
        assert self.proc.returncode == 0, self.proc.stderr.read()


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # Writer.report
    path = sys.argv[1]
    seed, slots, max_tokens = (int(x) for x in sys.argv[2:5])
    try:
        s = kvstore.open(path, layout=SMALL, chunk_tokens=4, dram_bytes=8 * 4096,
                         disk_bytes=slots * 4096)
    except kvstore.StoreTampered as e:
        print(f"refused {e}".replace("\n", " "), flush=True)
        return
    print("ready", flush=True)
    try:
        _work(s, seed, max_tokens)
    except kvstore.StoreTampered as e:
        print(f"stopped {e}".replace("\n", " "), flush=True)
    st = s.stats()
    s.close()
    print("stats " + json.dumps(st["sharing"]), flush=True)


def _work(s, seed: int, max_tokens: int) -> None:
    rng = random.Random(seed)
    i = 0
    while not select.select([sys.stdin], [], [], 0)[0]:
        toks = context(seed, i, max_tokens)
        try:
            s.put(toks, *causal_kv(SMALL, toks))
        except kvstore.CapacityError:
            print("full", flush=True)  # every slot held by puts in flight: try the next one
        else:
            print(f"ok {seed} {i}", flush=True)
        i += 1
        if i % 3 == 0:
            s.set_queue([context(seed, j, max_tokens) for j in range(i, i + 3)])
        other = context(rng.randrange(seed + 1), rng.randrange(i + 1), max_tokens)
        n = s.match(other)
        if n:
            try:
                k, v = s.get(other[:n])
            except KeyError:
                continue  # evicted by another process in between: a miss
            ek, ev = causal_kv(SMALL, other[:n])
            if not (torch.equal(k, ek) and torch.equal(v, ev)):
                print(f"bad {other[:n]}", flush=True)


if __name__ == "__main__":
    main()
