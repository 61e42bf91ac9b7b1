"""The scheduler side: what the store can serve, and what each step loads and saves.

Runs in vLLM's EngineCore process, beside its scheduler. It answers how many tokens beyond
vLLM's own prefix cache the store holds (``Store.match``, never the prompt's last token: vLLM
computes at least one), and plans each step: the blocks to fill before the forward, and the
requests whose KV has grown by whole blocks, to save after it. It never reads KV.

**Tails.** vLLM's unit is the block, but a conversation rarely ends on one. When a request
ends, its last partial block is saved too, filled up to the block's end with :data:`PAD`, a
token id no tokenizer produces (the block's bytes past the request's KV are whatever vLLM's
block held: no prompt ever matches a PAD position, so they are never served as KV). A later
prompt that shares the request's tokens then matches into that block, and the load fills the
block whole (``Store.load_layers`` with pages): vLLM computes from the first token the store
does not hold, so a repeated prompt computes its last token only and a conversation's next
turn its new message only. A match that ends inside a block is taken where a tier holds the
stored chunk that fills that block (this machine's, or a shared tier's: the load reads it).

**Retention hints**: a request whose ``kv_transfer_params`` carry ``{"kvstore": {"pin": true,
"ttl_s": N}}`` (:func:`retention_hint`) gets a final save even if all its blocks were saved,
and the worker pins that save's context once it is stored. A hybrid request pins its
boundary, its prompt's end (the worker, once the boundary's save is durable; this side at
once if the store held it already); a pinned boundary is never deleted by a replacement. Its
``kv_transfer_params["kvstore"]["pin"]`` says what became of the hint (:func:`pin_outcome`).

**Hybrid models** (sliding-window or recurrent layers, :mod:`.groups`): the store answers only
boundaries whose state it holds; a load fills the full-attention blocks and the boundary's
state blocks (:mod:`.hybrid`) whole, before the request is scheduled (an asynchronous load:
vLLM waits for the worker to report it done or failed, which it must with several groups).
A request leaves one boundary, its prompt's end, saved after the step whose forward computed
the prompt's last token (its windows and states hold that position then only), which replaces
the boundary the request was loaded from: a conversation keeps its latest state, as the store
keeps a conversation's latest context (a boundary is as large as the windows and states of
every layer, and a conversation's next turn extends its latest prompt whatever its answer
re-tokenizes to). Blocks after the prompt (decode) are not saved: no boundary follows them.
When a replaced boundary is deleted is :class:`~.boundaries.BoundaryBook`'s decision: not
while another live request matched or loads it, never once two continuations loaded it, and
after a grace period in which a branch of the same turn still finds it.

**Several KV-cache groups** of full attention alone (layers vLLM keeps in separate block
tables): every load and save names each group's blocks (``group_block_ids``), and loads are
whole and asynchronous, as a hybrid's are (vLLM takes load failures per request, not per
block, with several groups); otherwise served as a plain model. One group: block ids as vLLM
gives them, nothing else changes.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from kvstore.errors import KVStoreError
from kvstore.integrations import retention
from kvstore.integrations.retention import Hint, from_kv_transfer_params
from kvstore.integrations.vllm.boundaries import BoundaryBook
from kvstore.integrations.vllm.config import BOUNDARY_GRACE_DISK_SHARE, DEFAULT_BOUNDARY_GRACE_S
from kvstore.integrations.vllm.exchange import ExchangeBook
from kvstore.integrations.vllm.groups import Groups
from kvstore.integrations.vllm.hybrid import full_block_ids, state_plan
from kvstore.integrations.vllm.plan import LoadSpec, SaveSpec, StepPlan, WorkerReport
from kvstore.integrations.vllm.roles import Exchange
from kvstore.store.facade import Store

log = logging.getLogger("vllm.kvstore")

PAD = 2**32 - 1  # fills a saved tail's last block: a token id no vocabulary has


def request_namespace(base: str | None, cache_salt: str | None) -> str | None:
    """The store namespace of a request: the configured one, with vLLM's per-request
    ``cache_salt`` mixed in (a salted request shares KV only with the same salt)."""
    if cache_salt is None:
        return base
    return json.dumps([base, cache_salt])


def retention_hint(request) -> Hint | None:
    """The retention hint of a request's ``kv_transfer_params`` (``{"kvstore": {"pin": true,
    "ttl_s": 40}}``, :func:`kvstore.integrations.retention.from_kv_transfer_params`): its
    final save pins the context it stores (in the request's namespace). A malformed one is
    logged and ignored (vLLM has accepted the request)."""
    try:
        return from_kv_transfer_params(getattr(request, "kv_transfer_params", None))
    except ValueError as e:
        log.warning("kvstore: request %s: retention hint ignored: %s", request.request_id, e)
        return None


def skip_reason(request) -> str | None:
    """Why a request's KV is not a function of its token ids alone (then it is neither loaded
    nor saved), or None."""
    if request.prompt_token_ids is None:
        return "prompt embeddings"
    if request.lora_request is not None:
        return "a LoRA adapter"
    if request.mm_features:
        return "multimodal inputs"
    if request.pooling_params is not None:
        return "a pooling request"
    return None


@dataclass(eq=False)
class _Tracked:
    """A request the connector follows from its allocation to its end."""

    request: object  # vllm.v1.request.Request
    namespace: str | None
    saved: int = 0  # tokens whose saving was planned (whole blocks)
    loaded: dict[str, int] | None = None  # tokens the worker loaded, by tier
    load_failed: bool = False
    # A save skipped in the step that loads from the remote tier (copying what was just
    # fetched back out of vLLM's blocks would sit in that step's forward): the request's next
    # save, at a block boundary or when it ends, covers it.
    deferred: bool = False
    loaded_from: int = 0  # a hybrid request: the stored boundary it was loaded from
    lossy_tokens: int = 0  # of the tokens loaded, those lossy chunks served (lossy_ok)
    retain: Hint | None = None  # its kv_transfer_params' retention hint (retention_hint)
    pin: dict | None = None  # a hybrid request's hint: what became of it (pin_outcome)
    produce: bool = False  # a producer's request (:mod:`.roles`): its prompt made durable
    produced: dict | None = None  # ... planned at its prompt's end: the worker's outcome
    load_start: int = 0  # the first token its load filled


class SchedulerSide:
    """Thread-safety: vLLM calls it from its scheduler thread only."""

    def __init__(self, store: Store | None, *, block_size: int, namespace: str | None,
                 save: bool, block_ids_of, groups: Groups | None = None,
                 lossy_ok: bool = False, grace_s: float = DEFAULT_BOUNDARY_GRACE_S,
                 grace_bytes: int | None = None, clock=time.monotonic,
                 exchange: Exchange | None = None) -> None:
        self.store = store
        self._clock = clock
        self.block_size = block_size
        self.namespace = namespace
        self.save = save
        self.lossy_ok = lossy_ok  # else only chunks stored without a lossy codec are served
        # req_id -> the request's block ids, one list per KV-cache group
        self._block_ids_of = block_ids_of
        self.groups = groups if groups is not None and groups.hybrid else None
        self._all_groups = groups  # every KV-cache group (None: one, of full attention)
        # loads whole and asynchronous for vLLM: a hybrid's, or with several groups
        self._whole_loads = groups is not None and (groups.hybrid or len(groups.groups) > 1)
        self._tracked: dict[str, _Tracked] = {}
        self._lookups: dict[str, tuple[int, int]] = {}  # req_id -> (start, tokens) last answered
        self._loads: list[tuple[str, int, int]] = []  # allocated, not planned yet
        self._final: list[SaveSpec] = []
        # req_id -> the kv_transfer_params given to vLLM for a request that ended in
        # this step: vLLM asks request_finished before it hands over the step's worker report,
        # and serializes the params only after both, so the report still completes them.
        self._ended: dict[str, dict] = {}
        self._held: set[str] = set()  # ended requests whose blocks wait for a final save
        # kv_role: what producers answer, what consumers wait for (:mod:`.exchange`)
        self.exchange = ExchangeBook(exchange or Exchange(), store, block_size=block_size,
                                     groups=self.groups, clock=clock)
        # a hybrid's boundaries: who needs which, which are shared, which replaced ones wait
        self.book = None if self.groups is None or store is None else BoundaryBook(
            store, grace_s=grace_s, grace_bytes=grace_bytes if grace_bytes is not None
            else store.config.disk_bytes // BOUNDARY_GRACE_DISK_SHARE,
            state_size=self.groups.state_size, clock=clock)

    # ---- lookups --------------------------------------------------------------------------
    def matched(self, request, num_computed: int) -> tuple[int | None, bool]:
        """Tokens after ``num_computed`` (block-aligned) that the store can fill, leaving at
        least the last token to compute (ending inside a block only where this machine holds
        that block), and whether the load is asynchronous (a hybrid model's, or a remote
        prefill's). None ("not yet"): a remote prefill's KV is not all there yet and its
        deadline has not passed (:mod:`.roles`). A failing store is a miss."""
        if self.store is None or skip_reason(request) is not None:
            return 0, False
        tokens = request.all_token_ids
        limit = len(tokens) - 1
        if limit <= num_computed:
            return 0, False
        ns = request_namespace(self.namespace, request.cache_salt)
        wait = self.exchange.awaiting(request, ns)
        if wait is not None and not wait.done and not wait.due(self._clock()):
            return None, False  # not yet: no probe before its time
        n = self._match(request, tokens[:limit], ns)
        if wait is not None and not wait.done:
            if not wait.probed(self._clock(), n):
                return None, False
            wait.start = num_computed
        ext = max(0, n - num_computed)
        self._lookups[request.request_id] = (num_computed, ext)
        if self.book is not None:  # the matched boundary is not deleted until it is loaded
            if ext > 0:
                self.book.hold(request.request_id, ns, tokens[:n])
            else:
                self.book.release(request.request_id)
        return ext, ext > 0 and (self._whole_loads
                                 or self.exchange.remote_load(request.request_id))

    def _match(self, request, tokens, ns: str | None) -> int:
        try:
            return self.store.match(tokens, namespace=ns, exact=not self.lossy_ok)
        except (KVStoreError, OSError) as e:
            log.warning("kvstore: lookup of request %s failed (a miss): %s",
                        request.request_id, e)
            return 0

    def allocated(self, request, num_external: int) -> None:
        """vLLM allocated the request's blocks; ``num_external`` tokens are to be loaded."""
        rid = request.request_id
        tracked = self._tracked.get(rid)
        if tracked is None and skip_reason(request) is None:
            tracked = self._tracked[rid] = _Tracked(
                request, request_namespace(self.namespace, request.cache_salt),
                retain=retention_hint(request),
                produce=self.save and self.exchange.produces(request))
        start, _ = self._lookups.pop(rid, (0, 0))
        if num_external <= 0 or tracked is None:
            if self.book is not None:
                self.book.release(rid)
            return
        tracked.loaded_from = start + num_external
        tracked.load_start = start
        if self.lossy_ok:
            tracked.lossy_tokens = self._lossy(tracked, start, start + num_external)
        self._loads.append((rid, start, num_external))

    def _lossy(self, tracked: _Tracked, start: int, end: int) -> int:
        """Tokens among [start, end) of the request that lossy chunks serve."""
        toks = tracked.request.all_token_ids
        try:
            front = self.store.lossy_tokens(toks[:start], namespace=tracked.namespace) \
                if start else 0
            return self.store.lossy_tokens(toks[:end], namespace=tracked.namespace) - front
        except (KVStoreError, OSError):
            return 0

    # ---- planning -------------------------------------------------------------------------
    def plan(self, num_scheduled: dict[str, int], spec_tokens: dict[str, list[int]]
             ) -> StepPlan:
        """This step's plan: the loads allocated since the last step, and a save for every
        scheduled request whose computed KV (after this step) has grown by whole blocks."""
        B = self.block_size
        plan = StepPlan(saves=self._final)
        self._final = []
        self._ended.clear()  # the previous step's outputs have left
        for rid, start, n in self._loads:
            tracked = self._tracked[rid]
            tables = self._block_ids_of(rid)
            toks = tracked.request.all_token_ids
            spec = self._load_spec(rid, tracked, tables, toks, start, n,
                                   whole=self._whole_loads or self.exchange.remote_load(rid))
            plan.loads.append(spec)
            tracked.deferred = self.save and self.groups is None and self._from_remote(spec)
        self._loads = []
        if self.book is not None:
            self.book.collect()  # replaced boundaries past their grace
        if not self.save or self.store is None:
            return plan
        loading = {spec.req_id for spec in plan.loads}
        for rid, n in num_scheduled.items():
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue
            req = tracked.request
            # Tokens whose KV exists after this step (draft tokens may be rejected) and
            # whose ids are known (async scheduling appends sampled ids later).
            done = req.num_computed_tokens + n - len(spec_tokens.get(rid, ()))
            if tracked.produce and req.num_computed_tokens < req.num_prompt_tokens <= done:
                # its prompt ends in this step: saved whole, durable when the step returns
                plan.produce.append(rid)
                tracked.produced = {}
                if self.groups is None and tracked.saved < req.num_prompt_tokens:
                    plan.saves.append(self._save(rid, tracked, req.num_prompt_tokens,
                                                 self._block_ids_of(rid), produce=True))
                    continue
            if self.groups is not None and done >= req.num_prompt_tokens:
                if done == req.num_prompt_tokens:
                    self._prompt_end(plan, rid, tracked, done)
                continue  # decode: no boundary would follow what is saved
            upto = min(done, len(req.all_token_ids)) // B * B
            if upto <= tracked.saved:
                continue
            if tracked.deferred and rid in loading:
                tracked.saved = upto  # the next save covers it (every save starts at 0)
                continue
            plan.saves.append(self._save(rid, tracked, upto, self._block_ids_of(rid)))
        return plan

    def _load_spec(self, rid: str, tracked: _Tracked, tables, toks, start: int, n: int, *,
                   whole: bool) -> LoadSpec:
        """The load of tokens [start, start + n) into the request's blocks (``tables``: its
        block ids per group); a hybrid model's with its boundary state's blocks. ``whole``:
        asynchronous for vLLM (several groups, a remote prefill's)."""
        B, end = self.block_size, start + n
        lo, hi = start // B, -(-end // B)
        full = self._full_tables(tables, lo, hi)
        if self.groups is None:
            return LoadSpec(req_id=rid, tokens=tuple(toks[:end]), start=start,
                            block_ids=full[0], namespace=tracked.namespace,
                            group_block_ids=full if len(full) > 1 else None,
                            whole=whole)
        return LoadSpec(req_id=rid, tokens=tuple(toks[:end]), start=start, block_ids=full[0],
                        namespace=tracked.namespace, group_block_ids=full,
                        state=state_plan(self.groups, tables, end, keep_below=start),
                        whole=True)

    def _full_tables(self, tables, lo: int, hi: int) -> tuple[tuple[int, ...], ...]:
        """Blocks ``lo .. hi - 1`` of every full-attention group's table (``tables``: the
        request's block ids per KV-cache group, as vLLM gives them)."""
        if self._all_groups is not None:
            return full_block_ids(self._all_groups, tables, lo, hi)
        if len(tables) != 1:
            raise ValueError(f"{len(tables)} KV-cache groups, but the connector was not given "
                             f"vLLM's KVCacheConfig to tell them apart")
        return (tuple(int(b) for b in tables[0][lo:hi]),)

    def _from_remote(self, spec: LoadSpec) -> bool:
        """Whether part of a load comes from the remote tier (not stored on this machine)."""
        try:
            return self.store.residency(list(spec.tokens), namespace=spec.namespace)[
                "missing"] > 0
        except (KVStoreError, OSError):
            return False

    def _save(self, rid: str, tracked: _Tracked, upto: int, tables, *, final: bool = False,
              boundary: bool = False, produce: bool = False) -> SaveSpec:
        """Save the request's first ``upto`` tokens (``tables``: its block ids per group); a
        partial last block filled up with :data:`PAD` (a final save's, a producer's prompt),
        or, for a hybrid model (at its end, or a ``boundary``: its prompt's end), kept whole
        with the boundary state after ``upto`` beside it. ``produce``: a producer's prompt,
        never dropped for a full write buffer."""
        B = self.block_size
        tracked.saved = upto // B * B if boundary and not final else upto
        tracked.deferred = False
        tokens = tuple(tracked.request.all_token_ids[:upto])
        if self.groups is not None:
            full = self._full_tables(tables, 0, -(-upto // B))
            state = state_plan(self.groups, tables, upto) if boundary else None
            if state is None:
                full = tuple(ids[:upto // B] for ids in full)
            if boundary and self.book is not None:
                self.book.replacing(rid, tracked.namespace,
                                    tracked.request.all_token_ids[:tracked.loaded_from], tokens)
            return SaveSpec(req_id=rid, tokens=tokens, block_ids=full[0],
                            namespace=tracked.namespace, final=final, group_block_ids=full,
                            state=state, retain=tracked.retain if boundary else None,
                            produce=produce)
        if upto % B:
            tokens += (PAD,) * (B - upto % B)
        full = self._full_tables(tables, 0, len(tokens) // B)
        return SaveSpec(req_id=rid, tokens=tokens, block_ids=full[0],
                        group_block_ids=full if len(full) > 1 else None,
                        namespace=tracked.namespace, final=final,
                        retain=tracked.retain if final else None, produce=produce)

    # ---- outcomes -------------------------------------------------------------------------
    def reported(self, report: WorkerReport) -> None:
        """The worker's account of this step's loads, and of hybrid boundary saves."""
        for rid, tiers in report.loaded.items():
            if (tracked := self._tracked.get(rid)) is not None:
                tracked.loaded = {k: (tracked.loaded or {}).get(k, 0) + v
                                  for k, v in tiers.items()}
                if self.book is not None and tracked.loaded_from:
                    toks = tracked.request.prompt_token_ids
                    self.book.loaded(rid, tracked.namespace, toks[:tracked.loaded_from], toks)
            elif (ended := self._ended.get(rid)) is not None:  # it ended in this step
                ks = ended["kvstore"]
                merged = {k: ks["loaded_from"].get(k, 0) + v for k, v in tiers.items()}
                ks.update(loaded_from=merged, loaded_tokens=sum(merged.values()))
        for rid in report.failed:
            if (tracked := self._tracked.get(rid)) is not None:
                tracked.load_failed = True
            elif (ended := self._ended.get(rid)) is not None:
                ended["kvstore"]["load_failed"] = True
            log.warning("kvstore: the load of request %s failed; vLLM recomputes it", rid)
        if self.book is not None:
            for rid in (*report.loaded, *report.failed):
                self.book.release(rid)  # its load is done: what it matched may go
            for rid, durable in report.stored.items():
                self.book.stored(rid, durable)
        for rid, outcome in report.produced.items():  # a producer's prompt: durable or not
            if (tracked := self._tracked.get(rid)) is not None:
                tracked.produced = outcome
            elif (ended := self._ended.get(rid)) is not None and "produced" in ended["kvstore"]:
                self.exchange.outcome(ended, outcome)

    def finished(self, request, block_ids) -> tuple[bool, dict | None]:
        """The request ended (``block_ids``: its block ids per group). If KV computed in its
        last steps was not planned for saving yet (its tail, the last partial block; async
        scheduling learns sampled ids a step late; a save deferred in the step that loaded
        from the remote tier), plan a final save and keep its blocks until the worker has
        copied them (returns True: vLLM frees them when the worker reports the request). A
        hybrid request saved its boundary at its prompt's end: nothing follows."""
        rid = request.request_id
        self._lookups.pop(rid, None)
        if self.book is not None:
            self.book.release(rid)
        tracked = self._tracked.pop(rid, None)
        if tracked is None:
            self.exchange.forget(rid)
            return False, None
        tiers = tracked.loaded or {}
        params = {"kvstore": {"loaded_tokens": sum(tiers.values()), "loaded_from": dict(tiers),
                              "load_failed": tracked.load_failed}}
        params["kvstore"].update(self.exchange.consumer_report(
            rid, start=tracked.load_start, loaded=sum(tiers.values()),
            failed=tracked.load_failed))
        if tracked.produced is not None:  # its prompt's end was planned: offered to consumers
            self.exchange.produced(params, request, tracked.namespace, tracked.produced)
        if self.lossy_ok:  # how much of what was loaded is not the KV vLLM computes
            params["kvstore"]["lossy_tokens"] = tracked.lossy_tokens if tiers else 0
        if self.groups is not None and tracked.retain is not None:
            params["kvstore"]["pin"] = tracked.pin or pin_outcome(0, "not applied: " + (
                "the connector's store could not be opened" if self.store is None else
                "the connector does not save (save=False)" if not self.save else
                "the request ended before its prompt's end (no boundary)"))
        self._ended[rid] = params
        upto = min(request.num_computed_tokens, len(request.all_token_ids))
        if self.save and self.store is not None and upto > 0 and self.groups is None \
                and (upto > tracked.saved or tracked.deferred or tracked.retain is not None):
            self._final.append(self._save(rid, tracked, upto, block_ids, final=True))
            self._held.add(rid)
            return True, params
        return False, params

    def sent(self, req_ids) -> None:
        """The worker copied these requests' final saves (vLLM frees their blocks)."""
        self._held.difference_update(req_ids)

    def pending(self) -> bool:
        """Whether final saves are planned or being copied (their requests' blocks held)."""
        return bool(self._final or self._held)

    def close(self) -> None:
        """At shutdown: replaced boundaries waiting for their grace go now (:mod:`.boundaries`).
        """
        if self.book is not None:
            self.book.close()

    def _prompt_end(self, plan: StepPlan, rid: str, tracked: _Tracked, done: int) -> None:
        """A hybrid prompt's end is computed in this step: save its boundary (its state exists
        after this step's forward only) unless the store holds it; a retention hint pins it
        (on the worker once saved, or here at once if stored already)."""
        if self._new_boundary(tracked, done):
            plan.saves.append(self._save(rid, tracked, done, self._block_ids_of(rid),
                                         boundary=True, produce=tracked.produce))
            if tracked.retain is not None:
                tracked.pin = pin_outcome(done, "pinned once its boundary is durable")
        elif tracked.retain is not None:
            outcome = retention.apply(self.store, tracked.request.all_token_ids[:done],
                                      tracked.namespace, tracked.retain)
            tracked.pin = pin_outcome(done, outcome)

    def _new_boundary(self, tracked: _Tracked, upto: int) -> bool:
        """Whether the store does not hold the boundary after ``upto`` tokens yet."""
        try:
            return self.store.match(tracked.request.all_token_ids[:upto],
                                    namespace=tracked.namespace) < upto
        except (KVStoreError, OSError):
            return True


def pin_outcome(tokens: int, outcome: str) -> dict:
    """What ``kv_transfer_params["kvstore"]["pin"]`` says of a hybrid request's retention
    hint: the boundary it pins (``tokens``, its prompt's end; 0: none) and ``outcome``
    (``"pinned"``, ``"pinned once its boundary is durable"``, ``"refused: ..."`` or ``"not
    applied: ..."``)."""
    return {"tokens": tokens, "outcome": outcome}
