"""A live ``llama_cpp.Llama`` as the cache meets it: which Llama is asking, what its context
holds already, and restoring a sequence state into it.

llama-cpp-python calls a cache as ``self.cache[prompt_tokens]`` and ``self.cache[tokens] =
self.save_state()`` from inside ``Llama._create_completion`` and hands it no reference to the
model, yet the cache must know the model (its GGUF, its llama.cpp build, its context settings)
to serve only KV that model would have computed, and needs its context to restore into.
:func:`.compat.calling_llama` finds that Llama as the ``self`` of the calling frame (or of one a few
frames up, past a subclass or wrapper of the cache), checked to be a ``llama_cpp.Llama``; a
call from anywhere else finds none (the cache then misses). That stack-frame walk is private
surface: it lives in :mod:`.compat`, with why nothing public replaces it.

A restore first empties the Llama's record of evaluated tokens with its public ``reset()``
(which also marks its logits stale, so the next completion decodes before it samples), writes
the KV through ``llama_state_seq_set_data`` into sequence 0 (the sequence llama-cpp-python
decodes into), then records the restored tokens in the Llama's public ``input_ids`` and
``n_tokens`` (the fields ``Llama.load_state`` sets beside those ``reset()`` sets), so
``Llama.generate`` continues after them: it evaluates the rest of the prompt as one batch. No
``scores`` array is copied.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvstore.integrations.llama_cpp.state import StateBuffer

SEQ_ID = 0  # llama-cpp-python's batches use sequence 0


def held_tokens(llm: Any, tokens: np.ndarray) -> int:
    """How many leading tokens of ``tokens`` ``llm``'s context holds KV for already.
    Thread-safety: as any call on ``llm``: from the thread running its completion."""
    n = min(int(llm.n_tokens), len(tokens))
    if n == 0:
        return 0
    ne = np.flatnonzero(np.asarray(llm.input_ids[:n], dtype=np.int64) != tokens[:n])
    return int(ne[0]) if len(ne) else n


def clear(llm: Any) -> None:
    """Empty ``llm``'s sequence 0 and its record of evaluated tokens, so llama-cpp-python
    evaluates the next prompt from its start. Thread-safety: as any call on ``llm``."""
    import llama_cpp

    mem = llama_cpp.llama_get_memory(llm.ctx)
    if mem is not None:
        llama_cpp.llama_memory_seq_rm(mem, SEQ_ID, -1, -1)
    llm.reset()  # no tokens evaluated, logits stale (a recurrent or hybrid memory: cleared)


def restore(llm: Any, state: StateBuffer, tokens: np.ndarray) -> bool:
    """Load the sequence state ``state`` (the KV of ``tokens``, positions 0..n-1) into
    ``llm``'s sequence 0 and record the tokens as evaluated. False if llama.cpp refused the
    state: its sequence 0 is then empty, and ``llm`` is left to evaluate the prompt from the
    start. Thread-safety: as any call on ``llm``: one thread at a time."""
    import llama_cpp

    n = len(tokens)
    # no tokens evaluated, logits stale: the next completion decodes before it samples
    # (sequence 0 is replaced whole below; a recurrent or hybrid memory is cleared first)
    llm.reset()
    data = state.data
    ptr = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    read = llama_cpp.llama_state_seq_set_data(llm.ctx, ptr, data.nbytes, SEQ_ID)
    if read != data.nbytes:
        # llama.cpp removed sequence 0's cells before reading and clears what it had
        # restored on failure; drop any left, so the context and n_tokens agree
        clear(llm)
        return False
    llm.input_ids[:n] = tokens
    llm.n_tokens = n  # reset() left the logits stale: they come from a decode before sampling
    return True
