"""Host memory for KV handed to the caller: recycled, so copies land in pages already faulted in.

A fresh allocation pays the kernel's page faults (and zeroing) on first touch, and a get copies
each chunk into a slice of its output, touching every page of the output within its first
chunks: measured here, 4-5 GB/s into fresh memory against 9-17 GB/s into memory already
touched (torch.empty memory, without transparent huge pages, manages 1.4 GB/s). So the tensors
a get returns are views of pooled buffers: each buffer comes back to the pool when the last
tensor (or view, or numpy array) using it is gone, noticed by a ``weakref.finalize`` on the
numpy array the tensors are made from, and the next get of a similar size reuses it. Idle
buffers are bounded (``idle_bytes``); buffers in use belong to the caller.

A fresh buffer (none idle fits) is an anonymous private mapping whose used range starts on a
huge-page boundary and is advised for transparent huge pages (``madvise`` mode here: only
advised ranges get them; numpy's own advice starts 4 KiB into a block, so its first and last
2 MiB stay small pages). It is faulted in before it is handed out, with one
``madvise(MADV_POPULATE_WRITE)`` per part (Linux 5.14+; else one write per page), split over
the caller's threads when it asks: the copy that follows then writes into resident memory
(the gather's non-temporal stores into pages not yet faulted in measured 0.7-0.8 of the same
copy into prefaulted ones here).
"""

from __future__ import annotations

import errno
import functools
import mmap
import threading
import weakref
from collections.abc import Callable

import numpy as np
import torch

from kvstore.layout import KVLayout

_NP_INT = {2: np.int16, 4: np.int32}
GRAIN = 2 << 20  # buffers are multiples of a huge page, and fresh ones start on one
PAGE = 4096
# Linux's value; Python's mmap module names it only where its build's headers did.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

RunAll = Callable[[list[Callable[[], object]]], object]


@functools.cache
def populate_supported() -> bool:
    """Whether this kernel takes ``MADV_POPULATE_WRITE`` (asked once, on one page)."""
    if not hasattr(mmap.mmap, "madvise"):
        return False
    with mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as probe:
        try:
            probe.madvise(_MADV_POPULATE_WRITE, 0, PAGE)
        except OSError as e:  # EINVAL: older than Linux 5.14
            if e.errno not in (errno.EINVAL, errno.ENOSYS):
                raise
            return False
    return True


def _populate(m: mmap.mmap, lo: int, hi: int) -> None:
    """Fault in bytes ``lo..hi`` of mapping ``m`` (``lo`` page-aligned): one madvise, or a
    write to every page where the kernel lacks it."""
    if not populate_supported():
        np.frombuffer(m, dtype=np.uint8)[lo:hi:PAGE] = 0
        return
    try:
        m.madvise(_MADV_POPULATE_WRITE, lo, hi - lo)
    except OSError as e:
        if e.errno == errno.ENOMEM:
            raise MemoryError(f"no memory for a {hi - lo}-byte output buffer") from e
        raise


def fresh_buffer(nbytes: int, ways: int = 1, run_all: RunAll | None = None) -> np.ndarray:
    """A new uint8 buffer of ``nbytes`` (a multiple of :data:`GRAIN`) on a huge-page boundary,
    advised for transparent huge pages and faulted in: in ``ways`` parts run by ``run_all``
    (e.g. ``Helpers.run_all``: the first part on this thread) when given, else here.
    Thread-safety: any thread."""
    if nbytes <= 0 or nbytes % GRAIN:
        raise ValueError(f"nbytes must be a positive multiple of {GRAIN}, got {nbytes}")
    if not hasattr(mmap, "MAP_PRIVATE"):  # not a POSIX mmap: plain numpy memory
        buf = np.empty(nbytes, dtype=np.uint8)
        buf[::PAGE] = 0
        return buf
    whole = mmap.mmap(-1, nbytes + GRAIN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    off = -np.frombuffer(whole, dtype=np.uint8, count=1).ctypes.data % GRAIN
    buf = np.frombuffer(whole, dtype=np.uint8, count=nbytes, offset=off)  # keeps whole mapped
    if hasattr(mmap, "MADV_HUGEPAGE"):
        whole.madvise(mmap.MADV_HUGEPAGE, off, nbytes)
    grains = nbytes // GRAIN
    step = -(-grains // max(1, min(ways, grains))) * GRAIN
    tasks = [(lambda lo=lo: _populate(whole, off + lo, off + min(lo + step, nbytes)))
             for lo in range(0, nbytes, step)]
    if run_all is None or len(tasks) == 1:
        for t in tasks:
            t()
    else:
        run_all(tasks)
    return buf


class OutputPool:
    """Thread-safety: every method may be called from any thread (and the finalizers run on
    whichever thread drops the last reference)."""

    def __init__(self, idle_bytes: int) -> None:
        self.idle_limit = idle_bytes
        self._lock = threading.Lock()
        self._idle: list[np.ndarray] = []  # uint8 buffers, smallest first
        self._idle_bytes = 0
        self.reused = 0
        self.allocated = 0

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def _take(self, nbytes: int, ways: int, run_all: RunAll | None) -> np.ndarray:
        with self._lock:
            for i, buf in enumerate(self._idle):  # smallest that fits, not much too large
                if nbytes <= buf.nbytes <= nbytes + max(nbytes // 2, GRAIN):
                    del self._idle[i]
                    self._idle_bytes -= buf.nbytes
                    self.reused += 1
                    return buf
            self.allocated += 1
        return fresh_buffer(-(-nbytes // GRAIN) * GRAIN, ways, run_all)

    def _give_back(self, buf: np.ndarray) -> None:
        with self._lock:
            if buf.nbytes > self.idle_limit:
                return
            self._idle.append(buf)
            self._idle.sort(key=lambda b: b.nbytes)
            self._idle_bytes += buf.nbytes
            while self._idle_bytes > self.idle_limit:  # the largest go first
                self._idle_bytes -= self._idle.pop().nbytes

    def tensor(self, shape: tuple[int, ...], layout: KVLayout, *, ways: int = 1,
               run_all: RunAll | None = None) -> torch.Tensor:
        """A new CPU tensor of ``shape`` in the layout dtype, contents undefined, backed by a
        pooled buffer that returns to the pool once nothing uses the tensor's memory. Its
        memory is resident: a fresh buffer is faulted in first (``ways``, ``run_all``: see
        :func:`fresh_buffer`)."""
        nbytes = int(np.prod(shape)) * layout.itemsize
        if not nbytes:  # e.g. the write buffer of a save with nothing new to store
            return torch.empty(shape, dtype=layout.torch_dtype)
        buf = self._take(nbytes, ways, run_all)
        arr = buf[:nbytes].view(_NP_INT[layout.itemsize]).reshape(shape)
        # The tensor (and every view of it) keeps ``arr`` itself alive: torch.from_numpy holds
        # the array object it was given. (Not a view of ``arr``: numpy collapses a view's base
        # to the buffer's owner, so a finalizer on an intermediate view would fire too early.)
        weakref.finalize(arr, self._give_back, buf)
        return torch.from_numpy(arr).view(layout.torch_dtype)

    def kv(self, layout: KVLayout, n_tokens: int, *, ways: int = 1,
           run_all: RunAll | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """New (keys, values) CPU tensors [L, H, n_tokens, D] (see :meth:`tensor`)."""
        shape = layout.kv_shape(n_tokens)
        return (self.tensor(shape, layout, ways=ways, run_all=run_all),
                self.tensor(shape, layout, ways=ways, run_all=run_all))

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0
