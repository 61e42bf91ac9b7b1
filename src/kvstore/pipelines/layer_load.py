"""Layer-wise loading: a loader thread fills layer l of a stored context, compute waits on l.

AttentionStore §3.2.1: loading layer l+1 overlaps computing layer l, so the cost of reading a
stored context hides behind the prefill of the new tokens. A read buffer of B layers lets the
loader start before compute does (while the previous job still holds the execution buffer) with
up to B layers, and then run up to B layers further ahead of compute than the one layer the
execution buffer allows (B=None: no bound). Each layer read from disk
is verified against that layer's checksum; a failure reaches the waiting compute as the error
itself (``CorruptData``), never as a hang or wrong data.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

import torch


class LayerLoad:
    """Handle of one layer-wise load; obtained from :meth:`kvstore.Store.load_layers`.

    ``wait(l)`` returns (keys, values) of layer l, [num_kv_heads, T, head_dim] each (views into
    one output pair [L, H, T, D], keys pre-RoPE, valid until :meth:`close`); a load into an
    engine's pages (``keys`` and ``values`` None) returns None once layer l is in them. On CUDA,
    ``load_layer`` returns the copy event of the layer and ``wait`` makes the current stream
    wait for it. Thread-safety: ``wait`` and ``close`` may be called from any thread; the loader
    runs on its own thread, started by ``start``.

    A handle dropped without :meth:`close` (or ``with``) is cleaned up when it is collected:
    loading stops, the disk slots are unpinned, and its execution buffer leaves the hbm
    budget (``on_abandon``; the memory itself is freed once no view of it is left, never
    handed to another load).
    """

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None,
                 load_layer: Callable[[int], torch.cuda.Event | None], *,
                 buffer_layers: int | None, on_done: Callable[[], None],
                 on_close: Callable[[torch.cuda.Event | None], None] | None = None,
                 on_abandon: Callable[[], None] | None = None,
                 num_layers: int | None = None) -> None:
        self._loader = Loader(keys, values, load_layer, buffer_layers=buffer_layers,
                               on_done=on_done, on_close=on_close, on_abandon=on_abandon,
                               num_layers=num_layers)
        self.keys, self.values = keys, values  # [L, H, T, D]
        self.num_layers = self._loader.num_layers
        self.buffer_layers = buffer_layers
        self._finalizer = weakref.finalize(self, self._loader.abandon)

    @property
    def loader(self) -> Loader:
        """The loading state (what the store tracks; it does not keep the handle alive)."""
        return self._loader

    def start(self) -> LayerLoad:
        self._loader.start()
        return self

    def wait(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Block until ``layer`` is loaded; layers below it are released from the read buffer.

        Raises the loader's error (e.g. :class:`~kvstore.errors.CorruptData`) for the layer that
        failed and every layer after it.
        """
        return self._loader.wait(layer)

    def done(self) -> bool:
        return self._loader.done()

    @property
    def load_s(self) -> float:
        """Seconds the loader thread has spent loading layers so far (reads, checks and copies;
        not its waits for the read-buffer bound): once :meth:`done`, the time this load took
        on its own, which is what a load-or-compute estimate needs."""
        return self._loader.busy_s

    def close(self) -> None:
        """Stop loading (pending layers are abandoned), wait for the loader thread, and give
        the execution buffer back. Idempotent."""
        self._loader.close()
        self._finalizer.detach()

    def __enter__(self) -> LayerLoad:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Loader:
    """The state of one load, shared by its handle and its loader thread."""

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None,
                 load_layer: Callable[[int], torch.cuda.Event | None], *,
                 buffer_layers: int | None, on_done: Callable[[], None],
                 on_close: Callable[[torch.cuda.Event | None], None] | None,
                 on_abandon: Callable[[], None] | None, num_layers: int | None = None) -> None:
        self.keys, self.values = keys, values  # [L, H, T, D], or None (a load into pages)
        self._layer_views: list[tuple[torch.Tensor, torch.Tensor] | None]
        if keys is None or values is None:
            assert keys is None and values is None and num_layers is not None
            self.num_layers = num_layers
            self._layer_views = [None] * num_layers
            self._device = torch.device("cpu")
        else:
            assert keys.shape == values.shape
            self.num_layers = keys.shape[0]
            self._layer_views = [(keys[i], values[i]) for i in range(self.num_layers)]  # [H,T,D]
            self._device = keys.device
        if buffer_layers is not None and (isinstance(buffer_layers, bool)
                                          or not isinstance(buffer_layers, int)
                                          or buffer_layers < 0):
            raise ValueError(f"buffer_layers must be None or an int >= 0, got {buffer_layers!r}")
        self.buffer_layers = buffer_layers
        self._load_layer = load_layer
        self._on_done = on_done
        self._on_close = on_close
        self._on_abandon = on_abandon
        self._ready = [threading.Event() for _ in range(self.num_layers)]
        self._copied: list[torch.cuda.Event | None] = [None] * self.num_layers
        self._cond = threading.Condition()
        self._consumed: int | None = None  # highest layer compute has asked for
        self._loader_waiting = False  # the loader is (about to be) blocked by the bound
        self._cancelled = False
        self._error: BaseException | None = None
        self._n_loaded = 0  # layers 0.._n_loaded-1 are complete
        self.busy_s = 0.0  # written by the loader thread only
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        thread = threading.Thread(target=self._run, name="kvstore-layerload", daemon=True)
        thread.start()
        self._thread = thread  # only once it runs: close() joins started threads only

    def _may_load(self, layer: int) -> bool:
        if self.buffer_layers is None:
            return True
        if self._consumed is None:  # compute has not started: the read buffer only
            return layer < self.buffer_layers
        return layer <= self._consumed + 1 + self.buffer_layers

    def _run(self) -> None:
        try:
            for layer in range(self.num_layers):
                with self._cond:
                    while True:
                        # Set before checking: wait() reads it after updating _consumed, so
                        # either it notifies or this check sees the update (no lost wakeup).
                        self._loader_waiting = True
                        if self._cancelled or self._may_load(layer):
                            break
                        self._cond.wait()
                    self._loader_waiting = False
                    if self._cancelled:
                        return
                t = time.perf_counter()
                self._copied[layer] = self._load_layer(layer)
                self.busy_s += time.perf_counter() - t
                self._n_loaded = layer + 1
                self._ready[layer].set()
        except BaseException as e:  # handed to the waiting compute thread in wait()
            self._error = e
        finally:
            for ev in self._ready:
                ev.set()  # nobody waits forever: wait() checks the error
            self._on_done()

    def wait(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Block until ``layer`` is loaded; layers below it are released from the read buffer.

        Raises the loader's error (e.g. :class:`~kvstore.errors.CorruptData`) for the layer that
        failed and every layer after it.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        consumed = self._consumed
        if consumed is None or layer > consumed:  # once per layer: raise the bound
            with self._cond:
                if self._consumed is None or layer > self._consumed:
                    self._consumed = layer
                    if self._loader_waiting:
                        self._cond.notify_all()
        if layer >= self._n_loaded:  # no lock or event on the fast path (a loaded layer)
            self._ready[layer].wait()
        if layer < self._n_loaded:
            copied = self._copied[layer]
            if copied is not None:
                torch.cuda.current_stream(self._device).wait_event(copied)
            return self._layer_views[layer]
        if self._error is not None:
            raise self._error
        raise RuntimeError("the layer-wise load was closed before this layer was loaded")

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def close(self) -> None:
        """Stop loading (pending layers are abandoned), wait for the loader thread, and give
        the execution buffer back. Idempotent. On CUDA, call it from the thread whose stream
        ran the compute that read the buffer (the next load's copies are ordered after it)."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._cond:
            on_close, self._on_close, self._on_abandon = self._on_close, None, None
        if on_close is not None:
            after = None
            if self._device.type == "cuda":
                # The buffer's last users: the copies of every layer loaded and the kernels
                # queued so far on this thread's stream. The next load's copies wait for this
                # event on the device; nothing waits on the host.
                stream = torch.cuda.current_stream(self._device)
                for copied in self._copied:
                    if copied is not None:
                        stream.wait_event(copied)
                after = stream.record_event()
            on_close(after)

    def abandon(self) -> None:
        """The handle was dropped unclosed (a finalizer; any thread, the loader's included):
        stop loading without waiting, and take the buffer out of the budget, not back into
        the pool (views of it may still be in use)."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()
            on_abandon, self._on_close, self._on_abandon = self._on_abandon, None, None
        if on_abandon is not None:
            on_abandon()


def layer_groups(num_layers: int) -> dict[int, list[int]]:
    """Layers read together by a layer-wise load, by first layer: groups of 1, 2, 4, 8, ...
    layers, so layer 0 arrives after one small read (or round trip to a remote tier) and the
    whole load takes about log2(L) reads per chunk rather than L (each read costs the loader a
    call into the system and, on a busy machine, a wait for the interpreter and the CPU that
    cost more than the bytes)."""
    out: dict[int, list[int]] = {}
    start, size = 0, 1
    while start < num_layers:
        group = list(range(start, min(num_layers, start + size)))
        for layer in group:
            out[layer] = group
        start, size = start + size, size * 2
    return out
