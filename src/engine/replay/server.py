"""The replay's inference server: an FCFS job queue with continuous batching, on a virtual clock.

One loop serves both modes; an :class:`Executor` says what each step costs. The simulated
executor asks a cost model; the real one runs SmolLM2 with the store and measures. Iteration
rules (vLLM-style, prefill first, as AttentionStore §4.2 describes): while jobs wait and the
batch has room, the waiting jobs at the head of the queue are prefilled together (up to
``max_prefill_tokens`` computed tokens, at least one job), and every job in that iteration gets
its first token when it ends; otherwise the running jobs decode. ``max_prefill_tokens`` is a
soft limit: a job joins if its new message fits what is left. Decode steps are taken in spans
up to the next event (a job finishing, or an arrival that could join), so a long trace costs
one loop pass per event, not per token. A job's next turn arrives its think time after the job
finished.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from engine.replay.workload import ConvSpec, Trace

LOADS = ("split", "all")


class MethodKind(StrEnum):
    """What a method does with the stored KV (see :class:`Method`); a str enum, so JSON, the
    CLI and labels keep the strings ``re``, ``as``, ``of``."""

    RE = "re"  # recompute every turn
    AS = "as"  # reuse; truncated in place on overflow
    OF = "of"  # reuse; positions baked in, so an overflow invalidates it


METHOD_KINDS = tuple(k.value for k in MethodKind)  # ("re", "as", "of")


@dataclass(frozen=True)
class Method:
    """RE: recompute every turn (token truncation). AS: AttentionStore, KV reused from the
    store, truncated in place on overflow. OF: as AS but positions are baked into the stored KV,
    so an overflow invalidates it. ``policy``: the store's eviction policy (AS and OF).
    ``load``: ``split`` decides per request how much of the stored prefix to load and how
    much to recompute from the front at the same time (never slower than either alone;
    :meth:`engine.replay.costs.CostModel.split`); ``all`` loads whatever is stored.
    ``kind``: a :class:`MethodKind` (its string is taken and stored as one)."""

    kind: MethodKind
    policy: str = "scheduler"
    load: str = "split"

    def __post_init__(self) -> None:
        from kvstore.eviction.policies import POLICIES

        if self.kind not in METHOD_KINDS:
            raise ValueError(f"method must be one of {METHOD_KINDS}, got {self.kind!r}")
        object.__setattr__(self, "kind", MethodKind(self.kind))
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.load not in LOADS:
            raise ValueError(f"load must be one of {LOADS}, got {self.load!r}")

    @property
    def caches(self) -> bool:
        return self.kind is not MethodKind.RE

    @property
    def label(self) -> str:
        if self.kind is MethodKind.RE:
            return "RE"
        tail = "" if self.load == "split" else f"-load{self.load}"
        return f"{self.kind.upper()}-{self.policy}{tail}"

    @classmethod
    def parse(cls, text: str) -> Method:
        """``re``, ``as`` (= ``as:scheduler``), ``as:lru``, ``of``, ``of:fifo``, or a policy
        name alone (``lru``, ``belady``: AS with that policy); a third part picks the load
        (``as:scheduler:all``, ``belady:all``)."""
        from kvstore.eviction.policies import POLICIES

        t = text.strip().lower()
        head, _, load = t.partition(":") if t.split(":")[0] in POLICIES else ("", "", "")
        if head:
            return cls("as", head, load or "split")
        kind, _, rest = t.partition(":")
        policy, _, load = rest.partition(":")
        return cls(kind, policy or "scheduler", load or "split")


@dataclass(slots=True, eq=False)
class Job:
    """One turn of one conversation, as the server sees it."""

    conv: ConvSpec
    turn: int
    seq: int  # arrival order
    arrival_s: float
    warmup: bool
    history: int  # tokens of history before truncation
    kept: int  # history tokens the prompt keeps (== history unless truncated)
    # filled in as it runs
    start_s: float = math.nan
    first_token_s: float = math.nan
    finish_s: float = math.nan
    reused: int = 0  # history tokens loaded from the store
    recomputed: int = 0  # stored history tokens computed from the front instead (load split)
    hit: str = "none"  # "none" (no history), "miss", "dram", "disk", "remote", "engine"
    load_s: float = 0.0  # load time left exposed
    compute_s: float = 0.0
    decode_s: float = 0.0
    remaining: int = 0  # decode steps left
    token: int = -1  # real mode: the first token sampled (exactness checks against RE)

    @property
    def user_len(self) -> int:
        return self.conv.turns[self.turn].user_len

    @property
    def reply_len(self) -> int:
        return self.conv.turns[self.turn].reply_len

    @property
    def prompt_len(self) -> int:
        return self.kept + self.user_len

    @property
    def truncated(self) -> bool:
        return self.kept < self.history

    @property
    def context_after(self) -> int:
        """Tokens of the context this turn leaves (the next turn's history)."""
        return self.prompt_len + self.reply_len


class Executor(Protocol):
    """What a step costs, and the store it drives. Called from the server's one thread."""

    method: Method

    def arrive(self, job: Job) -> None:
        """``job`` joined the tail of the waiting queue."""

    def prefill(self, job: Job, waiting: deque[Job], running: list[Job]) -> float:
        """Run (or cost) ``job``'s load and prefill; set ``job.reused``, ``hit``, ``load_s``,
        ``compute_s``; return the seconds it occupies the accelerator."""
        ...

    def decode(self, running: list[Job], steps: int) -> float:
        """Seconds for ``steps`` decode iterations of the running batch."""
        ...

    def finish(self, job: Job, next_arrival: float | None) -> None:
        """``job`` is done: save its context. ``next_arrival``: when the conversation's next
        turn arrives (None: it was the last)."""

    @property
    def max_batch(self) -> int: ...

    @property
    def max_prefill_tokens(self) -> int: ...

    def fits(self, running: list[Job], job: Job) -> bool:
        """Whether ``job`` can join the running batch (accelerator memory)."""
        ...


@dataclass(frozen=True, kw_only=True)
class ServerStats:
    makespan_s: float
    prefill_busy_s: float
    decode_busy_s: float
    iterations: int

    @property
    def gpu_s(self) -> float:
        return self.prefill_busy_s + self.decode_busy_s


def serve(trace: Trace, executor: Executor, *,
          on_job_done: Callable[[Job], None] | None = None) -> tuple[list[Job], ServerStats]:
    """Replay ``trace`` through ``executor``. Returns every job (in arrival order) and the
    server's busy times. Deterministic: ties in time are broken by arrival order."""
    return _Server(trace, executor, on_job_done).run()


class _Server:
    """One replay's loop (:func:`serve`): each iteration admits the arrivals due, then either
    prefills a batch from the head of the queue (:meth:`_prefill`) or decodes the running
    jobs up to the next event (:meth:`_decode`)."""

    def __init__(self, trace: Trace, executor: Executor,
                 on_job_done: Callable[[Job], None] | None) -> None:
        self.trace, self.executor, self.on_job_done = trace, executor, on_job_done
        self.seq = itertools.count()
        # (time, tiebreak, conv, turn)
        self.arrivals: list[tuple[float, int, ConvSpec, int]] = []
        for c in trace.conversations:
            heapq.heappush(self.arrivals, (c.arrival_s, next(self.seq), c, 0))
        self.history: dict[int, int] = {}
        self.jobs: list[Job] = []
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.t = 0.0
        self.prefill_busy = self.decode_busy = 0.0
        self.iterations = 0

    def run(self) -> tuple[list[Job], ServerStats]:
        while self.arrivals or self.waiting or self.running:
            self.iterations += 1
            self._admit_until(self.t)
            if not self.waiting and not self.running:
                self.t = self.arrivals[0][0]
                continue
            if not self._prefill():
                self._decode()
        return self.jobs, ServerStats(makespan_s=self.t, prefill_busy_s=self.prefill_busy,
                                      decode_busy_s=self.decode_busy,
                                      iterations=self.iterations)

    def _admit_until(self, now: float) -> None:
        trace = self.trace
        while self.arrivals and self.arrivals[0][0] <= now:
            at, _, conv, turn = heapq.heappop(self.arrivals)
            h = self.history.get(conv.index, 0)
            spec = conv.turns[turn]
            # build_trace keeps only turns that fit next to the sink tokens: never a ValueError
            kept = trace.config.truncation.kept_length(h, spec.user_len + spec.reply_len,
                                                       trace.context_window)
            job = Job(conv=conv, turn=turn, seq=len(self.jobs), arrival_s=at,
                      warmup=len(self.jobs) < trace.warmup_turns, history=h, kept=kept)
            self.jobs.append(job)
            self.waiting.append(job)
            self.executor.arrive(job)

    def _done(self, job: Job, now: float) -> None:
        job.finish_s = now
        self.history[job.conv.index] = job.context_after
        nxt = None
        if job.turn + 1 < len(job.conv.turns):
            nxt = now + job.conv.turns[job.turn].think_s
            heapq.heappush(self.arrivals, (nxt, next(self.seq), job.conv, job.turn + 1))
        self.executor.finish(job, nxt)
        if self.on_job_done is not None:
            self.on_job_done(job)

    def _prefill(self) -> bool:
        """Prefill the waiting jobs at the head of the queue that the batch takes, together;
        False if none could join (the running jobs decode instead)."""
        executor, waiting, running = self.executor, self.waiting, self.running
        batch: list[Job] = []
        budget = executor.max_prefill_tokens
        while waiting and len(running) + len(batch) < executor.max_batch:
            job = waiting[0]
            if batch and budget < job.user_len:  # at least its new message is computed
                break
            if (batch or running) and not executor.fits(running + batch, job):
                break  # wait for accelerator memory (a job alone is always admitted)
            waiting.popleft()
            job.start_s = self.t
            dt = executor.prefill(job, waiting, running + batch)
            budget -= job.prompt_len - job.reused
            self.t += dt
            self.prefill_busy += dt
            batch.append(job)
        for job in batch:  # the iteration's tokens come out together
            job.first_token_s = self.t
            job.remaining = max(job.reply_len - 1, 0)
            if job.remaining == 0:
                self._done(job, self.t)
            else:
                running.append(job)
        return bool(batch)

    def _decode(self) -> None:
        """A decode span: up to the first finish, or to an arrival that could join the
        batch."""
        executor, running = self.executor, self.running
        steps = min(j.remaining for j in running)
        if not self.waiting and self.arrivals and len(running) < executor.max_batch:
            one = executor.decode(running, 1)
            if one > 0:
                steps = max(1, min(steps, math.ceil((self.arrivals[0][0] - self.t) / one)))
        dt = executor.decode(running, steps)
        self.t += dt
        self.decode_busy += dt
        still = []
        for job in running:
            job.remaining -= steps
            job.decode_s += dt
            if job.remaining <= 0:
                self._done(job, self.t)
            else:
                still.append(job)
        self.running = still
