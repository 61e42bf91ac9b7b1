"""The tiers below this machine's DRAM and disk that stores on other machines share (a Redis
server or cluster, an S3-compatible object store: both through
:mod:`kvstore.pipelines.shared.link`), as one protocol the store iterates.

A store has none, or one of each kind, tried in the order they were attached. What the store
asks of such a tier is :class:`SharedTier`: how far it extends the local prefix of a context
(``match``), the KV of a context it extends (``get``, ``layer_load``: fetched, verified, and
filled into the local tiers in the background), what a put stored (``after_put``: written
through in the background), what a delete removed (``delete``), prefetching for the
scheduler's queue, and its lifecycle; for a hybrid layout, the boundary states other machines
stored (``find_boundary``, ``state``, ``delete_boundary``:
:mod:`kvstore.pipelines.shared.boundaries`). A new kind of shared tier is one module
implementing it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from kvstore.eviction.jobs import Job
from kvstore.pipelines.layer_load import LayerLoad
from kvstore.pipelines.pages import Pages
from kvstore.view.prefix_tree import Piece


class SharedTier(Protocol):
    """What the store asks of a shared tier. Thread-safety: every method may be called from
    any thread; a failure of the tier is a miss or a shorter match, never an error."""

    name: str  # its section in ``stats()``
    prefill_rate: float | None  # tokens/s the caller recomputes at (a fetch must beat it)

    def match(self, toks: np.ndarray, namespace: str | None, pieces: list[Piece], *,
              exact: bool = False) -> int:
        """Leading tokens of ``toks`` the local ``pieces`` and this tier serve together."""

    def lossy_tokens(self, toks: np.ndarray, namespace: str | None,
                     pieces: list[Piece]) -> int:
        """Tokens after the local prefix that lossy values served recently (no IO)."""

    def find_boundary(self, toks: np.ndarray, namespace: str | None, local: int,
                      pieces: list[Piece]) -> int:
        """A hybrid layout: the longest boundary of ``toks`` this tier serves (with the local
        ``pieces``) beyond the local one after ``local`` tokens, if fetching it pays; else
        ``local``."""

    def state(self, toks: np.ndarray, namespace: str | None) -> bytes:
        """The state of the boundary after exactly ``toks`` from this tier; KeyError."""

    def delete_boundary(self, toks: np.ndarray, namespace: str | None) -> int:
        """Delete the boundary after exactly ``toks`` (its own chunks and its mark) from this
        tier; how many values went (failures counted, never raised)."""

    def get(self, toks: np.ndarray, namespace: str | None,
            out: tuple[torch.Tensor, torch.Tensor] | None,
            device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV of every token of ``toks`` (local prefix, then this tier); KeyError."""

    def layer_load(self, toks: np.ndarray, namespace: str | None, *, start: int,
                   buffer_layers: int | None, out: tuple[torch.Tensor, torch.Tensor] | None,
                   device: torch.device, hbm: Callable, pages: Pages | None) -> LayerLoad:
        """A layer-wise load of ``toks`` [start, T) (local prefix, then this tier)."""

    def block_end(self, toks: np.ndarray, namespace: str | None, end: int) -> np.ndarray:
        """``toks`` continued to ``end`` as the chunk this tier holds with their last token
        goes on (a load into pages fills its last block whole); KeyError."""

    def after_put(self, toks: np.ndarray, namespace: str | None) -> None:
        """A context was stored locally: write it through (in the background)."""

    def prefetch(self, jobs: list[Job]) -> None:
        """Fetch the KV of these queued jobs (in the background)."""

    def delete(self, chunks: list[tuple[bytes, bytes, np.ndarray]]) -> int:
        """Delete the values of these chunks, (key, parent key, token ids), now; returns how
        many it deleted (failures are counted, never raised)."""

    def flush(self, timeout: float | None = None) -> bool:
        """Until what was queued for write-through so far is sent; False on timeout."""

    def wait_filled(self, timeout: float | None = None) -> bool:
        """Until fetched contexts queued to be stored locally are stored."""

    def wait_prefetched(self, timeout: float | None = None) -> bool:
        """Until queued prefetches (and the local fills they cause) are done."""

    def put_doc(self, name: str, data: bytes) -> bool:
        """Store a small document (not KV: a conversation's state, say) under ``name``, where
        stores on other machines find it; False if this tier keeps none or did not answer."""

    def get_doc(self, name: str) -> bytes | None:
        """The document stored under ``name`` by any store (untrusted bytes), or None."""

    def close(self, *, abandon: bool = False) -> None:
        """Send what is queued (unless ``abandon``), stop, close connections."""

    def stats(self) -> dict[str, object]: ...


class SharedTiers:
    """The shared tiers of one store, in order. Empty: every call is the local answer.
    Thread-safety: :meth:`attach` only while the store opens; the rest from any thread."""

    def __init__(self) -> None:
        self._tiers: list[SharedTier] = []

    def attach(self, tier: SharedTier) -> None:
        self._tiers.append(tier)

    def __bool__(self) -> bool:
        return bool(self._tiers)

    def set_prefill_rate(self, tokens_per_s: float | None) -> None:
        for t in self._tiers:
            t.prefill_rate = tokens_per_s

    def match(self, toks: np.ndarray, namespace: str | None, pieces: list[Piece], local: int,
              *, exact: bool) -> int:
        """The longest prefix of ``toks`` one tier serves with the local ``pieces`` (at least
        the ``local`` tokens they serve)."""
        best = local
        for t in self._tiers:
            if best == len(toks):
                break
            best = max(best, t.match(toks, namespace, pieces, exact=exact))
        return best

    def find_boundary(self, toks: np.ndarray, namespace: str | None, pieces: list[Piece],
                      local: int) -> int:
        """The longest boundary of ``toks`` one tier serves (at least ``local``, the local
        one's)."""
        best = local
        for t in self._tiers:
            if best == len(toks):
                break
            best = max(best, t.find_boundary(toks, namespace, best, pieces))
        return best

    def state(self, toks: np.ndarray, namespace: str | None) -> bytes:
        return self._first(lambda t: t.state(toks, namespace))

    def delete_boundary(self, toks: np.ndarray, namespace: str | None) -> int:
        return sum(t.delete_boundary(toks, namespace) for t in self._tiers)

    def lossy_tokens(self, toks: np.ndarray, namespace: str | None,
                     pieces: list[Piece]) -> int:
        return max((t.lossy_tokens(toks, namespace, pieces) for t in self._tiers), default=0)

    def _first(self, call: Callable[[SharedTier], object]):
        """``call`` on each tier in order until one serves (KeyError: the next one)."""
        miss: KeyError | None = None
        for t in self._tiers:
            try:
                return call(t)
            except KeyError as e:
                miss = e
        raise miss if miss is not None else KeyError("no shared tier")

    def get(self, toks: np.ndarray, namespace: str | None,
            out: tuple[torch.Tensor, torch.Tensor] | None,
            device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._first(lambda t: t.get(toks, namespace, out, device))

    def layer_load(self, toks: np.ndarray, namespace: str | None, **kw) -> LayerLoad:
        return self._first(lambda t: t.layer_load(toks, namespace, **kw))

    def block_end(self, toks: np.ndarray, namespace: str | None, end: int) -> np.ndarray:
        return self._first(lambda t: t.block_end(toks, namespace, end))

    def after_put(self, toks: np.ndarray, namespace: str | None) -> None:
        for t in self._tiers:
            t.after_put(toks, namespace)

    def prefetch(self, jobs: list[Job]) -> None:
        for t in self._tiers:
            t.prefetch(jobs)

    def delete(self, chunks: list[tuple[bytes, bytes, np.ndarray]]) -> int:
        """Delete these chunks' values from every tier; how many values went, in all."""
        return sum(t.delete(chunks) for t in self._tiers)

    def flush(self) -> None:
        """Until every tier sent what write-through queued and stored what it fetched."""
        for t in self._tiers:
            t.flush()
            t.wait_filled()

    def wait_prefetched(self, timeout: float | None = None) -> bool:
        return all([t.wait_prefetched(timeout) for t in self._tiers])

    def close(self, *, abandon: bool = False) -> None:
        """Close every tier (each one even if another's close raised; the first error is
        raised after)."""
        error: BaseException | None = None
        for t in self._tiers:
            try:
                t.close(abandon=abandon)
            except BaseException as e:  # every tier is closed, whatever one raised
                error = error or e
        if error is not None:
            raise error

    def stats(self) -> dict[str, dict[str, object]]:
        return {t.name: t.stats() for t in self._tiers}

    def of_kind(self, name: str) -> SharedTier | None:
        return next((t for t in self._tiers if t.name == name), None)
