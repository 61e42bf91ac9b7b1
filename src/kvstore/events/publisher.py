"""The store's own publisher of KV events: vLLM's ZMQ protocol, for users without vLLM.

Like vLLM's ``ZmqEventPublisher``: a PUB socket sends each :class:`KVEventBatch` as the frames
``(topic, seq, payload)``, ``seq`` counting batches from 0 (8 bytes, big-endian); a ROUTER
socket (``replay_endpoint``) answers a request of 8 big-endian bytes, the first sequence number
a subscriber missed, with every batch still buffered from there on (the last ``buffer_steps``)
as ``(identity, b"", topic, seq, payload)``, then :data:`~kvstore.events.records.END_SEQ` with
an empty payload. A request that is not one frame of 8 bytes is counted and ignored.

**One publisher per store directory** (:func:`lock_publisher`): an exclusive ``flock`` on
``STORE/EVENTS``, held while the publisher lives (the kernel drops it when the process dies).
The disk tier is the directory's, so one process announces it; it learns the other processes'
commits from the catalog's change log (:mod:`kvstore.events.source`), within
``sync_interval_s`` when it is idle itself. Its first batch is ``AllBlocksCleared`` followed
by what the store holds: a subscriber of a restarted publisher (sequence numbers start at 0
again) forgets what the previous one said and learns the store's contents.

**Bounded.** A put only appends a report to the source's bounded queue; the publisher thread
turns reports into events and sends them; ZMQ's PUB socket drops what a slow subscriber does not
take beyond ``hwm`` messages (a subscriber that reads nothing never slows the store:
``bench/events.py``).

Threads: the publisher thread (it owns the PUB socket) and the replay thread (it owns the
ROUTER socket, blocked in ``recv`` until a request or the context's end). Both start in
:meth:`ZmqPublisher.start` and are daemons, like the object tier's sweeper: they hold no work a
caller waits for, and a process that exits without closing its store must not wait on them
(what was not sent then describes a store whose process is gone); :meth:`ZmqPublisher.close`
drains what was reported, sends it and joins both.

Thread-safety: :meth:`start` once, :meth:`close` once (idempotent) from any thread;
:meth:`stats` from any thread.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import threading
import time

import zmq

from kvstore.errors import StoreLocked
from kvstore.events.config import EventsConfig
from kvstore.events.records import (
    END_SEQ,
    AllBlocksCleared,
    Event,
    KVEventBatch,
    batch_encoder,
    seq_bytes,
)
from kvstore.events.source import EventSource
from kvstore.format.directory import Dir

LOCK_FILE = "EVENTS"
MAX_BATCH_EVENTS = 1000  # events per batch (a store's first announcement is many batches)
log = logging.getLogger("kvstore")


def lock_publisher(root: Dir) -> int:
    """The descriptor of ``STORE/EVENTS``, locked exclusively for this process's publisher;
    :class:`StoreLocked` if another process publishes the store's events."""
    fd = root.open(LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreLocked(f"another process publishes the KV events of {root.path!r} (one "
                          f"publisher per store directory: it holds {root.show(LOCK_FILE)!r})"
                          ) from None
    return fd


def _binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard and ipc/inproc endpoints are bound, the rest connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqPublisher:
    """Publishes what ``source`` drains on ``cfg``'s endpoints; ``lock_fd``: this process's
    lock of the directory (:func:`lock_publisher`), released by :meth:`close`."""

    def __init__(self, cfg: EventsConfig, source: EventSource, lock_fd: int) -> None:
        self.cfg = cfg
        self._source = source
        self._lock_fd: int | None = lock_fd
        self._ctx = zmq.Context()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._topic = cfg.topic.encode()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=cfg.buffer_steps)
        self._buf_lock = threading.Lock()
        self._seq = 0
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.counters: collections.Counter[str] = collections.Counter(dict.fromkeys(
            ("batches", "events", "unsent_batches", "replay_requests", "bad_replay_requests",
             "drain_errors"), 0))
        self.last_error = ""

    def wake(self) -> None:
        """A report arrived (the source's ``wake``): drain soon. Any thread."""
        self._wakeup.set()

    def start(self) -> None:
        """Bind (or connect) the sockets, then start the threads; a ZMQError (an endpoint in
        use) is raised here, with the endpoint named."""
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(self.cfg.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if _binds(self.cfg.endpoint):
                self._pub.bind(self.cfg.endpoint)
            else:
                self._pub.connect(self.cfg.endpoint)
            if self.cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"KV events: cannot open endpoint {self.cfg.endpoint!r} / replay "
                          f"{self.cfg.replay_endpoint!r}: {e}") from None
        self._threads.append(threading.Thread(target=self._publish_loop, daemon=True,
                                              name="kvstore-events-publish"))
        if self._replay is not None:
            self._threads.append(threading.Thread(target=self._replay_loop, daemon=True,
                                                  name="kvstore-events-replay"))
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ publishing
    def _publish_loop(self) -> None:
        enc = batch_encoder()
        try:
            self._send([AllBlocksCleared(), *self._drain()], enc)
            while not self._stop.is_set():
                self._wakeup.wait(self.cfg.sync_interval_s)
                self._wakeup.clear()
                events = self._drain()
                if events:
                    self._send(events, enc)
            events = self._drain()  # what was reported before close()
            if events:
                self._send(events, enc)
        finally:
            assert self._pub is not None
            self._pub.close(linger=0)

    def _drain(self) -> list[Event]:
        try:
            return self._source.drain()
        except Exception as e:  # a catalog error: counted, shown in stats(); tried again
            self.counters["drain_errors"] += 1
            self.last_error = f"{type(e).__name__}: {e}"[:300]
            log.warning("kvstore: KV events: a drain failed: %s", self.last_error)
            return []

    def _send(self, events: list[Event], enc) -> None:
        assert self._pub is not None
        for i in range(0, len(events), MAX_BATCH_EVENTS):
            batch = KVEventBatch(ts=time.time(), events=events[i:i + MAX_BATCH_EVENTS],
                                 data_parallel_rank=0)
            payload = enc.encode(batch)
            seq = self._seq
            self._seq += 1
            with self._buf_lock:
                self._buffer.append((seq, payload))
            try:
                self._pub.send_multipart((self._topic, seq_bytes(seq), payload),
                                         flags=zmq.NOBLOCK)
            except zmq.Again:  # a connected endpoint with no peer yet: replay has it
                self.counters["unsent_batches"] += 1
            self.counters["batches"] += 1
            self.counters["events"] += len(batch.events)

    # ------------------------------------------------------------------ replay
    def _replay_loop(self) -> None:
        sock = self._replay
        assert sock is not None
        try:
            while True:
                try:
                    frames = sock.recv_multipart()
                except zmq.ContextTerminated:
                    return
                if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                    self.counters["bad_replay_requests"] += 1
                    continue
                client, start = frames[0], int.from_bytes(frames[2], "big")
                with self._buf_lock:
                    items = [(s, p) for s, p in self._buffer if s >= start]
                self.counters["replay_requests"] += 1
                try:
                    for s, p in items:
                        sock.send_multipart((client, b"", self._topic, seq_bytes(s), p))
                    sock.send_multipart((client, b"", b"", END_SEQ, b""))
                except zmq.ContextTerminated:
                    return
        finally:
            sock.close(linger=0)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Send what was reported, stop both threads, close the sockets, release the
        directory's publisher lock. Idempotent; any thread."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wakeup.set()
        for t in self._threads[:1]:
            t.join()
        if not self._threads:
            self._close_sockets()
        self._ctx.term()  # ends the replay thread's recv (it closes its socket)
        for t in self._threads[1:]:
            t.join()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # drops the flock
            self._lock_fd = None

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)

    def stats(self) -> dict[str, object]:
        """The publisher's counters and its source's (``stats()["events"]``). Any thread."""
        return {**self._source.stats(), **dict(self.counters), "next_seq": self._seq,
                "endpoint": self.cfg.endpoint, "replay_endpoint": self.cfg.replay_endpoint,
                "last_error": self.last_error}
