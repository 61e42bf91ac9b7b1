"""The scheduler side's account of a hybrid model's boundaries: which live request needs which
stored boundary, which boundaries several continuations share, and when a replaced one goes.

A hybrid request leaves one boundary, at its prompt's end, which replaces the boundary it was
loaded from, and any boundary this engine saved since along its prompt (a request sent before
the previous turn's save was durable loads an older boundary; the previous turn's own is then
replaced as well): a conversation keeps its latest state (a boundary costs the model's windows
and states whatever its prompt's length, :mod:`.scheduler`). Replacing is deleting, and this
module decides when a delete may happen:

* **held**: a boundary that a live request of this engine matched is not deleted, from the
  lookup that matched it until the worker reports its load done or failed (or the request
  ends);
* **shared**: a boundary that two continuations loaded is never deleted by a replacement:
  eviction decides when it goes, as for any context. Two continuations are two requests whose
  prompts go different ways after the boundary, or the same prompt sent again (two branches
  of one turn, every conversation after one system prompt, a regenerated answer); a prompt
  and a longer one that extends it (a later turn of the same conversation) are one. Counted
  per (namespace, boundary) in bounded memory (:data:`MAX_TRACKED` boundaries);
* **grace**: a replaced boundary waits ``grace_s`` seconds after its replacement is durable
  (the worker reports it), so that a branch sent after its sibling still finds it, and goes
  sooner when the waiting boundaries' state exceeds ``grace_bytes`` (oldest first). A pinned
  boundary is never deleted by a replacement.

Deletions run on the scheduler's thread, in each step's plan, and at shutdown (every waiting
boundary whose replacement is stored: a restart ends the grace). This engine's holds are its
own: another engine on the same directory may delete a boundary between a lookup here and its
load; the load then fails and vLLM recomputes the request (a miss, never wrong KV).

Saving and loading touch separate halves (:meth:`replacing` / :meth:`stored` on a save,
:meth:`hold` / :meth:`loaded` / :meth:`release` on a load): an engine that only loads, or only
saves, uses one half.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.errors import KVStoreError
from kvstore.store.facade import Store

log = logging.getLogger("vllm.kvstore")

MAX_TRACKED = 65536  # boundaries whose loaders (and shared marks) are remembered, LRU
RECENT_SAVES = 256  # this engine's latest boundary saves, which a longer prompt replaces
SUFFIX_TOKENS = 256  # of a loader's prompt after the boundary, what tells continuations apart


def boundary_id(namespace: str | None, tokens: Sequence[int]) -> bytes:
    """A 16-byte digest naming the boundary after ``tokens`` in ``namespace``."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"\x00" if namespace is None else b"\x01" + namespace.encode() + b"\x00")
    h.update(np.asarray(tokens, dtype=np.uint32).tobytes())
    return h.digest()


@dataclass(frozen=True, kw_only=True)
class _Loader:
    """One request that loaded a boundary: its prompt after the boundary, as far as it tells
    continuations apart."""

    req_id: str
    length: int  # tokens after the boundary
    head: tuple[int, ...]  # the first SUFFIX_TOKENS of them

    def same_line(self, other: _Loader) -> bool:
        """Whether one prompt extends the other (one conversation, not two continuations).
        Prompts of equal length are two continuations (the same prompt sent twice)."""
        if self.length == other.length:
            return False
        n = min(self.length, other.length, SUFFIX_TOKENS)
        return self.head[:n] == other.head[:n]


@dataclass(eq=False)
class Replaced:
    """A boundary that a request's new boundary replaces: deleted once the new one is durable
    (``since``: when it was reported so), unless it is held, shared or pinned."""

    namespace: str | None
    old: tuple[int, ...]  # the replaced boundary's tokens
    new: tuple[int, ...]  # the replacing boundary's tokens
    nbytes: int  # the replaced boundary's state bytes
    since: float | None = None

    @property
    def key(self) -> bytes:
        return boundary_id(self.namespace, self.old)


class BoundaryBook:
    """Holds, loaders, shared marks and replaced boundaries of one engine's scheduler.
    ``clock``: monotonic seconds. Thread-safety: none; vLLM calls the scheduler side from its
    scheduler thread only."""

    def __init__(self, store: Store, *, grace_s: float, grace_bytes: int,
                 state_size: Callable[[int], int], clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.store = store
        self._state_size = state_size  # bytes of a boundary's state after n tokens
        self.grace_s = grace_s
        self.grace_bytes = grace_bytes
        self._clock = clock
        self._holds: dict[str, bytes] = {}  # req_id -> the boundary it matched
        self._holders: dict[bytes, int] = {}  # boundary -> how many live requests hold it
        self._loaders: OrderedDict[bytes, tuple[_Loader, ...]] = OrderedDict()
        self._shared: OrderedDict[bytes, None] = OrderedDict()
        # req_id -> what its boundary save replaces once durable (the save in flight)
        self._saving: dict[str, list[Replaced]] = {}
        # this engine's latest boundary saves, not replaced yet: (namespace, tokens)
        self._recent: OrderedDict[bytes, tuple[str | None, tuple[int, ...]]] = OrderedDict()
        self._waiting: OrderedDict[bytes, Replaced] = OrderedDict()  # durable, oldest first
        self._waiting_bytes = 0
        self.deleted = 0  # replaced boundaries deleted (counters for logs and tests)
        self.kept_shared = 0  # ... kept because two continuations loaded them

    # ---- loads ---------------------------------------------------------------------------
    def hold(self, req_id: str, namespace: str | None, tokens: Sequence[int]) -> None:
        """``req_id`` matched the boundary after ``tokens``: it is not deleted until
        :meth:`release`. A request holds one boundary (a new match replaces its hold)."""
        self.release(req_id)
        key = boundary_id(namespace, tokens)
        self._holds[req_id] = key
        self._holders[key] = self._holders.get(key, 0) + 1

    def release(self, req_id: str) -> None:
        """``req_id`` no longer needs the boundary it held (its load is done or failed, or it
        ended). Nothing if it held none."""
        key = self._holds.pop(req_id, None)
        if key is None:
            return
        n = self._holders[key] - 1
        if n:
            self._holders[key] = n
        else:
            del self._holders[key]

    def loaded(self, req_id: str, namespace: str | None, boundary: Sequence[int],
               prompt: Sequence[int]) -> None:
        """``req_id`` (prompt ``prompt``) loaded the boundary after ``boundary``: a second
        continuation marks it shared (kept from replacement for good)."""
        key = boundary_id(namespace, boundary)
        if key in self._shared:
            self._shared.move_to_end(key)
            return
        after = prompt[len(boundary):]
        me = _Loader(req_id=req_id, length=len(after),
                     head=tuple(int(t) for t in after[:SUFFIX_TOKENS]))
        before = self._loaders.pop(key, ())
        if any(x.req_id == req_id for x in before):  # loaded again (after a preemption)
            self._loaders[key] = before
            return
        if any(not me.same_line(x) for x in before):
            self._mark_shared(key)
            return
        self._loaders[key] = (*before, me)[-2:]  # the last two lines tell a new one apart
        while len(self._loaders) > MAX_TRACKED:
            self._loaders.popitem(last=False)

    def _mark_shared(self, key: bytes) -> None:
        self._shared[key] = None
        while len(self._shared) > MAX_TRACKED:
            self._shared.popitem(last=False)
        waiting = self._waiting.pop(key, None)
        if waiting is not None:
            self._waiting_bytes -= waiting.nbytes
            self.kept_shared += 1

    def shared(self, namespace: str | None, tokens: Sequence[int]) -> bool:
        """Whether two continuations loaded the boundary after ``tokens``."""
        return boundary_id(namespace, tokens) in self._shared

    def held(self, namespace: str | None, tokens: Sequence[int]) -> bool:
        """Whether a live request holds the boundary after ``tokens``."""
        return boundary_id(namespace, tokens) in self._holders

    # ---- saves ---------------------------------------------------------------------------
    def replacing(self, req_id: str, namespace: str | None, old: Sequence[int],
                  new: Sequence[int]) -> None:
        """``req_id``'s boundary save (after ``new``) replaces, once it is durable
        (:meth:`stored`), the boundary after ``old`` (the one it was loaded from; empty: none)
        and every boundary this engine saved since whose tokens ``new`` extends."""
        new = tuple(new)
        olds = [tuple(old)] if len(old) else []
        for key, (ns, toks) in list(self._recent.items()):
            if ns == namespace and len(old) < len(toks) < len(new) \
                    and new[:len(toks)] == toks:
                olds.append(toks)
                del self._recent[key]
        self._recent[boundary_id(namespace, new)] = (namespace, new)
        while len(self._recent) > RECENT_SAVES:
            self._recent.popitem(last=False)
        if olds:
            self._saving[req_id] = [Replaced(namespace=namespace, old=o, new=new,
                                             nbytes=self._state_size(len(o))) for o in olds]

    def stored(self, req_id: str, durable: bool) -> None:
        """The worker's report of ``req_id``'s boundary save: durable (what it replaces starts
        its grace), or refused or failed (what it replaces stays: still the latest)."""
        replaced = self._saving.pop(req_id, ())
        if durable:
            for r in replaced:
                self._wait(r, self._clock())

    def _wait(self, r: Replaced, now: float) -> None:
        key = r.key
        if key in self._shared or key in self._waiting:
            if key in self._shared:
                self.kept_shared += 1
            return
        r.since = now
        self._waiting[key] = r
        self._waiting_bytes += r.nbytes

    @property
    def waiting(self) -> tuple[Replaced, ...]:
        """The replaced boundaries in their grace, oldest first."""
        return tuple(self._waiting.values())

    def due(self) -> list[Replaced]:
        """The replaced boundaries to delete now (taken off the book): past their grace, or
        the oldest while the waiting ones' state exceeds ``grace_bytes``; a held one waits
        on (it is needed), a shared one is kept."""
        now = self._clock()
        out = []
        for key, r in list(self._waiting.items()):
            over = self._waiting_bytes > self.grace_bytes
            if not over and now - r.since < self.grace_s:
                break  # oldest first: the rest are younger
            if key in self._holders:
                continue
            del self._waiting[key]
            self._waiting_bytes -= r.nbytes
            out.append(r)
        return out

    def collect(self) -> int:
        """Delete the replaced boundaries that are due (not pinned); returns how many."""
        return self._delete(self.due())

    def close(self) -> int:
        """At shutdown: every replaced boundary whose replacement is stored goes now (a
        restart ends the grace; held, shared and pinned ones stay). Returns how many."""
        now = self._clock()
        for rid, replaced in list(self._saving.items()):
            new, ns = replaced[0].new, replaced[0].namespace
            try:
                stored = self.store.match(list(new), namespace=ns) == len(new)
            except (KVStoreError, OSError):
                stored = False
            if stored:
                del self._saving[rid]
                for r in replaced:
                    self._wait(r, now)
        out = [r for k, r in self._waiting.items() if k not in self._holders]
        self._waiting.clear()
        self._waiting_bytes = 0
        n = self._delete(out)
        log.info("kvstore: %d replaced boundaries deleted, %d kept as two continuations "
                 "loaded them", self.deleted, self.kept_shared)
        return n

    def _delete(self, victims: list[Replaced]) -> int:
        if not victims:
            return 0
        try:
            pinned = self._pinned()
        except (KVStoreError, OSError) as e:  # none deleted now: they wait for the next step
            log.info("kvstore: the pins could not be read (no replaced boundary deleted "
                     "now): %s: %s", type(e).__name__, e)
            for r in victims:
                self._waiting[r.key] = r
                self._waiting_bytes += r.nbytes
            return 0
        n = 0
        for r in victims:
            if r.old in pinned.get(r.namespace, ()):
                continue
            try:
                self.store.delete(list(r.old), namespace=r.namespace)
            except (KVStoreError, OSError) as e:
                log.info("kvstore: a replaced boundary of %d tokens stays: %s: %s",
                         len(r.old), type(e).__name__, e)
                continue
            n += 1
        self.deleted += n
        return n

    def _pinned(self) -> dict[str | None, set[tuple[int, ...]]]:
        """The boundaries a live pin holds, by namespace (every process's pins)."""
        out: dict[str | None, set[tuple[int, ...]]] = {}
        for p in self.store.pins():
            try:
                toks = self.store.context_tokens(p.key)
            except KeyError:  # its context left since
                continue
            if len(toks) < p.n_tokens:  # a boundary: its state's rows follow its tokens
                out.setdefault(p.namespace, set()).add(tuple(int(t) for t in toks))
        return out
