"""Asynchronous saving (AttentionStore §3.2.2): KV leaves the compute path layer by layer.

During prefill, as soon as layer l's KV exists, :meth:`SaveHandle.layer` copies the new tokens'
part of it into a host write buffer (from GPU memory with a non-blocking copy); decode-step KV is
batched (:meth:`SaveHandle.append`). :meth:`SaveHandle.finish` hands the context to a writer
thread, which stores it with the store's ordinary crash-safe put (extents written and synced,
then one catalog commit), so nothing half-written ever becomes visible. The write buffer is
bounded (``write_buffer_bytes``): a new save waits for room only when the writer is that far
behind. :meth:`Saver.flush` is the durability point; an error in the writer reaches the save's
future and the next ``flush``.

What a finished save is worth before ``flush()``: it is queued in this process's memory. It is
written even if the program exits without closing the store: the writer thread is not a daemon
and runs only while saves are queued, so a normal interpreter exit waits for it. A process that
is killed (SIGKILL, power loss) loses the saves not yet written; each is stored whole or not at
all.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.errors import CapacityError, StoreClosed
from kvstore.format import boundary_state
from kvstore.format.chunk_extent import empty_kv, raw
from kvstore.format.hashing import as_tokens
from kvstore.layout import KVLayout
from kvstore.pipelines.pages import Pages
from kvstore.threads.background import OnDemandThread
from kvstore.threads.fork_join import Helpers, copy_all
from kvstore.tiers.output_pool import OutputPool


@dataclass(frozen=True, kw_only=True)
class _Job:
    tokens: np.ndarray
    namespace: str | None
    base: int
    keys: torch.Tensor  # [L, H, T - base, D] CPU
    values: torch.Tensor
    ready: torch.cuda.Event | None  # the copies out of the GPU have run
    from_gpu: list[tuple[torch.Tensor, torch.Tensor]]  # (write buffer part, pinned copy)
    hold: _Hold
    future: Future[bool]


class _Hold:
    """What one save holds until it is written or dropped: ``nbytes`` of write buffer and the
    stored chunks ``held`` (they must not be evicted under it). Released exactly once: by
    ``abort``, by the writer when the save is over, or by a finalizer when a handle is dropped
    without either (so a forgotten handle never blocks later saves)."""

    def __init__(self, saver: Saver, nbytes: int, held: list[bytes]) -> None:
        self._saver = saver
        self.nbytes = nbytes
        self.held = held
        self._lock = threading.Lock()
        self._released = False

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._saver._done(self.nbytes, self.held)


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 62


class SaveHandle:
    """One context being saved; from :meth:`kvstore.Store.begin_save`.

    Use as a context manager: it finishes on success and aborts on an exception. Thread-safety:
    one thread (the compute) calls a handle's methods.
    """

    def __init__(self, saver: Saver, layout: KVLayout, tokens: np.ndarray,
                 namespace: str | None, base: int, capacity: int, held: list[bytes],
                 nbytes: int, buffers: OutputPool | None = None,
                 state_chunk: int | None = None) -> None:
        self._saver = saver
        self._layout = layout
        self.tokens = tokens  # the prompt's ids; append() adds more
        self.namespace = namespace
        self.base = base  # tokens before this are stored already (held until the save ends)
        # A save that ends at a boundary carrying its state (kvstore.format.boundary_state):
        # the chunk size, and how many rows from base on were given (the rest of the
        # boundary's chunk is zeros).
        self._state_chunk = state_chunk
        self._given = 0
        self._extra: list[np.ndarray] = []
        self._n_extra = 0
        self._hold = hold = _Hold(saver, nbytes, held)
        # A handle dropped unfinished gives back what it holds (the finalizer holds no
        # reference to the handle, only to what it must release).
        self._finalizer = weakref.finalize(self, hold.release)
        self._state = "open"  # open -> finished | aborted
        try:
            if buffers is not None:  # [L, H, cap, D], recycled: no page faults per save
                self._k, self._v = buffers.kv(layout, capacity)
            else:  # numpy-allocated (huge pages: fast first touch)
                self._k, self._v = empty_kv(layout, capacity, 2)
        except BaseException:
            self.abort()
            raise
        self._layers = np.zeros(layout.num_layers, dtype=bool)
        # Copies out of the GPU: on a side stream (compute does not queue behind them) into
        # pinned host memory (asynchronous DMA); the writer places them in the write buffer
        # once the stream's event says they have run.
        self._stream: torch.cuda.Stream | None = None
        self._from_gpu: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) + self._n_extra

    def _check_open(self) -> None:
        if self._state != "open":
            raise ValueError(f"this save is already {self._state}")

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.device.type == "cuda":
            self._copy_from_gpu(dst, src)
        elif dst.device.type == "cpu" and src.dtype == dst.dtype:
            np.copyto(raw(dst), raw(src.detach().contiguous()))  # one thread, GIL released
        else:
            dst.copy_(src)

    def _copy_from_gpu(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue the copy of ``src`` (GPU) for ``dst`` (the write buffer): after the work
        queued so far on the caller's stream (which computed ``src``), on the save's stream,
        into a pinned block. ``src`` must not be written in place before the copy has run
        (the allocator keeps its memory until then)."""
        dev = src.device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=dev)
        self._stream.wait_stream(torch.cuda.current_stream(dev))
        pinned = torch.empty(dst.shape, dtype=dst.dtype, pin_memory=True)  # contiguous
        with torch.cuda.stream(self._stream):
            pinned.copy_(src.to(dst.dtype).contiguous(), non_blocking=True)
        src.record_stream(self._stream)
        self._from_gpu.append((dst, pinned))

    def _check_kv(self, name: str, t: object) -> torch.Tensor:
        return self._layout.check_tensor(name, t)

    def layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Layer ``layer``'s KV of the prompt, [num_kv_heads, T_prompt, head_dim] each (keys
        pre-RoPE; the whole context or at least its tokens from ``base`` on, right-aligned)."""
        self._check_open()
        lay, T = self._layout, len(self.tokens)
        if isinstance(layer, bool) or not isinstance(layer, int) \
                or not 0 <= layer < lay.num_layers:
            raise ValueError(f"layer must be in [0, {lay.num_layers}), got {layer!r}")
        for name, t in (("keys", keys), ("values", values)):
            t = self._check_kv(name, t)
            if (t.dim() != 3 or t.shape[0] != lay.num_kv_heads or t.shape[2] != lay.head_dim
                    or t.shape[1] < T - self.base):
                raise ValueError(f"{name} must be [num_kv_heads={lay.num_kv_heads}, "
                                 f">= {T - self.base} tokens, head_dim={lay.head_dim}], got "
                                 f"{list(t.shape)}")
        if keys.shape != values.shape:
            raise ValueError(f"keys and values must have one shape, got {list(keys.shape)} and "
                             f"{list(values.shape)}")
        n = T - self.base
        self._copy(self._k[layer, :, :n], keys[:, keys.shape[1] - n :])  # [H, n, D]
        self._copy(self._v[layer, :, :n], values[:, values.shape[1] - n :])
        self._layers[layer] = True
        self._given = max(self._given, n)

    def layer_pages(self, layer: int, pages: Pages) -> None:
        """Layer ``layer``'s KV of the prompt's tokens from ``base`` on, copied straight from an
        engine's blocks: ``pages`` hold the prompt's last ``pages.num_tokens`` tokens (at least
        the T - base the save needs, right-aligned; ``base`` on a block boundary of them)."""
        self._check_open()
        lay, T = self._layout, len(self.tokens)
        if isinstance(layer, bool) or not isinstance(layer, int) \
                or not 0 <= layer < lay.num_layers:
            raise ValueError(f"layer must be in [0, {lay.num_layers}), got {layer!r}")
        if not isinstance(pages, Pages):
            raise TypeError(f"pages must be a kvstore Pages, got {type(pages).__name__}")
        pages.check_layer(lay, layer)
        if self._state_chunk is not None:  # the boundary's block whole, as the pages hold it
            T = -(-T // pages.block_tokens) * pages.block_tokens
        n = T - self.base
        skip = pages.num_tokens - n  # tokens of the pages before base
        if skip < 0 or skip % pages.block_tokens or self._k.device.type != "cpu":
            raise ValueError(f"pages of {pages.num_tokens} tokens in {pages.block_tokens}-token "
                             f"blocks cannot give the {n} tokens after base={self.base} of "
                             f"{T} (whole blocks, right-aligned, into a CPU save)")
        pages.gather(layer, skip // pages.block_tokens, raw(self._k[layer, :, :n]),
                     raw(self._v[layer, :, :n]))
        self._layers[layer] = True
        self._given = max(self._given, n)

    def layers(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Every layer's KV of the prompt at once, [num_layers, num_kv_heads, T_prompt,
        head_dim] each (keys pre-RoPE; at least the tokens from ``base`` on, right-aligned).
        Large CPU copies use both cores."""
        self._check_open()
        lay, T = self._layout, len(self.tokens)
        n = T - self.base
        for name, t in (("keys", keys), ("values", values)):
            t = self._check_kv(name, t)
            if (t.dim() != 4 or t.shape[0] != lay.num_layers or t.shape[1] != lay.num_kv_heads
                    or t.shape[3] != lay.head_dim or t.shape[2] < n):
                raise ValueError(f"{name} must be [num_layers={lay.num_layers}, num_kv_heads="
                                 f"{lay.num_kv_heads}, >= {n} tokens, head_dim={lay.head_dim}]"
                                 f", got {list(t.shape)}")
        ks, vs = keys[:, :, keys.shape[2] - n :], values[:, :, values.shape[2] - n :]
        if ks.device.type == "cpu" and self._k.device.type == "cpu":
            copy_all(self._saver.helpers, [(raw(self._k[:, :, :n]), raw(ks)),
                                           (raw(self._v[:, :, :n]), raw(vs))])
        else:
            self._copy(self._k[:, :, :n], ks)
            self._copy(self._v[:, :, :n], vs)
        self._layers[:] = True
        self._given = max(self._given, n)

    def append(self, tokens: object, keys: torch.Tensor, values: torch.Tensor) -> None:
        """KV of more tokens after the prompt (decode steps, batched): [L, H, t, D] each."""
        self._check_open()
        if self._state_chunk is not None:
            raise ValueError("a save with state=True ends at its tokens: nothing is appended")
        extra = as_tokens(tokens)
        t, at = len(extra), self.num_tokens - self.base
        want = (self._layout.num_layers, self._layout.num_kv_heads, t, self._layout.head_dim)
        keys, values = self._check_kv("keys", keys), self._check_kv("values", values)
        if tuple(keys.shape) != want or tuple(values.shape) != want:
            raise ValueError(f"keys/values must be {list(want)} for {t} tokens, got "
                             f"{list(keys.shape)} and {list(values.shape)}")
        if at + t > self._k.shape[2]:
            raise ValueError(f"append of {t} tokens exceeds max_new_tokens given to begin_save "
                             f"({self._k.shape[2] - (len(self.tokens) - self.base)})")
        self._copy(self._k[:, :, at : at + t], keys)
        self._copy(self._v[:, :, at : at + t], values)
        self._extra.append(extra)
        self._n_extra += t

    def finish(self, state: bytes | np.ndarray | None = None) -> Future[bool]:
        """Hand the context to the writer; the future completes when it is durable (True),
        or with False if the store's eviction policy refused it (admission: nothing stored).
        ``state``: the boundary state of a save begun with ``state=True`` (required there,
        refused elsewhere): the engine's bytes after exactly these tokens."""
        self._check_open()
        if (state is None) != (self._state_chunk is None):
            raise ValueError("finish(state=...) takes the state exactly of a save begun with "
                             "state=True")
        missing = np.flatnonzero(~self._layers)
        if len(missing):
            raise ValueError(f"layers {missing.tolist()} were never given to layer()")
        view = None if state is None else boundary_state.check_state(self._layout, state)
        try:
            if view is not None:
                toks = self._place_state(view)
            else:
                toks = np.concatenate([self.tokens, *self._extra]) if self._extra \
                    else self.tokens
            n = len(toks) - self.base
            ready = None if self._stream is None else self._stream.record_event()
            job = _Job(tokens=toks, namespace=self.namespace, base=self.base,
                       keys=self._k[:, :, :n], values=self._v[:, :, :n], ready=ready,
                       from_gpu=self._from_gpu, hold=self._hold, future=Future())
        except BaseException:
            self.abort()
            raise
        self._state = "finished"
        self._finalizer.detach()  # the job owns the hold now: the writer releases it
        self._saver._submit(job)
        return job.future

    def _place_state(self, view: memoryview) -> np.ndarray:
        """Write the state's rows after the boundary's chunk (zeros between what was given
        and there); returns the tokens of the context that carries it."""
        lay, c, base = self._layout, self._state_chunk, self.base
        assert c is not None
        rows = boundary_state.encode(lay, view)  # [L, 2, H, m, D] raw
        m = rows.shape[3]
        d = boundary_state.data_start(len(self.tokens), c) - base
        assert self._given <= d and d + m <= self._k.shape[2]
        for i, buf in enumerate((self._k, self._v)):
            r = raw(buf)  # [L, H, cap, D]
            r[:, :, self._given : d] = 0
            r[:, :, d : d + m] = rows[:, i]
        return boundary_state.state_tokens(self.tokens, c, m)

    def abort(self) -> None:
        """Drop the save; nothing of it is stored. Idempotent."""
        if self._state == "open":
            self._state = "aborted"
            self._finalizer()

    def __enter__(self) -> SaveHandle:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state == "open":
            self.finish()


class Saver:
    """The write buffer and the writer thread of one store.

    ``write(tokens, keys, values, namespace, base)`` stores one context (the store's put) and
    returns whether it was stored (False: the eviction policy's admission refused it);
    ``release(held)`` lets go of the chunks a save held. The writer thread runs while saves
    are queued and ends when the queue is empty. Thread-safety: all methods may be called from
    any thread.
    """

    def __init__(self, *, capacity_bytes: int,
                 write: Callable[[np.ndarray, torch.Tensor, torch.Tensor, str | None, int], bool],
                 release: Callable[[list[bytes]], None], helpers: Helpers | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.helpers = helpers  # for large copies into the write buffer
        self._write = write
        self._release = release
        self._cond = threading.Condition()
        self._used = 0  # bytes of write buffer held by open or queued saves
        self._error: BaseException | None = None  # the first since the last flush
        self._queue: collections.deque[_Job] = collections.deque()
        self._writing: _Job | None = None
        self._writer = OnDemandThread(self._cond, name="kvstore-saver", take=self._take,
                                      work=self._write_job)
        self._closed = False
        self.saved = 0
        self.failed = 0

    def reserve(self, nbytes: int, *, wait: bool = True) -> None:
        """Wait for ``nbytes`` of write buffer (a save bigger than the buffer waits until the
        buffer is empty); with ``wait=False``, :class:`CapacityError` at once if there is no
        room now. Refuses a save larger than this machine's memory."""
        if nbytes > physical_memory():
            raise CapacityError(f"a save of {nbytes} bytes does not fit this machine's memory "
                                f"({physical_memory()} bytes)")
        with self._cond:
            def room() -> bool:
                return self._closed or self._used == 0 \
                    or self._used + nbytes <= self.capacity_bytes
            if wait:
                self._cond.wait_for(room)
            elif not room():
                raise CapacityError(f"the write buffer is full ({self._used} of "
                                    f"{self.capacity_bytes} bytes held by saves not yet "
                                    f"written); a save of {nbytes} bytes would wait")
            if self._closed:
                raise StoreClosed("the store is closing")
            self._used += nbytes

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def pending(self) -> int:
        """Finished saves not yet written."""
        with self._cond:
            return len(self._queue) + (self._writing is not None)

    def _submit(self, job: _Job) -> None:
        with self._cond:
            closed = self._closed
            if not closed:
                self._queue.append(job)
                self._writer.start_if_idle()
        if closed:
            self._retire(job, StoreClosed("the store closed before this save"))
            raise StoreClosed("the store is closing")

    def _done(self, nbytes: int, held: list[bytes]) -> None:
        try:
            self._release(held)
        finally:  # the accounting happens even if releasing fails
            with self._cond:
                self._used -= nbytes
                self._cond.notify_all()

    def _take(self) -> _Job | None:
        """The next queued save (with the condition held), or None when none is queued."""
        if not self._queue:
            return None
        job = self._writing = self._queue.popleft()
        return job

    def _write_job(self, job: _Job) -> None:
        error = None
        stored = False
        try:
            if job.ready is not None:
                job.ready.synchronize()  # the copies out of the GPU have run
                for dst, pinned in job.from_gpu:
                    np.copyto(raw(dst), raw(pinned))
            stored = self._write(job.tokens, job.keys, job.values, job.namespace, job.base)
        except BaseException as e:  # handed to the future and the next flush()
            error = e
        self._retire(job, error, stored)

    def _retire(self, job: _Job, error: BaseException | None, stored: bool = False) -> None:
        """A queued save is over (written, failed or abandoned): release what it held, then
        complete its future."""
        try:
            job.hold.release()
        except BaseException as e:  # reported by flush(); the writer keeps going
            error = error or e
        with self._cond:
            if error is None:
                self.saved += 1
            else:
                self.failed += 1
                if not isinstance(error, StoreClosed) and self._error is None:
                    self._error = error  # later ones are in their futures (and counted)
            if self._writing is job:
                self._writing = None
            self._cond.notify_all()
        if error is None:
            job.future.set_result(stored)
        else:
            job.future.set_exception(error)

    def wait_for(self, tokens: np.ndarray, namespace: str | None) -> None:
        """Block until no finished-but-unwritten save shares a prefix with ``tokens`` (in
        ``namespace``); re-raise such a save's error."""
        with self._cond:
            jobs = [*self._queue, *([self._writing] if self._writing else [])]
            futs = [j.future for j in jobs
                    if j.namespace == namespace and len(j.tokens) and len(tokens)
                    and j.tokens[0] == tokens[0]]
        for f in futs:
            f.result()

    def flush(self) -> None:
        """Block until every finished save is durable; raise the first error since the last
        flush (the other failed saves' futures hold theirs)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._queue and self._writing is None)
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self, *, abandon: bool) -> None:
        """Finish (or with ``abandon``, drop) queued saves and wait for the writer. A save
        being written completes or fails whole."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            dropped = list(self._queue) if abandon else []
            if abandon:
                self._queue.clear()
        for job in dropped:
            self._retire(job, StoreClosed("the store closed before this save"))
        self._writer.join()
