"""A worker process holding a store open, driven over a pipe (multi-process tests).

Commands are tuples ``(op, *args)``; each gets one reply ``("ok", result)`` or
``("error", exception type name, message)``. KV is the deterministic causal KV of the tokens,
so a get is checked here, byte for byte, and only whether it was exact travels back.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection

import torch


def _run(store, op: str, args: tuple):
    from tests.support.kvgen import SMALL, causal_kv

    if op == "put":
        toks, ns = args
        k, v = causal_kv(SMALL, toks)
        store.put(toks, k, v, namespace=ns)
        return None
    if op == "match":
        toks, ns = args
        return store.match(toks, namespace=ns)
    if op == "get":  # True if exact; KeyError travels back as an error
        toks, ns = args
        k, v = store.get(toks, namespace=ns)
        ek, ev = causal_kv(SMALL, toks)
        return bool(torch.equal(k, ek) and torch.equal(v, ev))
    if op == "delete":
        toks, ns = args
        return store.delete(toks, namespace=ns)
    if op == "contexts":
        return sorted(c.n_tokens for c in store.contexts())
    if op == "chunks":
        return store.stats()["disk"]["chunks"]
    if op == "stats":
        return store.stats()
    raise ValueError(f"unknown op {op!r}")


def serve(conn: Connection) -> None:
    """Process entry point: serve commands until ``("exit",)``."""
    import kvstore
    from tests.support.kvgen import SMALL

    store = None
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        op, args = msg[0], tuple(msg[1:])
        try:
            if op == "exit":
                if store is not None:
                    store.close()
                conn.send(("ok", None))
                return
            if op == "open":
                path, kw = args
                store = kvstore.open(path, layout=SMALL, **kw)
                result = os.getpid()
            elif op == "close":
                store.close()
                store = None
                result = None
            else:
                result = _run(store, op, args)
            conn.send(("ok", result))
        except BaseException as e:  # the driver decides what an error means
            conn.send(("error", type(e).__name__, str(e)))
            if not isinstance(e, Exception):
                raise


class Workers:
    """``n`` spawned worker processes (the driver side)."""

    def __init__(self, n: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=serve, args=(child,), daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def send(self, w: int, *msg) -> None:
        self.conns[w].send(msg)

    def recv(self, w: int, timeout: float = 120.0):
        if not self.conns[w].poll(timeout):
            raise TimeoutError(f"worker {w} did not answer in {timeout} s")
        reply = self.conns[w].recv()
        if reply[0] == "error":
            raise _remote_error(reply[1], reply[2])
        return reply[1]

    def call(self, w: int, *msg):
        self.send(w, *msg)
        return self.recv(w)

    def close(self) -> None:
        for w, p in enumerate(self.procs):
            if p.is_alive():
                try:
                    self.call(w, "exit")
                except (OSError, EOFError, TimeoutError, RuntimeError):
                    p.kill()
            p.join(30)


class RemoteError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def _remote_error(kind: str, message: str) -> Exception:
    if kind == "KeyError":
        return KeyError(message)
    return RemoteError(kind, message)


if __name__ == "__main__":  # pragma: no cover - used only through Workers
    sys.exit("run through tests.support.mp_worker.Workers")
