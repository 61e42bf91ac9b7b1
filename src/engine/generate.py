"""Generation with KV reuse: load the longest stored prefix, prefill the rest, decode, store.

``Generator.generate(ids)`` is one request. ``Conversation`` is a multi-turn chat on top of it:
it keeps the conversation's token ids (so every turn's prompt extends the last one exactly and
the store serves the whole history), and when the history would overflow the context window it
truncates the *stored KV* (the plan of :class:`engine.truncation.Truncation`: keep the sink
tokens, drop the oldest half of the rest until the turn fits) and re-positions the rest — no
recompute (AttentionStore §3.4).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch

import kvstore
from engine.loadcompute import LoadRates, Split
from engine.model import KV, Model, full_attention, split_kv, stack_kv
from engine.truncation import Truncation
from kvstore.pipelines.layer_load import LayerLoad


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """Greedy when ``temperature`` is 0 (the default)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True, kw_only=True)
class GenerationResult:
    tokens: list[int]  # the generated ids only
    reused_tokens: int  # prompt tokens whose KV came from the store
    prefilled_tokens: int  # prompt tokens computed
    ttft_s: float  # request start -> first token sampled (load + prefill)
    load_s: float  # time spent getting KV from the store
    total_s: float
    # tokens whose KV was stored for the next turn (0 if store=False or the store's admission
    # refused a synchronous put); an asynchronous save counts them here, and ``saved`` says
    # whether they were stored
    stored_tokens: int
    stop_reason: str  # "stop_token", "max_new_tokens" or "forced"
    # asynchronous save: done when the KV is durable (True), or refused by the store's
    # admission (False: nothing stored)
    saved: Future[bool] | None = None
    first_token: int = -1  # the token sampled after the prompt (with ``forced`` too)
    # reused tokens served from chunks stored through a lossy codec: when > 0 the result is not
    # bit-identical to a recompute (see docs/store.md, "Codecs")
    lossy_reused_tokens: int = 0
    # stored-prefix tokens computed instead of loaded (load or compute, engine.loadcompute):
    # the front of a split (then reused_tokens were loaded behind it), or all of a stored
    # prefix recomputed by choice
    recomputed_tokens: int = 0

    @property
    def lossy(self) -> bool:
        """Whether a lossy codec served part of the reused prefix."""
        return self.lossy_reused_tokens > 0


def _sample(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> int:
    # logits [V] float32
    if cfg.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / cfg.temperature, dim=-1)  # [V]
    if cfg.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)  # [V]
        keep = torch.cumsum(sp, 0) - sp < cfg.top_p  # [V] smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


def message_ids(model: Model, role: str, content: str, *, first: bool,
                system: str | None = None) -> list[int]:
    """Token ids a message adds to a conversation's history (ending with the assistant
    generation prompt). The first message gets the chat template's opening (``system``, or the
    model's default system prompt); a later one starts by closing the previous assistant turn
    (``<|im_end|>\n``), so every turn's prompt extends the previous context exactly."""
    if first:
        sys_msgs = [] if system is None else [{"role": "system", "content": system}]
        return model.chat_template([*sys_msgs, {"role": role, "content": content}])
    full = model.chat_template([{"role": "system", "content": ""},
                                {"role": role, "content": content}])
    sys_part = model.chat_template([{"role": "system", "content": ""}],
                                   add_generation_prompt=False)
    assert full[: len(sys_part)] == sys_part, "chat template is not compositional"
    im_end = model.tokenizer.token_to_id("<|im_end|>")
    nl = model.tokenizer.encode("\n", allow_special=False)
    return [im_end, *nl, *full[len(sys_part):]]


class LayerwisePast(Sequence[KV]):
    """A stored prefix as the ``past`` of :meth:`Model.forward`, loaded layer by layer:
    ``past[l]`` waits for layer l of a :class:`kvstore.pipelines.layer_load.LayerLoad`, so loading
    layer
    l+1 overlaps computing layer l."""

    def __init__(self, load: LayerLoad) -> None:
        self.load = load
        self.blocked_s = 0.0  # time the forward spent waiting for layers (the exposed load)

    def __len__(self) -> int:
        return self.load.num_layers

    def __getitem__(self, layer: int) -> KV:  # type: ignore[override]
        t = time.perf_counter()
        kv = self.load.wait(layer)  # ([H, n, D], [H, n, D])
        self.blocked_s += time.perf_counter() - t
        return kv


def split_forward(model: Model, ids: list[int], m: int, back: Sequence[KV], *,
                  on_layer=None) -> tuple[torch.Tensor, list[KV]]:
    """One forward for a prefix split at ``m`` (Cake): the front ``ids[:m]`` is computed from
    scratch and the new tokens ``ids[n:]`` over everything, while ``back`` (per layer the KV of
    positions [m, n), pre-RoPE, e.g. a :class:`LayerwisePast` still loading) is attended to
    from the new tokens only. One forward, so layer l computes while the back's later layers
    load, and no second pass pays the per-operation overheads again.

    The computed tokens run in position order (front, then new) after the back: the mask lets
    the front see only itself (causally) and the new tokens everything before them. Returns
    (logits [1, vocab] of the last token, KV per layer [H, len(ids), D] in position order);
    ``on_layer`` sees each layer's KV in position order too."""
    P = int(back[0][0].shape[1])  # n - m tokens loaded
    n = m + P
    N = len(ids)
    T = m + N - n  # computed: front + new
    assert 0 < m < n < N, (m, n, N)  # a front, a loaded back and at least one new token
    positions = torch.cat([torch.arange(m), torch.arange(n, N)])  # [T]
    # The new tokens see the loaded back, the front and, causally, each other: [N-n, P+T]
    new_mask = torch.ones(T - m, P + T, dtype=torch.bool).tril(diagonal=P + m)
    # [back, front, new] -> [front, back, new]
    order = torch.cat([torch.arange(P, P + m), torch.arange(P), torch.arange(P + m, P + T)])

    def attend(i, q, k, v, _mask, _causal):  # q [H, T, D], k/v [Hkv, P+T, D]
        # The front sees only itself, causally: the fast causal kernel over its own keys, as a
        # recompute from scratch runs it (not a masked pass over the back it cannot see).
        front = full_attention(i, q[:, :m], k[:, P:P + m], v[:, P:P + m], None, m > 1)
        rest = full_attention(i, q[:, m:], k, v, new_mask, False)  # [H, N-n, D]
        return torch.cat([front, rest], dim=1)  # [H, T, D]

    def ordered(i, k, v):  # k/v [Hkv, P+T, D] -> position order
        on_layer(i, k.index_select(1, order), v.index_select(1, order))

    logits, kv = model.forward(ids[:m] + ids[n:], positions, past=back,
                               past_positions=torch.arange(m, n), last_only=True,
                               on_layer=None if on_layer is None else ordered, attend=attend)
    return logits, [(k.index_select(1, order), v.index_select(1, order)) for k, v in kv]


class Generator:
    """Runs requests for ``model`` with KV reuse through ``store``.

    With ``layerwise`` (the default) a reused prefix is loaded layer by layer alongside the
    prefill of the new tokens (read buffer ``buffer_layers``); otherwise it is read whole first.
    With ``async_save`` (the default) each layer's KV goes to the store's write buffer as soon
    as the prefill produces it, decode KV follows in one batch, and a writer thread makes it
    durable (``GenerationResult.saved``; :meth:`flush` waits for all); a later request that
    shares the pending context's prefix waits for that save first. With ``rates``
    (:class:`engine.loadcompute.LoadRates`) each request splits its stored prefix between
    compute and load (Cake): the first ``m`` tokens are computed from scratch while the store
    loads the rest in the background (``load_layers(start=m)``), in one forward with the new
    tokens (:func:`split_forward`); ``m`` is what the rates measured so far (per tier the
    prefix sits in) predict fastest, 0 (load all) while they are unmeasured. Every request's
    timings feed the rates. Thread-safety: one request at a time per Generator (the store
    itself is thread-safe).
    """

    def __init__(self, model: Model, store: kvstore.Store, *, layerwise: bool = True,
                 buffer_layers: int | None = None, async_save: bool = True,
                 rates: LoadRates | None = None) -> None:
        if store.layout != model.layout:
            raise kvstore.LayoutMismatch(
                f"store layout {store.layout} does not match the model's {model.layout}"
            )
        self.model = model
        self.store = store
        self.layerwise = layerwise
        self.buffer_layers = buffer_layers
        self.async_save = async_save
        self.rates = rates
        self._last_past: LayerwisePast | None = None
        tok = model.tokenizer
        stops = {tok.token_to_id("<|im_end|>")}
        if model.config.eos_token_id is not None:
            stops.add(int(model.config.eos_token_id))
        self.stop_ids = frozenset(stops)
        self.prefill_rate: float | None = None  # measured tokens/s of prefill (moving average)

    def _measured_prefill(self, tokens: int, seconds: float) -> None:
        """Feed a prefill's speed to the store: with a remote tier it fetches only what
        arrives sooner than this machine recomputes it (prefills of >= 64 tokens count)."""
        if tokens < 64 or seconds <= 0:
            return
        rate = tokens / seconds
        self.prefill_rate = rate if self.prefill_rate is None else (
            0.7 * self.prefill_rate + 0.3 * rate)
        self.store.set_prefill_rate(self.prefill_rate)

    def load_prefix(self, ids: Sequence[int], *, namespace: str | None = None,
                    leave: int = 1) -> tuple[int, list[KV] | None]:
        """The longest stored prefix of ``ids`` that leaves at least ``leave`` tokens to compute
        (a request needs one to produce logits) and its KV per layer, or (0, None). A pending
        asynchronous save sharing a prefix with ``ids`` lands first."""
        self.store.wait_saved(ids, namespace=namespace)
        n = min(self.store.match(ids, namespace=namespace), len(ids) - leave)
        if n <= 0:
            return 0, None
        k, v = self.store.get(ids[:n], namespace=namespace)  # [L, H, n, D] each
        return n, split_kv(k, v)

    def truncate_stored(self, ids: Sequence[int], keep: torch.Tensor, *,
                        namespace: str | None, new_namespace: str) -> tuple[list[int], int]:
        """Truncate a stored context without recomputing it: load the KV of ``ids``, keep the
        tokens at indices ``keep`` [K] (ascending), and store them under ``new_namespace``
        (the kept KV was computed with the dropped tokens; RoPE re-positions it to 0..K-1 on
        use). History tokens without stored KV (a last generated token, or a tail the store
        evicted) are computed on top of the stored prefix first. Returns the kept token ids
        and how many leading tokens of ``ids`` the store served. If the store's eviction
        policy refuses the kept context (admission), nothing is stored under
        ``new_namespace`` and the next request computes the kept tokens again."""
        n, past = self.load_prefix(ids, namespace=namespace, leave=0)
        if n < len(ids):
            _, past = self.model.forward(list(ids[n:]), past=past)
        k, v = stack_kv(past)  # [L, H, T, D]
        assert k.shape[2] == len(ids)
        kept = [int(ids[i]) for i in keep.tolist()]
        self.store.put(kept, k.index_select(2, keep).contiguous(),
                       v.index_select(2, keep).contiguous(), namespace=new_namespace)
        return kept, n

    def flush(self) -> None:
        """Wait until every asynchronous save is durable (raises a save's error)."""
        self.store.flush()

    def generate(self, ids: Sequence[int], max_new_tokens: int = 64, *,
                 sampling: SamplingConfig | None = None, namespace: str | None = None,
                 store: bool = True, reuse: bool = True,
                 queue: Sequence[object] | None = None,
                 forced: Sequence[int] | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` after ``ids``, reusing stored KV of its prefix.

        Stores the KV of ``ids`` + the generated tokens that were fed back (all but the last)
        for the next turn when ``store`` is true. ``reuse=False`` recomputes everything (the
        baseline the reuse path must equal). ``queue``: the jobs waiting after this one (their
        prompts, next first), handed to the store as scheduler hints when this one starts.
        ``forced``: a teacher-forced continuation (a replay's recorded reply): the first token
        is still sampled (TTFT), then the KV of all of ``forced`` is computed in one forward
        and ``ids + forced`` is stored; ``tokens`` is ``forced`` and ``max_new_tokens`` is
        ignored.
        """
        ids = self.model._check_ids(ids).tolist()
        if forced is not None:
            forced = self.model._check_ids(forced).tolist() if len(forced) else []
            max_new_tokens = len(forced) + 1
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        window = self.model.config.context_length
        fed_new = max_new_tokens if forced is None else len(forced)  # forced: all are fed
        if len(ids) + fed_new > window:
            raise ValueError(
                f"ids ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceed the context "
                f"window of {window}; truncate the history first (see Conversation)"
            )
        cfg = sampling or SamplingConfig()
        gen = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
        t0 = time.perf_counter()
        if queue is not None:
            self.store.set_queue(queue, running=[(ids, namespace)])
        # A pending save that shares a prefix with ids must land before the store is asked
        # what it can serve (it re-raises that save's IO error).
        self.store.wait_saved(ids, namespace=namespace)
        save = None
        if store and self.async_save:  # before loading: it may wait for write-buffer room
            save = self.store.begin_save(ids, namespace=namespace,
                                         max_new_tokens=max_new_tokens - 1)
        plan = None
        if reuse and self.rates is not None:
            plan = self._plan(ids, namespace)
        try:
            try:
                n_reused, load_s, logits, kv, n_lossy = self._prefill(ids, namespace, reuse,
                                                                      save, t0, plan)
            except KeyError:
                # The stored prefix left the store after it was matched (another process
                # evicted it while it loaded): a miss. Recompute it; the save starts over, as
                # the chunks it would have reused may be gone too.
                if save is not None:
                    save.abort()
                    save = self.store.begin_save(ids, namespace=namespace,
                                                 max_new_tokens=max_new_tokens - 1)
                plan = None
                n_reused, load_s, logits, kv, n_lossy = self._prefill(ids, namespace, False,
                                                                      save, t0, None)
            res = self._decode(ids, logits, kv, save, cfg, gen, t0, n_reused, load_s,
                               max_new_tokens, namespace, store, forced)
            return replace(res, lossy_reused_tokens=n_lossy,
                           recomputed_tokens=0 if plan is None else plan.computed)
        except BaseException:
            if save is not None:
                save.abort()  # no-op once finished
            raise

    def _plan(self, ids: list[int], namespace: str | None) -> Split:
        """How this request uses its stored prefix: the tier it is read from (the slowest it
        touches) and the split the rates predict fastest."""
        n = max(min(self.store.match(ids, namespace=namespace), len(ids) - 1), 0)
        r = self.store.residency(ids[:n], namespace=namespace) if n else {"disk": 0}
        tier = "disk" if r.get("disk", 0) > 0 else "dram"
        return self.rates.plan(tier, n, len(ids) - n, layers=self.model.config.num_layers,
                               chunk_tokens=self.store.config.chunk_tokens)

    def _forward(self, ids: list[int], past: Sequence[KV] | None,
                 on_layer=None) -> tuple[torch.Tensor, list[KV]]:
        """One prefill forward over ``past``. A forward from scratch (a prompt recomputed)
        feeds the rates' prefill estimate: it is the compute the split trades against loading.
        A short forward over a long past is not counted: on a busy CPU its time is mostly
        per-operation overhead that the cost shape does not scale with (measured 18-45x the
        shape's prediction under a load average of 8, against 5-10x for a 1000-token
        prompt)."""
        t = time.perf_counter()
        logits, kv = self.model.forward(ids, past=past, last_only=True, on_layer=on_layer)
        if self.rates is not None and past is None:
            self.rates.observe_prefill(len(ids), time.perf_counter() - t)
        return logits, kv

    def _prefill(self, ids: list[int], namespace: str | None, reuse: bool,
                 save: kvstore.SaveHandle | None, t0: float, plan: Split | None = None
                 ) -> tuple[int, float, torch.Tensor, list[KV], int]:
        """The prompt's forward pass over its stored prefix (if ``reuse``; split between
        compute and load as ``plan`` says): (tokens loaded, seconds before compute started,
        logits, KV per layer, loaded tokens a lossy codec served). KeyError if the stored
        prefix leaves the store before it is loaded."""
        load = None
        self._last_past = None
        n_lossy = 0
        on_layer = None if save is None else save.layer
        try:
            if not reuse:
                n_stored, m, past = 0, 0, None
            elif self.layerwise:
                n_stored = min(self.store.match(ids, namespace=namespace), len(ids) - 1)
                m = 0 if plan is None or n_stored != plan.reused else plan.computed
                past = None
                if 0 < n_stored and m < n_stored:
                    load = self.store.load_layers(
                        ids[:n_stored], namespace=namespace, start=m,
                        buffer_layers=None if m else self.buffer_layers)
                    past = self._last_past = LayerwisePast(load)
                else:
                    m = n_stored  # all of it recomputed (by choice), or nothing stored
            else:
                (n_stored, past), m = self.load_prefix(ids, namespace=namespace), 0
            n_reused = n_stored - m
            if n_reused > 0:
                n_lossy = self.store.lossy_tokens(ids[:n_stored], namespace=namespace)
            load_s = time.perf_counter() - t0  # time before compute starts (layer-wise: ~0)
            t1 = time.perf_counter()
            if m and n_reused:  # the split: compute the front while the back loads
                logits, kv = split_forward(self.model, ids, m, past, on_layer=on_layer)
                if self.rates is not None and plan is not None:
                    self.rates.observe_split(plan, time.perf_counter() - t0)
            else:
                if m:  # recompute all of the stored prefix, in the prompt's forward
                    n_stored = 0
                logits, kv = self._forward(ids[n_stored:], past, on_layer)
            if n_stored == 0:  # a pure prefill: this machine's recompute speed
                self._measured_prefill(len(ids), time.perf_counter() - t1)
            if load is not None and self.rates is not None:
                c = self.store.config.chunk_tokens  # the load read whole chunks from m's
                self.rates.observe_load(plan.tier if plan is not None else "dram",
                                        n_stored - m // c * c, self._load_time(load))
            return n_reused, load_s, logits, kv, n_lossy
        finally:
            if load is not None:
                load.close()  # the execution buffer goes back before decoding

    @staticmethod
    def _load_time(load: LayerLoad) -> float:
        """The loader's own time for the whole load (all layers were waited for)."""
        load.wait(load.num_layers - 1)
        return load.load_s

    def _decode(self, ids: list[int], logits: torch.Tensor, kv: list[KV],
                save: kvstore.SaveHandle | None, cfg: SamplingConfig,
                gen: torch.Generator | None, t0: float, n_reused: int, load_s: float,
                max_new_tokens: int, namespace: str | None, store: bool,
                forced: list[int] | None = None) -> GenerationResult:
        first = _sample(logits[-1], cfg, gen)
        out = [first]
        ttft = time.perf_counter() - t0
        stop_reason = "max_new_tokens"
        if forced is not None:  # the recorded continuation, fed whole (its KV is stored)
            if forced:
                _, kv = self.model.forward(forced, past=kv, last_only=True)
            out, stop_reason = [*forced, -1], "forced"  # -1: the unsampled next token
        while forced is None:
            if out[-1] in self.stop_ids:
                stop_reason = "stop_token"
                break
            if len(out) >= max_new_tokens:
                break
            logits, kv = self.model.forward([out[-1]], past=kv, last_only=True)
            out.append(_sample(logits[-1], cfg, gen))
        fed = ids + out[:-1]  # tokens whose KV exists
        stored, saved = 0, None
        if save is not None:
            if len(out) > 1:  # decode-step KV, batched: [L, H, t, D] each
                k, v = stack_kv([(kk[:, len(ids):], vv[:, len(ids):]) for kk, vv in kv])
                assert k.shape[2] == len(out) - 1
                save.append(out[:-1], k, v)
            saved = save.finish()
            stored = len(fed)
        elif store:
            k, v = stack_kv(kv)  # [L, H, T, D]
            assert k.shape[2] == len(fed)
            stored = len(fed) if self.store.put(fed, k, v, namespace=namespace) else 0
        return GenerationResult(
            tokens=out if forced is None else forced, reused_tokens=n_reused,
            prefilled_tokens=len(ids) - n_reused,
            ttft_s=ttft, load_s=load_s, total_s=time.perf_counter() - t0, stored_tokens=stored,
            stop_reason=stop_reason, saved=saved, first_token=first,
        )


@dataclass
class Conversation:
    """A multi-turn chat whose history lives in the store.

    ``ids`` are the conversation's token ids so far (the context the next turn extends). When a
    turn would overflow the window, the stored KV of ``ids`` is truncated once to what the
    ``truncation`` plan keeps and stored again under the conversation's own namespace (the kept
    KV was computed with the dropped history, so it must not be served to another context with
    the same tokens). ``truncations`` counts the turns that truncated.
    """

    generator: Generator
    name: str
    ids: list[int] = field(default_factory=list)
    namespace: str | None = None
    # Keep the first 4 tokens: without these attention sinks, reused KV truncated on this
    # model is ~70% worse in perplexity than recompute; with them it matches (docs/benchmarks.md).
    truncation: Truncation = field(default_factory=lambda: Truncation(sink=4))
    window: int | None = None  # context window; default (and at most) the model's
    truncations: int = 0

    def __post_init__(self) -> None:
        limit = self.generator.model.config.context_length
        if self.window is None:
            self.window = limit
        if not 0 < self.window <= limit:
            raise ValueError(f"window must be in (0, {limit}], got {self.window}")

    def _message_ids(self, role: str, content: str, *, first: bool) -> list[int]:
        return message_ids(self.generator.model, role, content, first=first)

    def turn(self, user_text: str, max_new_tokens: int = 128, *,
             sampling: SamplingConfig | None = None) -> tuple[str, GenerationResult]:
        """Add a user message, generate the reply, store the context. Returns (text, result)."""
        new = self._message_ids("user", user_text, first=not self.ids)
        needed = len(new) + max_new_tokens
        if len(self.ids) + needed > self.window:
            try:
                keep = self.truncation.kept(len(self.ids), needed, self.window)
            except ValueError as e:
                raise ValueError(
                    f"a message of {len(new)} tokens + max_new_tokens={max_new_tokens} does not "
                    f"fit the conversation's window of {self.window} tokens even after "
                    f"truncating its history: {e}") from e
            self._truncate(keep)
        r = self.generator.generate(self.ids + new, max_new_tokens, sampling=sampling,
                                    namespace=self.namespace)
        # History = prompt + the assistant's content; a final stop token is re-added by the
        # next message (which starts by closing the assistant turn).
        content = r.tokens[:-1] if r.stop_reason == "stop_token" else r.tokens
        self.ids = self.ids + new + content
        text = self.generator.model.tokenizer.decode(
            [t for t in r.tokens if t not in self.generator.stop_ids], skip_special=True)
        return text, r

    def _truncate(self, keep: torch.Tensor) -> None:
        """Keep the history tokens at indices ``keep`` (the truncation plan): the stored KV of
        the history is loaded, the kept part stored again under the conversation's namespace
        (re-positioned to 0..K-1 on use). History tokens without stored KV (the last generated
        token, or a tail the store evicted) are computed on top of the stored prefix first."""
        ns = f"conversation:{self.name}"
        kept, _ = self.generator.truncate_stored(self.ids, keep, namespace=self.namespace,
                                                 new_namespace=ns)
        self.ids, self.namespace = kept, ns
        self.truncations += 1
