"""Hybrid models in llama.cpp's prompt cache: a context is restorable only at a boundary whose
state the store holds, and never truncated.

A model with sliding-window or recurrent layers keeps, besides the KV of its full-attention
layers, state that exists only at the position where it was taken (:mod:`.partial`). So:

* **Restore** only a stored boundary (``Store.match`` answers nothing else): the store's
  full-attention KV of its tokens goes into a sequence state the codec writes, the boundary's
  partial section (checked against this model's shape) after it, and llama.cpp loads both.
* **Never truncate.** llama-cpp-python reuses the common prefix of what its context holds by
  removing the rest (``kv_cache_seq_rm``): a recurrent memory refuses (and the prompt is then
  computed from the start), a sliding-window one accepts and answers wrong, its window gone.
  The cache leaves the context either holding a prefix of the prompt exactly (nothing to
  remove) or empty.
* **Where boundaries are taken** (docs/llama_cpp.md): when a completion ends (what the context
  holds then), and on a lookup, before llama-cpp-python evaluates the prompt, at the points
  where a next request can start: the prompt's end (but the last tokens llama-cpp-python
  evaluates itself), which the conversation's next turn extends whatever its answer
  re-tokenizes to; and where the prompt leaves the longest stored prefix of another context
  (a shared system prompt), there and at the chunk boundary before it, so the next
  conversation that shares it, even less of it, starts from a stored state. The cache
  evaluates up to each such point itself (llama-cpp-python would have evaluated those tokens
  anyway) and saves its state in the background.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.integrations.llama_cpp import context
from kvstore.integrations.llama_cpp.identity import Identity
from kvstore.integrations.llama_cpp.partial import read_seq
from kvstore.integrations.llama_cpp.state import StateError, StateKV
from kvstore.store.facade import Store


def read_boundary(llm: Any, ident: Identity) -> tuple[StateKV, bytes]:
    """The context's full-attention KV and partial section, as they are now (at its
    ``n_tokens``): StateError if llama.cpp wrote something the codec does not expect.
    Thread-safety: as any call on ``llm``."""
    assert ident.partial is not None
    n = int(llm.n_tokens)
    data = read_seq(llm.ctx, 0)
    kv, end = ident.format.parse_seq_head(np.frombuffer(data, dtype=np.uint8))
    if kv.num_tokens != n:
        raise StateError(f"the sequence state holds {kv.num_tokens} cells, the context "
                         f"{n} tokens")
    part = data[end:]
    ident.partial.check(part, n)
    return kv, part


def restore(llm: Any, store: Store, ident: Identity, toks: np.ndarray, *,
            namespace: str | None = None) -> bool:
    """Load the stored boundary of exactly ``toks`` (in ``namespace``) into the context: its
    full-attention KV and its partial section. False if llama.cpp refused the state (the
    context is then empty). Raises what the store raises (KeyError: gone meanwhile) and
    StateError (a stored partial section this model would not write)."""
    assert ident.partial is not None
    n = len(toks)
    part = store.state(toks, namespace=namespace)
    ident.partial.check(part, n)
    state = ident.format.seq_buffer(n, seq_id=context.SEQ_ID, partial=part)
    store.get(toks, namespace=namespace, out=(state.keys, state.values))
    return context.restore(llm, state, toks)


def save_async(llm: Any, store: Store, ident: Identity, toks: np.ndarray, *,
               namespace: str | None = None) -> None:
    """Queue the context's boundary (it holds exactly ``toks``) for the store's writer thread,
    in ``namespace``: skipped (no error) when the write buffer is full. Raises StateError and
    store errors."""
    kv, part = read_boundary(llm, ident)
    with store.begin_save(toks, namespace=namespace, state=True, wait=False) as save:
        save.layers(kv.keys, kv.values)
        save.finish(state=part)


def checkpoints(*, start: int, stored_run: int, limit: int, chunk: int) -> list[int]:
    """Where a lookup takes boundaries, ascending and after ``start`` (what the context holds
    once restored): where the prompt leaves the longest stored prefix (``stored_run``) and the
    chunk boundary before it, and ``limit`` (the prompt but what llama-cpp-python evaluates
    itself)."""
    points = {stored_run, stored_run // chunk * chunk, limit}
    return sorted(p for p in points if start < p <= limit)
