"""A circuit breaker per Redis node: fail fast while a node is down, retry it in the background.

``closed``: calls go through; ``failures`` consecutive failures open it. ``open``: calls are
refused at once (the caller treats them as misses), and a probe thread calls ``probe()`` every
``retry_s`` until one succeeds, which closes the breaker again. The probe thread starts when the
breaker opens and ends when it closes (or at :meth:`close`); it is a daemon because it holds no
work anyone waits for (a process may exit while a node is down).

Thread-safety: every method may be called from any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Breaker:
    def __init__(self, name: str, *, failures: int, retry_s: float,
                 probe: Callable[[], None]) -> None:
        self.name = name
        self._threshold = failures
        self._retry_s = retry_s
        self._probe = probe
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.state = "closed"
        self.consecutive = 0
        self.failures = 0  # calls that failed (timeouts, connection errors, protocol errors)
        self.opened = 0  # times it opened
        self.refused = 0  # calls refused while open
        self.probes = 0
        self.last_error = ""
        self._thread: threading.Thread | None = None

    def allow(self) -> bool:
        with self._lock:
            if self.state == "closed":
                return True
            self.refused += 1
            return False

    def success(self) -> None:
        with self._lock:
            self.consecutive = 0

    def failure(self, err: BaseException) -> None:
        with self._lock:
            self.failures += 1
            self.consecutive += 1
            self.last_error = f"{type(err).__name__}: {err}"[:300]
            if self.state == "closed" and self.consecutive >= self._threshold:
                self._open_locked()

    def trip(self, err: BaseException) -> None:
        """Open at once (e.g. the node refused the connection at open)."""
        with self._lock:
            self.failures += 1
            self.last_error = f"{type(err).__name__}: {err}"[:300]
            if self.state == "closed":
                self._open_locked()

    def _open_locked(self) -> None:
        self.state = "open"
        self.opened += 1
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._retry, daemon=True,
                                            name=f"kvstore-remote-breaker-{self.name}")
            self._thread.start()

    def _retry(self) -> None:
        while not self._stop.wait(self._retry_s):
            with self._lock:
                self.probes += 1
            try:
                self._probe()
            except Exception as e:  # counted and shown in stats(); the node stays open
                with self._lock:
                    self.last_error = f"{type(e).__name__}: {e}"[:300]
                continue
            with self._lock:
                self.state = "closed"
                self.consecutive = 0
                self._thread = None
            return
        with self._lock:
            self._thread = None

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            t = self._thread
        if t is not None:
            t.join()

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {"state": self.state, "failures": self.failures, "opened": self.opened,
                    "refused": self.refused, "probes": self.probes,
                    "last_error": self.last_error}
