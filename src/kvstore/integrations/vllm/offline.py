"""vLLM's offline ``LLM`` with its engine in this process: run what a server's loop runs.

``vllm serve`` (and any engine core in its own process) keeps stepping while its scheduler
holds requests, so the connector's final saves (a request's tail, copied out of its blocks
in the step after it ended) reach the store at once. An offline ``LLM`` whose engine runs in
the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) steps only inside ``generate``:
the tail of its last request then waits for the next ``generate``, whose own lookup comes
first. :func:`flush` runs those steps and waits until the store has written them.

Through vLLM's public surface only: ``LLM.llm_engine`` (its ``vllm_config``, ``step()`` and
``has_unfinished_requests()``); the engine's connector is found by its ``KVTransferConfig``'s
``engine_id`` among the connectors started in this process, and says itself whether final
saves are still to be handed over.
"""

from __future__ import annotations

from kvstore.integrations.vllm.connector import KVStoreConnector, scheduler_connector
from kvstore.integrations.vllm.worker import STORE_ERRORS

# Steps that hand over every final save: one suffices (the worker copies each ended
# request's blocks in the step after it ended); more means the engine holds something else.
_MAX_STEPS = 64


def connector_of(llm) -> KVStoreConnector | None:
    """The scheduler-role :class:`KVStoreConnector` of ``llm``'s engine, None if the engine
    has no KVStoreConnector. ValueError if it has one, but its engine core runs in another
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``): that process steps on its own."""
    transfer = llm.llm_engine.vllm_config.kv_transfer_config
    if transfer is None:
        return None
    conn = scheduler_connector(transfer.engine_id)
    if conn is None and transfer.kv_connector == KVStoreConnector.__name__:
        raise ValueError("flush(llm) drives an engine in this process; this LLM's engine core "
                         "runs in its own process, which steps on its own "
                         "(VLLM_ENABLE_V1_MULTIPROCESSING=1)")
    return conn


def connector_store(llm):
    """The :class:`kvstore.Store` ``llm``'s connector serves (None without a KVStoreConnector
    or when its store could not be opened); in one process both connector roles share it.
    ValueError as :func:`connector_of`."""
    conn = connector_of(llm)
    return None if conn is None else conn.store


def flush(llm, *, remote: bool = False) -> BaseException | None:
    """Run ``llm``'s engine until it holds no request and its connector has handed every final
    save of the requests that ended to the store, then wait until the store has written
    every save (durable, visible to other processes; with ``remote=True`` also sent to the
    remote tier: ``Store.flush(remote=True)``). Returns the first error a save met
    since the last flush, or None: as in a server, a failed save is a future miss that the
    connector has logged and counted (``save_failures``), never an error of the engine.
    ValueError for an engine in another process; RuntimeError if the engine still holds
    requests after many steps (a request in flight: call it between ``generate`` calls).
    Not thread-safe (like ``LLM``)."""
    conn = connector_of(llm)
    engine = llm.llm_engine
    for _ in range(_MAX_STEPS):
        if not engine.has_unfinished_requests() and (conn is None or not conn.pending_saves()):
            break
        engine.step()
    else:
        raise RuntimeError(f"the engine still holds requests after {_MAX_STEPS} steps")
    store = None if conn is None else conn.store
    if store is None:
        return None
    try:
        store.flush(remote=remote)
    except STORE_ERRORS as e:
        return e
    return None
