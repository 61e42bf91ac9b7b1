"""The replay workload: which ShareGPT conversations, when their turns arrive, how histories
are truncated.

Sessions arrive by a Poisson process (``arrival_rate`` per second); a conversation's next turn
arrives ``think`` seconds (exponential, mean ``think_s``) after its previous reply finished.
Everything random is drawn once from ``seed`` when the trace is built, so two replays of one
trace see the same arrivals and think times whatever their speed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from engine.truncation import Truncation


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    conversations: int | None = None  # how many (after ``skip`` and the filters); None: all
    skip: int = 0  # conversations passed over first
    min_turns: int = 1  # conversations with fewer turns (after cuts) are left out
    max_turns: int | None = None  # later turns are left out
    max_message_tokens: int | None = None  # a conversation ends before a longer message
    arrival_rate: float = 1.0  # sessions per second
    think_s: float = 60.0  # mean think time between a reply and the next user message
    context_window: int | None = None  # tokens; None: the model's (cost model or real model)
    truncation_ratio: float = 0.5  # share of the history dropped on overflow (§4.1)
    sink_tokens: int = 4  # first tokens always kept
    warmup_fraction: float = 10 / 52  # the first turns to arrive warm the cache (§4.2)
    seed: int = 0

    def __post_init__(self) -> None:
        def pos_int(name: str, v: object, allow_none: bool = True, minimum: int = 1) -> None:
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")

        pos_int("conversations", self.conversations)
        pos_int("skip", self.skip, False, 0)
        pos_int("min_turns", self.min_turns, False)
        pos_int("max_turns", self.max_turns)
        pos_int("max_message_tokens", self.max_message_tokens)
        pos_int("context_window", self.context_window, True, 16)
        pos_int("sink_tokens", self.sink_tokens, False, 0)
        pos_int("seed", self.seed, False, 0)
        if not self.arrival_rate > 0:
            raise ValueError(f"arrival_rate must be > 0, got {self.arrival_rate!r}")
        if not self.think_s >= 0:
            raise ValueError(f"think_s must be >= 0, got {self.think_s!r}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction!r}")
        Truncation(drop_ratio=self.truncation_ratio, sink=self.sink_tokens)  # validates

    @property
    def truncation(self) -> Truncation:
        return Truncation(drop_ratio=self.truncation_ratio, sink=self.sink_tokens)


@dataclass(frozen=True, slots=True)
class TurnSpec:
    user_len: int  # tokens the user message adds (chat template included)
    reply_len: int  # tokens of the assistant's reply
    think_s: float  # after this turn's reply, before the next turn arrives
    user_ids: tuple[int, ...] | None = None  # real mode only
    reply_ids: tuple[int, ...] | None = None
    # what a store sees of the turn's content: the ids at the head of the user message and at
    # the tail of the reply (kvstore.eviction.return_predictor.CONTENT_TOKENS each)
    head: tuple[int, ...] = ()
    tail: tuple[int, ...] = ()
    # a retention hint the caller gives with this turn's save (an agent framework that knows
    # its tool call returns within this long: kvstore's store.retention.pin(ttl_s=)); None: none
    ttl_s: float | None = None


@dataclass(frozen=True, slots=True)
class ConvSpec:
    index: int  # position in the token table
    conv_id: str
    arrival_s: float  # the first turn's arrival
    turns: tuple[TurnSpec, ...]


@dataclass(frozen=True, kw_only=True)
class Trace:
    config: WorkloadConfig
    context_window: int
    conversations: tuple[ConvSpec, ...]
    cut_turns: int  # turns left out by max_message_tokens / max_turns / the window rule

    @property
    def num_turns(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    @property
    def warmup_turns(self) -> int:
        return int(round(self.config.warmup_fraction * self.num_turns))


def build_trace(table, config: WorkloadConfig, *, context_window: int,
                with_ids: bool = False) -> Trace:
    """The trace of ``config`` over a token table (``engine.sharegpt.token_table``).

    Rules (docs/sharegpt.md): a conversation ends before its first turn whose user or reply
    message exceeds ``max_message_tokens`` or whose message + reply alone would not fit the
    window next to the sink tokens; it keeps at most ``max_turns`` turns; it is left out with
    fewer than ``min_turns``. ``with_ids`` keeps the token ids (real mode)."""
    import pyarrow.compute as pc

    window = config.context_window or context_window
    truncation = config.truncation
    conv = table.column("conv").to_numpy()
    user_len = pc.list_value_length(table.column("user_ids")).to_numpy()
    reply_len = pc.list_value_length(table.column("reply_ids")).to_numpy()
    starts = np.flatnonzero(np.r_[True, conv[1:] != conv[:-1]]) if len(conv) else np.array([])
    ends = np.r_[starts[1:], len(conv)] if len(conv) else np.array([])
    rng = np.random.default_rng(config.seed)
    chosen: list[tuple[int, int]] = []  # (first row, number of turns)
    cut = 0
    skipped = 0
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        n = 0
        for r in range(s, e):
            u, a = int(user_len[r]), int(reply_len[r])
            too_big = (config.max_message_tokens is not None
                       and max(u, a) > config.max_message_tokens)
            if too_big or not truncation.fits(u + a, window) or \
                    (config.max_turns is not None and n >= config.max_turns):
                break
            n += 1
        if n < config.min_turns or n == 0:
            continue
        if skipped < config.skip:
            skipped += 1
            continue
        cut += (e - s) - n
        chosen.append((s, n))
        if config.conversations is not None and len(chosen) >= config.conversations:
            break
    gaps = rng.exponential(1.0 / config.arrival_rate, size=len(chosen))
    arrivals = np.cumsum(gaps) - gaps[0] if len(chosen) else gaps
    thinks = rng.exponential(config.think_s, size=sum(n for _, n in chosen)) \
        if config.think_s > 0 else np.zeros(sum(n for _, n in chosen))
    rows = [r for s, n in chosen for r in range(s, s + n)]
    sub = table.take(rows)
    heads = _ends(sub.column("user_ids"), first=True)
    tails = _ends(sub.column("reply_ids"), first=False)
    if with_ids:
        uids, rids = sub.column("user_ids").to_pylist(), sub.column("reply_ids").to_pylist()
    ids_at = 0
    think_at = 0
    out = []
    conv_ids = table.column("conv_id")
    for (s, n), t0 in zip(chosen, arrivals.tolist(), strict=True):
        turns = []
        for r in range(s, s + n):
            ui = ri = None
            if with_ids:
                ui, ri = tuple(uids[ids_at]), tuple(rids[ids_at])
            turns.append(TurnSpec(user_len=int(user_len[r]), reply_len=int(reply_len[r]),
                                  think_s=float(thinks[think_at]), user_ids=ui, reply_ids=ri,
                                  head=heads[ids_at], tail=tails[ids_at]))
            ids_at += 1
            think_at += 1
        out.append(ConvSpec(index=int(conv[s]), conv_id=str(conv_ids[s]), arrival_s=float(t0),
                            turns=tuple(turns)))
    return Trace(config=config, context_window=window, conversations=tuple(out), cut_turns=cut)


def with_tool_calls(trace: Trace, *, fraction: float, pause_s: float, seed: int = 0) -> Trace:
    """An agent-like workload from ``trace``: a ``fraction`` of its conversations (drawn from
    ``seed``) are agents whose next turn comes when a tool call returns, ``pause_s`` × U(0.5,
    1.5) after the reply, instead of a user's think time; every turn of theirs but the last
    carries a retention hint of 1.5 × ``pause_s`` (the tool call's timeout, which the agent
    framework knows). The other conversations are left as they are."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
    if not pause_s > 0:
        raise ValueError(f"pause_s must be > 0, got {pause_s!r}")
    rng = np.random.default_rng(seed)
    convs = []
    for c in trace.conversations:
        if rng.random() >= fraction:
            convs.append(c)
            continue
        n = len(c.turns)
        turns = tuple(replace(t, think_s=float(pause_s * rng.uniform(0.5, 1.5)),
                              ttl_s=1.5 * pause_s if i < n - 1 else None)
                      for i, t in enumerate(c.turns))
        convs.append(replace(c, turns=turns))
    return replace(trace, conversations=tuple(convs))


def _ends(column, *, first: bool) -> list[tuple[int, ...]]:
    """Per row of a list column of token ids: its first (or last) ``CONTENT_TOKENS`` ids."""
    from kvstore.eviction.return_predictor import CONTENT_TOKENS

    arr = column.combine_chunks()
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy()
    out = []
    for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
        lo, hi = (a, min(b, a + CONTENT_TOKENS)) if first else (max(a, b - CONTENT_TOKENS), b)
        out.append(tuple(values[lo:hi].tolist()))
    return out
