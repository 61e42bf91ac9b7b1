"""Asynchronous saving (AttentionStore §3.2.2): KV leaves the compute path layer by layer.

During prefill, as soon as layer l's KV exists, :meth:`SaveHandle.layer` copies the new tokens'
part of it into a host write buffer (from GPU memory with a non-blocking copy); decode-step KV is
batched (:meth:`SaveHandle.append`). :meth:`SaveHandle.finish` hands the context to a writer
thread, which stores it with the store's ordinary crash-safe put (extents written and synced,
then one catalog commit), so nothing half-written ever becomes visible. The write buffer is
bounded (``write_buffer_bytes``): a new save waits for room only when the writer is that far
behind. :meth:`Saver.flush` is the durability point; an error in the writer reaches the save's
future and the next ``flush``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.errors import StoreClosed
from kvstore.layout import KVLayout


@dataclass(frozen=True, kw_only=True)
class _Job:
    tokens: np.ndarray
    namespace: str | None
    base: int
    keys: torch.Tensor  # [L, H, T - base, D] CPU
    values: torch.Tensor
    ready: torch.cuda.Event | None
    nbytes: int
    held: list[bytes]
    future: Future[None]


class SaveHandle:
    """One context being saved; from :meth:`kvstore.Store.begin_save`.

    Use as a context manager: it finishes on success and aborts on an exception. Thread-safety:
    one thread (the compute) calls a handle's methods.
    """

    def __init__(self, saver: Saver, layout: KVLayout, tokens: np.ndarray,
                 namespace: str | None, base: int, capacity: int, held: list[bytes],
                 nbytes: int) -> None:
        self._saver = saver
        self._layout = layout
        self.tokens = tokens  # the prompt's ids; append() adds more
        self.namespace = namespace
        self.base = base  # tokens before this are stored already (held until the save ends)
        self._extra: list[int] = []
        self._held = held
        self._nbytes = nbytes
        shape = (layout.num_layers, layout.num_kv_heads, capacity, layout.head_dim)
        pin = torch.cuda.is_available()
        self._k = torch.empty(shape, dtype=layout.torch_dtype, pin_memory=pin)  # [L, H, cap, D]
        self._v = torch.empty(shape, dtype=layout.torch_dtype, pin_memory=pin)
        self._layers = np.zeros(layout.num_layers, dtype=bool)
        self._on_gpu = False
        self._state = "open"  # open -> finished | aborted

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) + len(self._extra)

    def _check_open(self) -> None:
        if self._state != "open":
            raise ValueError(f"this save is already {self._state}")

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.device.type == "cuda":
            self._on_gpu = True
            dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)

    def layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Layer ``layer``'s KV of the prompt, [num_kv_heads, T_prompt, head_dim] each (keys
        pre-RoPE; the whole context or at least its tokens from ``base`` on, right-aligned)."""
        self._check_open()
        lay, T = self._layout, len(self.tokens)
        if not 0 <= layer < lay.num_layers:
            raise ValueError(f"layer must be in [0, {lay.num_layers}), got {layer}")
        for name, t in (("keys", keys), ("values", values)):
            if (t.dim() != 3 or t.shape[0] != lay.num_kv_heads or t.shape[2] != lay.head_dim
                    or t.shape[1] < T - self.base):
                raise ValueError(f"{name} must be [num_kv_heads={lay.num_kv_heads}, "
                                 f">= {T - self.base} tokens, head_dim={lay.head_dim}], got "
                                 f"{list(t.shape)}")
        n = T - self.base
        assert keys.shape == values.shape
        self._copy(self._k[layer, :, :n], keys[:, keys.shape[1] - n :])  # [H, n, D]
        self._copy(self._v[layer, :, :n], values[:, values.shape[1] - n :])
        self._layers[layer] = True

    def append(self, tokens: object, keys: torch.Tensor, values: torch.Tensor) -> None:
        """KV of more tokens after the prompt (decode steps, batched): [L, H, t, D] each."""
        self._check_open()
        extra = np.asarray(tokens, dtype=np.int64).reshape(-1)
        t, at = len(extra), self.num_tokens - self.base
        want = (self._layout.num_layers, self._layout.num_kv_heads, t, self._layout.head_dim)
        if tuple(keys.shape) != want or tuple(values.shape) != want:
            raise ValueError(f"keys/values must be {list(want)} for {t} tokens, got "
                             f"{list(keys.shape)} and {list(values.shape)}")
        if at + t > self._k.shape[2]:
            raise ValueError(f"append of {t} tokens exceeds max_new_tokens given to begin_save "
                             f"({self._k.shape[2] - (len(self.tokens) - self.base)})")
        self._copy(self._k[:, :, at : at + t], keys)
        self._copy(self._v[:, :, at : at + t], values)
        self._extra += [int(x) for x in extra]

    def finish(self) -> Future[None]:
        """Hand the context to the writer; the future completes when it is durable."""
        self._check_open()
        missing = np.flatnonzero(~self._layers)
        if len(missing):
            raise ValueError(f"layers {missing.tolist()} were never given to layer()")
        self._state = "finished"
        toks = np.concatenate([self.tokens, np.asarray(self._extra, dtype=self.tokens.dtype)])
        n = len(toks) - self.base
        ready = None
        if self._on_gpu:
            ready = torch.cuda.Event()
            ready.record()
        job = _Job(tokens=toks, namespace=self.namespace, base=self.base,
                   keys=self._k[:, :, :n], values=self._v[:, :, :n], ready=ready,
                   nbytes=self._nbytes, held=self._held, future=Future())
        self._saver._submit(job)
        return job.future

    def abort(self) -> None:
        """Drop the save; nothing of it is stored."""
        if self._state == "open":
            self._state = "aborted"
            self._saver._done(self._nbytes, self._held)

    def __enter__(self) -> SaveHandle:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state == "open":
            self.finish()


class Saver:
    """The write buffer and the writer thread of one store (started on the first save).

    ``write(tokens, keys, values, namespace, base)`` stores one context (the store's put);
    ``release(held)`` lets go of the chunks a save held. Thread-safety: all methods may be
    called from any thread.
    """

    def __init__(self, *, capacity_bytes: int,
                 write: Callable[[np.ndarray, torch.Tensor, torch.Tensor, str | None, int], None],
                 release: Callable[[list[bytes]], None]) -> None:
        self.capacity_bytes = capacity_bytes
        self._write = write
        self._release = release
        self._cond = threading.Condition()
        self._used = 0  # bytes of write buffer held by open or queued saves
        self._pending = 0  # finished saves not yet written
        self._errors: list[BaseException] = []
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._queued: dict[int, _Job] = {}  # finished saves not yet written, by id
        self.saved = 0
        self.failed = 0

    def reserve(self, nbytes: int) -> None:
        """Wait for ``nbytes`` of write buffer (a save bigger than the buffer waits until the
        buffer is empty)."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._used == 0
                                or self._used + nbytes <= self.capacity_bytes)
            if self._closed:
                raise StoreClosed("the store is closing")
            self._used += nbytes

    @property
    def used_bytes(self) -> int:
        return self._used

    def _submit(self, job: _Job) -> None:
        with self._cond:
            if self._closed:
                self._done_locked(job.nbytes)
                job.future.set_exception(StoreClosed("the store closed before this save"))
                self._release(job.held)
                raise StoreClosed("the store is closing")
            self._pending += 1
            self._queued[id(job)] = job
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-saver",
                                                daemon=True)
                self._thread.start()
            # Under the lock: close() cannot slip its stop sentinel in ahead of this job.
            self._queue.put(job)

    def _done_locked(self, nbytes: int) -> None:
        self._used -= nbytes
        self._cond.notify_all()

    def _done(self, nbytes: int, held: list[bytes]) -> None:
        try:
            self._release(held)
        finally:  # the accounting happens even if collecting orphans fails
            with self._cond:
                self._done_locked(nbytes)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                if job.ready is not None:
                    job.ready.synchronize()  # the non-blocking copies from the GPU are done
                self._write(job.tokens, job.keys, job.values, job.namespace, job.base)
            except BaseException as e:  # handed to the future and the next flush()
                job.future.set_exception(e)
                with self._cond:
                    self._errors.append(e)
                    self.failed += 1
            else:
                job.future.set_result(None)
                self.saved += 1
            finally:
                self._retire(job)

    def _retire(self, job: _Job) -> None:
        """A queued save is over (written, failed or abandoned): release what it held."""
        try:
            self._done(job.nbytes, job.held)
        except BaseException as e:  # reported by flush(); the writer keeps going
            with self._cond:
                self._errors.append(e)
        finally:
            with self._cond:
                self._pending -= 1
                self._queued.pop(id(job), None)
                self._cond.notify_all()

    def wait_for(self, tokens: np.ndarray, namespace: str | None) -> None:
        """Block until no finished-but-unwritten save shares a prefix with ``tokens`` (in
        ``namespace``); re-raise such a save's error."""
        with self._cond:
            futs = [j.future for j in self._queued.values()
                    if j.namespace == namespace and len(j.tokens) and len(tokens)
                    and j.tokens[0] == tokens[0]]
        for f in futs:
            f.result()

    def flush(self) -> None:
        """Block until every finished save is durable; raise the first error since the last
        flush (the other failed saves' futures hold theirs)."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self, *, abandon: bool) -> None:
        """Finish (or with ``abandon``, drop) queued saves and stop the writer thread. A save
        being written completes or fails whole."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if abandon:
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    continue
                job.future.set_exception(StoreClosed("the store closed before this save"))
                self._retire(job)
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
