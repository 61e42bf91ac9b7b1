"""The scheduler side's account of ``kv_role`` (:mod:`.roles`): which requests a producer
answers for, which a consumer waits for, and what each response's ``kv_transfer_params`` say.

* **Producer**: a request it produces (:meth:`ExchangeBook.produces`) is saved whole in the
  step that computes its prompt's last token and that step's ``wait_for_save`` returns once
  the KV is durable where the consumer looks (:mod:`.worker`). Its response carries
  ``do_remote_prefill: true``, the prompt's token ids and ``kvstore.produced``
  (:func:`~.roles.produced_record`); a save the worker reports not durable takes
  ``produced`` back out (``kvstore.produce_failed`` says why, ``do_remote_prefill`` is false:
  a consumer then finds what its store holds by its own lookup).
* **Consumer** (or ``kv_both`` given a producer's answer): the ``produced`` record is checked
  (:func:`~.roles.check_produced`; a mismatch is logged, reported, and the request served as
  any other); then :meth:`ExchangeBook.awaiting` gives the request's
  :class:`~.roles.RemotePrefill`, which the scheduler probes on its own steps until the store
  serves the producer's tokens or the deadline (counted from the request's arrival) passes.
  The response's ``kvstore`` then says ``loaded_bytes``, ``waited_s`` and ``remote_prefill``.

Thread-safety: none; vLLM calls the scheduler side from its scheduler thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvstore.integrations.vllm import compat, roles
from kvstore.integrations.vllm.groups import Groups
from kvstore.integrations.vllm.roles import Exchange, Mismatch, RemotePrefill
from kvstore.store.facade import Store

log = logging.getLogger("vllm.kvstore")


class ExchangeBook:
    """Producers' and consumers' requests of one engine's scheduler side."""

    def __init__(self, exchange: Exchange, store: Store | None, *, block_size: int,
                 groups: Groups | None, clock: Callable[[], float]) -> None:
        self.exchange = exchange
        self.role = exchange.role
        self.store = store
        self.block_size = block_size
        self.groups = groups  # a hybrid model's (its boundary state's bytes), else None
        self._clock = clock
        self._arrivals: dict[str, float] = {}  # req_id -> when vLLM added it (monotonic)
        self._waits: dict[str, RemotePrefill] = {}
        # a hybrid producer's requests, shortened by their last token: their whole prompts
        self._prompts: dict[str, list[int]] = {}

    # ---- consumer -------------------------------------------------------------------------
    def arrived(self, request) -> None:
        """vLLM added ``request``: a remote prefill's wait counts from now; a hybrid model's
        request to produce computes its prompt but the last token (the boundary a consumer
        loads, which then computes that token: a recurrent state holds no earlier
        position), as vLLM's own disaggregated connectors do."""
        if self.role.awaits(getattr(request, "kv_transfer_params", None)):
            self._arrivals[request.request_id] = self._clock()
        elif self.groups is not None and self.produces(request):
            prompt = list(request.prompt_token_ids or ())
            if compat.drop_last_prompt_token(request):
                self._prompts[request.request_id] = prompt

    def awaiting(self, request, namespace: str | None) -> RemotePrefill | None:
        """The remote prefill of ``request`` (None: it is not one). On first sight its
        ``kvstore.produced`` is checked: a mismatch is logged and needs no wait."""
        rid = request.request_id
        wait = self._waits.get(rid)
        if wait is not None or self.store is None:
            return wait
        params = getattr(request, "kv_transfer_params", None)
        if not self.role.awaits(params):
            return None
        now = self._clock()
        arrived = self._arrivals.pop(rid, now)
        deadline_s, why = roles.deadline_of(params, self.exchange.deadline_s)
        if why is not None:
            log.warning("kvstore: request %s: %s; waiting %.3g s", rid, why, deadline_s)
        prompt = request.prompt_token_ids
        try:
            n = roles.check_produced(params, layout=self.store.layout, namespace=namespace,
                                     prompt=prompt, chunk_tokens=self.store.config.chunk_tokens)
        except Mismatch as e:
            log.warning("kvstore: request %s: the producer's kv_transfer_params are not "
                        "used (the store's own lookup serves it): %s", rid, e)
            wait = RemotePrefill(target=0, arrived=now, deadline=now, status=roles.MISMATCH,
                                 done=True)
        else:
            wait = RemotePrefill(target=min(n, len(prompt) - 1), arrived=arrived,
                                 deadline=arrived + deadline_s, next_probe=now)
        self._waits[rid] = wait
        return wait

    def remote_load(self, rid: str) -> bool:
        """Whether ``rid``'s load is a remote prefill's (whole and asynchronous for vLLM)."""
        wait = self._waits.get(rid)
        return wait is not None and wait.status is None

    def consumer_report(self, rid: str, *, start: int, loaded: int, failed: bool
                        ) -> dict[str, object]:
        """What a remote prefill's response says (``start``: the load's first token,
        ``loaded``: the tokens it filled); {} if ``rid`` was none. Forgets ``rid``."""
        self._arrivals.pop(rid, None)
        wait = self._waits.pop(rid, None)
        if wait is None or self.store is None:
            return {}
        state = self.groups.state_size(start + loaded) if self.groups and loaded else 0
        nbytes = 0 if failed else roles.loaded_bytes(self.store.layout, start, loaded,
                                                     self.block_size, state)
        return {"loaded_bytes": nbytes, "waited_s": round(wait.waited_s, 4),
                "remote_prefill": wait.outcome(loaded, failed)}

    def forget(self, rid: str) -> None:
        """``rid`` ended without being served (aborted while it waited)."""
        self._arrivals.pop(rid, None)
        self._waits.pop(rid, None)
        self._prompts.pop(rid, None)

    # ---- producer -------------------------------------------------------------------------
    def produces(self, request) -> bool:
        """Whether ``request``'s prompt is to be produced for a consumer."""
        return self.store is not None and self.role.produces(
            getattr(request, "kv_transfer_params", None))

    def produced(self, params: dict, request, namespace: str | None,
                 outcome: dict | None) -> None:
        """Add to a produced request's ``params`` (its response's ``kv_transfer_params``)
        what the producer stored; ``outcome``: the worker's report of its durability ({}
        while it has not come: it follows in the same step, :meth:`outcome`). A hybrid's
        prompt is the whole one (its boundary is stored before the last token)."""
        stored = len(request.prompt_token_ids)
        prompt = self._prompts.pop(request.request_id, None) or list(request.prompt_token_ids)
        state = self.groups.state_size(stored) if self.groups is not None else 0
        params.update(do_remote_prefill=True, do_remote_decode=False, prompt_token_ids=prompt)
        params["kvstore"][roles.PRODUCED] = roles.produced_record(
            layout=self.store.layout, namespace=namespace, prompt=prompt,
            chunk_tokens=self.store.config.chunk_tokens, block_tokens=self.block_size,
            durable=self.exchange.durable, stored_tokens=stored, state_bytes=state,
            engine_id=self.exchange.engine_id)
        if outcome:
            self.outcome(params, outcome)

    @staticmethod
    def outcome(params: dict, outcome: dict) -> None:
        """The worker's report of a produced prompt (``{"error": ..., "wait_s": ...}``): a
        prompt that is not durable is not offered to a consumer."""
        ks = params["kvstore"]
        ks["produce_wait_s"] = outcome.get("wait_s")
        if outcome.get("error") is not None and ks.pop(roles.PRODUCED, None) is not None:
            ks["produce_failed"] = outcome["error"]
            params["do_remote_prefill"] = False
