"""Request streams for the prefill-offload simulator: sessions of turns, each turn a prompt whose
leading ``shared`` tokens are context an earlier turn of the session stored.

- **ShareGPT** (:func:`from_trace`): the replay's own trace (``engine.replay.workload``: real
  conversations, Poisson session arrivals, exponential think times), each turn's prompt the
  kept history plus the user message. The history a turn extends is the previous turn's whole
  context; a truncated history is not a prefix of it (``shared`` 0).
- **Agent**: the same through :func:`engine.replay.workload.with_tool_calls` (a share of the
  conversations come back after a tool call instead of a user's think time).
- **Long context** (:func:`long_context`): document QA, generated from ``seed``: documents of
  log-normal length (median ``doc_median`` tokens, clipped to ``[doc_min, doc_max]``), each
  asked a geometric number of questions (mean ``questions_mean``) of uniform length in
  ``question_tokens``, answered in an exponential number of tokens (mean ``answer_mean``,
  at least 1), questions ``think_s`` (exponential) apart after each answer. Every question's
  prompt is the document plus the question: the document is what later questions share.

:meth:`Workload.at_rate` plays the stream faster or slower: session arrivals and think times
scaled alike (the same draws, so a sweep over rates compares one stream at different speeds:
the request rate scales with it, the order of sessions and turns stays).

Thread-safety: the records are immutable values; the builders are pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from engine.replay.workload import Trace


@dataclass(frozen=True, slots=True)
class Turn:
    prompt: int  # tokens of the prompt
    shared: int  # its leading tokens that the session stored before (reusable if cached)
    output: int  # tokens generated
    think_s: float  # after this turn finishes, before the session's next turn arrives
    save_context: bool  # the next turn extends prompt + output: write it back after decode


@dataclass(frozen=True, slots=True)
class Session:
    key: int  # identifies the session's blocks
    arrival_s: float
    turns: tuple[Turn, ...]


@dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    rate: float  # sessions per second of ``sessions``' arrivals
    sessions: tuple[Session, ...]
    time_scale: float = 1.0  # gaps (arrivals, think times) relative to the stream as built

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate!r}")
        if not self.sessions:
            raise ValueError("a workload needs at least one session")

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def turns_per_session(self) -> float:
        return self.num_requests / len(self.sessions)

    @property
    def span_s(self) -> float:
        """How long the stream lasts if every request took no time: its last arrival."""
        return max(s.arrival_s + sum(t.think_s for t in s.turns[:-1]) for s in self.sessions)

    def rate_for(self, rps: float) -> float:
        """The session rate at which requests arrive at about ``rps`` per second on average
        (as if they took no time)."""
        return self.rate * rps * max(self.span_s, 1e-9) / self.num_requests

    def at_rate(self, rate: float) -> Workload:
        """The same stream played ``rate / self.rate`` times as fast: session arrivals at
        ``rate`` sessions/s and every think time scaled alike, so the request rate scales
        with ``rate`` while the order of sessions and turns stays (a time-compressed
        replay; ``time_scale`` says by how much)."""
        if not rate > 0:
            raise ValueError(f"rate must be > 0, got {rate!r}")
        k = self.rate / rate
        return replace(self, rate=rate, time_scale=self.time_scale * k, sessions=tuple(
            replace(s, arrival_s=s.arrival_s * k, turns=tuple(
                replace(t, think_s=t.think_s * k) for t in s.turns))
            for s in self.sessions))

    def stats(self) -> dict[str, float]:
        prompts = np.array([t.prompt for s in self.sessions for t in s.turns])
        shared = np.array([t.shared for s in self.sessions for t in s.turns])
        outs = np.array([t.output for s in self.sessions for t in s.turns])
        return {"sessions": len(self.sessions), "requests": int(prompts.size),
                "prompt_mean": float(prompts.mean()), "prompt_p50": float(np.median(prompts)),
                "prompt_p90": float(np.percentile(prompts, 90)),
                "prompt_max": int(prompts.max()), "output_mean": float(outs.mean()),
                "shared_fraction": float(shared.sum() / prompts.sum())}


def from_trace(trace: Trace, name: str = "sharegpt") -> Workload:
    """Sessions from a replay trace (see the module docstring)."""
    truncation = trace.config.truncation
    sessions = []
    for c in trace.conversations:
        history = 0
        turns = []
        for spec in c.turns:
            kept = truncation.kept_length(history, spec.user_len + spec.reply_len,
                                          trace.context_window)
            prompt = kept + spec.user_len
            turns.append(Turn(prompt=prompt, shared=kept if kept == history else 0,
                              output=max(spec.reply_len, 1), think_s=spec.think_s,
                              save_context=True))
            history = prompt + spec.reply_len
        sessions.append(Session(key=c.index, arrival_s=c.arrival_s, turns=tuple(turns)))
    return Workload(name=name, rate=trace.config.arrival_rate, sessions=tuple(sessions))


@dataclass(frozen=True, kw_only=True)
class LongContextConfig:
    documents: int = 400
    rate: float = 0.5  # documents (sessions) per second
    doc_median: int = 16384
    doc_sigma: float = 0.6  # of log(length)
    doc_min: int = 2048
    doc_max: int = 32768
    questions_mean: float = 2.0
    question_tokens: tuple[int, int] = (20, 200)
    answer_mean: float = 120.0
    think_s: float = 30.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.documents < 1 or not self.rate > 0 or not self.questions_mean >= 1:
            raise ValueError("documents >= 1, rate > 0 and questions_mean >= 1 needed")
        if not 0 < self.doc_min <= self.doc_median <= self.doc_max:
            raise ValueError(f"doc_min <= doc_median <= doc_max needed, got {self.doc_min}, "
                             f"{self.doc_median}, {self.doc_max}")
        lo, hi = self.question_tokens
        if not 0 < lo <= hi or not self.answer_mean > 0 or self.think_s < 0:
            raise ValueError("question_tokens 0 < lo <= hi, answer_mean > 0, think_s >= 0 "
                             "needed")


def long_context(cfg: LongContextConfig = LongContextConfig()) -> Workload:
    """Document QA (see the module docstring)."""
    rng = np.random.default_rng(cfg.seed)
    gaps = rng.exponential(1 / cfg.rate, size=cfg.documents)
    arrivals = np.cumsum(gaps) - gaps[0]
    sessions = []
    for d in range(cfg.documents):
        doc = int(np.clip(rng.lognormal(np.log(cfg.doc_median), cfg.doc_sigma),
                          cfg.doc_min, cfg.doc_max))
        n = int(rng.geometric(1 / cfg.questions_mean))
        turns = tuple(Turn(prompt=doc + int(rng.integers(cfg.question_tokens[0],
                                                         cfg.question_tokens[1] + 1)),
                           shared=doc, output=max(1, int(rng.exponential(cfg.answer_mean))),
                           think_s=float(rng.exponential(cfg.think_s)) if cfg.think_s else 0.0,
                           save_context=False)
                      for _ in range(n))
        sessions.append(Session(key=d, arrival_s=float(arrivals[d]), turns=turns))
    return Workload(name="long-context", rate=cfg.rate, sessions=tuple(sessions))
