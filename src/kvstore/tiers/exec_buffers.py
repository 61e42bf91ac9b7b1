"""The hbm tier: execution buffers that layer-wise loads fill and compute reads.

On CUDA the buffers are device memory; a load copies each layer to the device on a copy stream
(from a page-locked DRAM slot, or from pinned staging that a disk read filled), so compute on
its stream only waits for that layer's copy event (AttentionStore §3.2.1, Fig. 6). A released
CUDA buffer carries the event after which its last user is done; the next load's copies wait
for it on the device (no host synchronisation). Without a GPU the
execution buffer is host memory that the loader fills straight from the DRAM slot or the disk
read: no second copy through a staging buffer. Either way the tier is bounded by ``hbm_bytes``
and keeps released buffers for reuse (a fresh allocation costs page faults on every load).
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

from kvstore.errors import CapacityError


class HbmTier:
    """A bounded pool of execution buffers on one device.

    Thread-safety: all methods may be called from any thread.
    """

    def __init__(self, *, capacity_bytes: int, device: torch.device) -> None:
        self.capacity_bytes = capacity_bytes
        self.device = device
        self._lock = threading.Lock()
        self._used = 0  # bytes handed out
        self._idle: dict[int, list[torch.Tensor]] = defaultdict(list)  # nbytes -> buffers
        self._idle_bytes = 0
        self.reused = 0
        self._after: dict[int, torch.cuda.Event] = {}  # data_ptr -> its last use's event

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` on the tier's device (contents undefined)."""
        with self._lock:
            if self._used + nbytes > self.capacity_bytes:
                raise CapacityError(
                    f"an execution buffer of {nbytes} bytes does not fit hbm_bytes="
                    f"{self.capacity_bytes} ({self._used} bytes in use by other loads)")
            self._used += nbytes
            idle = self._idle.get(nbytes)
            if idle:
                self._idle_bytes -= nbytes
                self.reused += 1
                return idle.pop()
            # Make room for a new allocation by dropping idle buffers of other sizes.
            for size in sorted(self._idle):
                while self._idle[size] and self._used + self._idle_bytes > self.capacity_bytes:
                    dropped = self._idle[size].pop()
                    self._after.pop(dropped.data_ptr(), None)  # freed by the allocator
                    self._idle_bytes -= size
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except BaseException:
            with self._lock:
                self._used -= nbytes
            raise

    def last_use(self, buf: torch.Tensor) -> torch.cuda.Event | None:
        """The event a buffer from :meth:`acquire` carries from its previous load (work that
        writes it must wait for it), or None."""
        with self._lock:
            return self._after.pop(buf.data_ptr(), None)

    def release(self, buf: torch.Tensor, after: torch.cuda.Event | None = None) -> None:
        """Return a buffer from :meth:`acquire`; it is kept for reuse (after ``after``, on a
        CUDA device)."""
        n = buf.numel()
        with self._lock:
            if after is not None:
                self._after[buf.data_ptr()] = after
            self._used -= n
            self._idle[n].append(buf)
            self._idle_bytes += n

    def forget(self, nbytes: int) -> None:
        """A buffer of ``nbytes`` from :meth:`acquire` will never come back (its load was
        dropped unclosed): it leaves the budget and is freed when its last view goes."""
        with self._lock:
            self._used -= nbytes

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()
            self._after.clear()
            self._idle_bytes = 0
