"""Time and bytes a remote call may take, enforced on the socket itself.

A slow or hostile server must cost a caller a bounded time and bounded memory, whatever it
sends: replies that trickle in a byte at a time (a per-read socket timeout never fires), a bulk
header announcing 2 GB then a drip, or values padded with junk. So:

* **A deadline per public call** (:func:`call_deadline`: ``match``, ``get``, a layer-wise
  load, a prefetch; each write-through batch): every round trip made on the caller's behalf
  ends by it. Nested calls (a prefetch's get) keep the earliest deadline.
* **A budget per round trip** (:func:`round_trip`): it ends by the call's deadline, covering
  connect, TLS handshake, send and every read of the reply, and may receive at most the bytes
  its commands can legitimately answer (the caller computes them from what it asked: a
  header's size, a ``GETRANGE``'s length, a kids set's cap).
* :func:`bounded_connection` makes a redis-py connection class whose socket is a
  :class:`BoundedSocket`: before each ``recv``/``send`` it arms the socket timeout with the
  connection's own timeout (``timeout_s``: a stalled server) or what is left of the round
  trip, whichever is less, and after each read it counts the bytes against the budget,
  raising :class:`ReplyTooLarge` (a redis ``ConnectionError``) past it. A passed
  deadline is a ``socket.timeout`` (redis-py's ``TimeoutError``). Either way the tier drops
  the node's connections (a half-read reply is never reused) and counts a failure against
  its breaker: slow calls open it like dead ones.
* **A stall is no progress, not a slow link.** ``timeout_s`` bounds each ``send`` (never a
  whole ``sendall``: a pipelined batch of megabytes over a slow link takes longer than a
  stall), and a read that times out while this socket's own bytes are still leaving it
  (``SIOCOUTQ``, the kernel's unacknowledged send queue, shrank since the last try) waits
  again: the server cannot answer before it has the request. Only the call's deadline
  bounds the whole.

The limits live in a thread-local: a round trip runs on the thread that makes it, and a
connection is used by one thread at a time (redis-py's pool). Thread-safety: every function
may be called from any thread; each thread sees its own call and round trip.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from redis.exceptions import ConnectionError as RedisConnectionError

_local = threading.local()
_SIOCOUTQ = termios.TIOCOUTQ  # Linux: bytes of a TCP socket's send queue not yet acknowledged


class ReplyTooLarge(RedisConnectionError):
    """A reply longer than the commands asked could legitimately be (a hostile server)."""


@dataclass(slots=True)
class Round:
    """One round trip's limits: a monotonic deadline and a byte budget."""

    expires: float
    max_bytes: int
    received: int = 0

    def left(self) -> float:
        return self.expires - time.monotonic()


def call_expires() -> float | None:
    """The deadline (``time.monotonic()``) of the public call this thread is serving."""
    return getattr(_local, "call", None)


@contextmanager
def call_deadline(seconds: float | None = None, *, expires: float | None = None
                  ) -> Iterator[float]:
    """Bound the remote round trips this thread makes inside the block by ``seconds`` from
    now (or by the monotonic time ``expires``: a load's loader thread continuing its caller's
    call); an enclosing call's earlier deadline wins. Yields the deadline in force."""
    outer = call_expires()
    mine = expires if expires is not None else time.monotonic() + (seconds or 0.0)
    now = mine if outer is None else min(outer, mine)
    _local.call = now
    try:
        yield now
    finally:
        _local.call = outer


@contextmanager
def round_trip(max_bytes: int, fallback_s: float) -> Iterator[Round]:
    """Limits of one round trip made inside the block: it ends by the call's deadline
    (``fallback_s`` from now outside a call) and receives at most ``max_bytes``."""
    call = call_expires()
    expires = time.monotonic() + fallback_s if call is None else call
    outer = getattr(_local, "round", None)
    r = _local.round = Round(expires, max_bytes)
    try:
        yield r
    finally:
        _local.round = outer


def _current() -> Round | None:
    return getattr(_local, "round", None)


class BoundedSocket:
    """A socket (plain or TLS) whose operations end by the current round trip's deadline and
    whose reads stop at its byte budget; everything else is the socket's own."""

    def __init__(self, sock: socket.socket, timeout: float | None) -> None:
        self._sock = sock
        self._timeout = timeout  # what redis-py asked for; the round trip may cut it shorter

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def _arm(self) -> Round | None:
        r = _current()
        if r is None:
            self._sock.settimeout(self._timeout)
            return None
        left = r.left()
        if left <= 0:
            raise TimeoutError("the remote call's deadline passed")
        self._sock.settimeout(left if self._timeout is None else min(self._timeout, left))
        return r

    def _count(self, r: Round | None, n: int) -> None:
        if r is not None:
            r.received += n
            if r.received > r.max_bytes:
                raise ReplyTooLarge(f"the server sent more than the {r.max_bytes} bytes the "
                                    f"commands asked can answer")

    def _unsent(self) -> int:
        """Bytes this socket sent that the peer has not acknowledged yet (0 if unknown)."""
        try:
            raw = fcntl.ioctl(self._sock.fileno(), _SIOCOUTQ, b"\0\0\0\0")
        except OSError:
            return 0
        return struct.unpack("i", raw)[0]

    def _read(self, op):  # noqa: ANN001, ANN202  (a recv of the socket's, with its arguments)
        """``op()`` armed as any read; a timeout while this socket's own bytes are still
        draining to the peer (fewer unacknowledged than at the last try) reads again."""
        last = None
        while True:
            r = self._arm()  # raises once the round trip's deadline passed
            try:
                return r, op()
            except TimeoutError:
                unsent = self._unsent()
                if unsent == 0 or (last is not None and unsent >= last):
                    raise
                last = unsent

    def recv_into(self, buffer: object, nbytes: int = 0, flags: int = 0) -> int:
        r, n = self._read(lambda: self._sock.recv_into(buffer, nbytes, flags))
        if not flags & socket.MSG_PEEK:
            self._count(r, n)
        return n

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        r, data = self._read(lambda: self._sock.recv(bufsize, flags))
        if not flags & socket.MSG_PEEK:
            self._count(r, len(data))
        return data

    def sendall(self, data: object, flags: int = 0) -> None:
        # Python bounds a whole sendall by the socket's timeout, which would make ``timeout_s``
        # (a stall) bound the transfer of a large pipelined batch over a slow link: each send
        # is bounded instead, by the stall timeout and what is left of the round trip
        view = memoryview(data).cast("B")
        while view:
            self._arm()
            n = self._sock.send(view, flags)
            view = view[n:]

    def send(self, data: object, flags: int = 0) -> int:
        self._arm()
        return self._sock.send(data, flags)


def bounded_connection(base: type) -> type:
    """A subclass of the redis-py connection class ``base`` (``Connection`` or
    ``SSLConnection``) whose connect (TCP and TLS handshake) is bounded by the current round
    trip and whose socket is a :class:`BoundedSocket`."""

    class Bounded(base):  # type: ignore[misc, valid-type]
        def _connect(self):  # noqa: ANN202  (redis-py's signature)
            r = _current()
            saved = self.socket_connect_timeout, self.socket_timeout
            if r is not None:
                left = r.left()
                if left <= 0:
                    raise TimeoutError("the remote call's deadline passed")
                self.socket_connect_timeout = min(saved[0] or left, left)
                self.socket_timeout = min(saved[1] or left, left)
            try:
                sock = super()._connect()
            finally:
                self.socket_connect_timeout, self.socket_timeout = saved
            return BoundedSocket(sock, saved[1])

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{base.__name__}"
    return Bounded
