"""vLLM's offline ``LLM`` with its engine in this process: run what a server's loop runs.

``vllm serve`` (and any engine core in its own process) keeps stepping while its scheduler
holds requests, so the connector's final saves (a request's tail, copied out of its blocks
in the step after it ended) reach the store at once. An offline ``LLM`` whose engine runs in
the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) steps only inside ``generate``:
the tail of its last request then waits for the next ``generate``, whose own lookup comes
first. :func:`flush` runs those steps and waits until the store has written them.
"""

from __future__ import annotations

from kvstore.integrations.vllm.worker import STORE_ERRORS

# Steps that hand over every final save: one suffices (the worker copies each ended
# request's blocks in the step after it ended); more means the engine holds something else.
_MAX_STEPS = 64


def _engine_core(llm):
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise ValueError("flush(llm) drives an engine in this process; this LLM's engine core "
                         "runs in its own process, which steps on its own "
                         "(VLLM_ENABLE_V1_MULTIPROCESSING=1)")
    return core


def flush(llm, *, remote: bool = False) -> BaseException | None:
    """Run ``llm``'s engine until its scheduler holds no request (the final saves of the
    requests that ended are handed to the store), then wait until the store has written
    every save (durable, visible to other processes; with ``remote=True`` also sent to the
    remote tier: ``Store.flush(remote=True)``). Returns the first error a save met
    since the last flush, or None: as in a server, a failed save is a future miss that the
    connector has logged and counted (``save_failures``), never an error of the engine.
    ValueError for an engine in another process; RuntimeError if the engine still holds
    requests after many steps (a request in flight: call it between ``generate`` calls).
    Not thread-safe (like ``LLM``)."""
    core = _engine_core(llm)
    for _ in range(_MAX_STEPS):
        if not core.scheduler.has_requests():
            break
        llm.llm_engine.step()
    else:
        raise RuntimeError(f"the engine still holds requests after {_MAX_STEPS} steps")
    conn = core.scheduler.get_kv_connector()
    store = getattr(conn, "store", None)
    if store is None:
        return None
    try:
        store.flush(remote=remote)
    except STORE_ERRORS as e:
        return e
    return None
