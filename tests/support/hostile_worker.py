"""Runs the store against damaged or hostile directories, one forked child per case.

Started once per test module (``python -m tests.support.hostile_worker``): it imports torch and
kvstore once, then for each request line on stdin (JSON: ``dir``, ``contexts``: the token lists
stored there, ``timeout``) forks a child that opens the directory for writing, gets every
context, puts a new one, closes, opens it read-only and runs ``verify``. The parent waits for
the child and answers one JSON line: how it ended (``exit`` with its code, ``signal``, or
``timeout``) and the child's log. The child exits 0 when every outcome was allowed (a store
error, a miss, exact bytes), 3 when any get returned wrong bytes, 4 on an error that is not
the store's own. The parent never opens a store, so forking it is safe.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import tempfile
import traceback

import torch

import kvstore
from kvstore.errors import KVStoreError
from kvstore.tools.verify import verify_path
from tests.support.kvgen import SMALL, causal_kv

NEW = list(range(900, 911))


def _gets(store, contexts, log) -> bool:
    """Get every context; False if any came back with wrong bytes."""
    ok = True
    for toks in contexts:
        try:
            k, v = store.get(toks)
        except KeyError:
            log.append("miss")
            continue
        except KVStoreError as e:
            log.append(f"get: {type(e).__name__}")
            continue
        ek, ev = causal_kv(SMALL, toks)
        if not (torch.equal(k, ek) and torch.equal(v, ev)):
            log.append(f"WRONG BYTES for a context of {len(toks)} tokens")
            ok = False
        else:
            log.append("exact")
    return ok


def run_case(path: str, contexts: list[list[int]], log: list[str]) -> int:
    ok = True
    try:
        with kvstore.open(path) as s:
            log.append("opened for writing")
            ok &= _gets(s, contexts, log)
            for toks in contexts:
                try:
                    s.indexes(toks)
                except KVStoreError as e:
                    log.append(f"indexes: {type(e).__name__}")
            s.put(NEW, *causal_kv(SMALL, NEW))
            ok &= _gets(s, [NEW], log)
    except KVStoreError as e:
        log.append(f"open/put: {type(e).__name__}: {e}")
    try:
        with kvstore.open(path, readonly=True) as s:
            log.append("opened read-only")
            ok &= _gets(s, contexts, log)
    except (KVStoreError, FileNotFoundError) as e:
        log.append(f"read-only: {type(e).__name__}: {e}")
    try:
        report = verify_path(path)
        log.append(f"verify ok={report['ok']}")
    except (KVStoreError, FileNotFoundError) as e:
        log.append(f"verify: {type(e).__name__}: {e}")
    return 0 if ok else 3


def _child(req: dict, out: str) -> None:
    log: list[str] = []
    code = 4
    try:
        code = run_case(req["dir"], req["contexts"], log)
    except BaseException:
        log.append(traceback.format_exc())
    with open(out, "w") as f:
        json.dump(log, f)
    os._exit(code)


def main() -> None:
    torch.set_num_threads(1)
    for line in sys.stdin:
        req = json.loads(line)
        fd, out = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        pid = os.fork()
        if pid == 0:
            _child(req, out)
        pidfd = os.pidfd_open(pid)  # readable once the child has ended
        try:
            ended, _, _ = select.select([pidfd], [], [], req.get("timeout", 60))
        finally:
            os.close(pidfd)
        if not ended:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if not ended:
            status = "timeout"
        try:
            with open(out) as f:
                log = json.load(f)
        except ValueError:
            log = []
        os.unlink(out)
        if status == "timeout":
            res = {"end": "timeout", "log": log}
        elif os.WIFSIGNALED(status):
            res = {"end": "signal", "signal": os.WTERMSIG(status), "log": log}
        else:
            res = {"end": "exit", "code": os.WEXITSTATUS(status), "log": log}
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
