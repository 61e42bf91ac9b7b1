"""The remote tier: chunk values in a Redis server or a Redis Cluster, by chain hash.

Every call is one pipelined round trip per node (a cluster's keys are grouped by the master
that owns their slot, from the slot map read at open and again after a ``MOVED``). Each node
has a client with no retries whose sockets are bounded (:mod:`kvstore.tiers.shared.deadline`):
connect and every read or send end within ``timeout_s`` (a stalled server), every round trip
of a public call by the call's deadline (``deadline_s``: a server that trickles), and a round
trip may receive only the bytes its commands can answer (a value
is never read beyond the size its header allows: ``STRLEN`` and ``GETRANGE`` of that size,
never a bare ``GET``). Each node has a circuit breaker (:mod:`kvstore.tiers.shared.breaker`): a
round trip that fails (cut by its deadline, refused connection, a reply that is not the
protocol or longer than asked) counts against it, and while it is open the node's keys are
misses at once. A reply that is the protocol but not a usable value (absent, evicted, another type,
truncated, corrupt, another chunk's) is a miss too, counted by kind; nothing unverified is
returned (:mod:`kvstore.tiers.shared.value`).

Thread-safety: every method may be called from any number of threads at once (redis-py clients
keep a pool of connections; counters are updated under a lock).
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

import numpy as np
import redis
from redis.crc import key_slot
from redis.exceptions import AuthenticationError, MovedError, RedisError, ResponseError

from kvstore.errors import KVStoreError
from kvstore.layout import KVLayout
from kvstore.tiers.remote.config import RemoteConfig
from kvstore.tiers.remote.nodes import ROUND_OVERHEAD, Node, hide_password, node_url
from kvstore.tiers.shared import marks
from kvstore.tiers.shared import value as rv
from kvstore.tiers.shared.deadline import (
    ReplyTooLarge,
    call_deadline,
    call_expires,
    round_trip,
)
from kvstore.tiers.shared.estimate import LinkEstimate

KID_PREFIX = 8  # a stored partial chunk is found by a prompt sharing its first 8 tokens

PROBE_START = 64 << 10  # the first bandwidth probe's bytes (see Tier.probe)
PROBE_ENOUGH_S = 0.02  # a probe round trip this long measures bandwidth well enough
# Reply bytes a round trip may receive beyond what its commands ask for, per command (a bulk
# or integer header, an error line such as MOVED or WRONGTYPE); per round trip: ROUND_OVERHEAD
REPLY_OVERHEAD = 256
KIDS_REPLY_BYTES = 4 << 20  # a kids set's reply (SMEMBERS): members are key + a chunk's ids
MARKS_REPLY_BYTES = 1 << 20  # a marks set's reply: members of marks.MEMBER_BYTES
SMALL_REPLY = 64  # STRLEN, EXISTS, SET, SADD, PING
DOC_BYTES = 64 << 20  # a shared document (conversation state) read back
SLOTS_REPLY_BYTES = 16 << 20  # CLUSTER SLOTS


class RemoteSetupError(KVStoreError):
    """Redis refused the remote tier's setup when the store opened it (a DB index the server
    does not have, a command it does not allow); the message names the remote URL."""


class RemoteAuthError(RemoteSetupError):
    """The Redis server refused the credentials of the remote URL, or (``rediss://``) its TLS
    certificate is not one this client trusts (raised at open)."""


def _untrusted(e: BaseException) -> bool:
    """Whether a failed call's cause is a TLS certificate this client does not trust."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        if isinstance(x, ssl.SSLCertVerificationError):
            return True
        seen.add(id(x))
        x = x.__cause__ or x.__context__
    return "CERTIFICATE_VERIFY_FAILED" in str(e)


@dataclass(slots=True)
class RemoteCounters:
    lookups: int = 0  # match-time header round trips
    found_chunks: int = 0  # chunks whose header verified
    absent_chunks: int = 0  # keys not in Redis (never written, or evicted by Redis)
    bad_values: int = 0  # wrong type, truncated, corrupt or foreign values: misses
    fetched_chunks: int = 0  # whole chunks fetched and verified
    fetched_layers: int = 0  # layer ranges fetched and verified (layer-wise loads)
    fetched_bytes: int = 0
    call_errors: int = 0  # calls that failed (timeouts, connection errors, protocol errors)
    timeouts: int = 0  # ... of which cut by their round trip's timeout or the call's deadline
    oversized_replies: int = 0  # ... of which replies longer than their commands can answer
    deadline_skipped: int = 0  # round trips not started: the public call's deadline passed
    refused_calls: int = 0  # calls not made: the node's breaker was open
    slot_refreshes: int = 0  # cluster slot map reloads (after MOVED)
    written_chunks: int = 0  # write-through SET NX that stored a value
    already_present: int = 0  # write-through found the chunk in Redis already
    write_failed: int = 0  # write-through chunks not sent (node down, chunk gone locally)
    probes: int = 0  # bandwidth probes


class RemoteTier:
    """Redis (a server or a cluster) as a tier of chunk values by chain key: it answers
    :class:`~kvstore.tiers.shared.chunk_server.ChunkServer`'s calls (a
    :class:`~kvstore.tiers.interface.ChunkTier`), each in one pipelined round trip per node,
    every value verified, a failure a miss. Thread-safety: every method from any thread."""

    tier_name = "remote"
    thread_safe = True

    def __init__(self, cfg: RemoteConfig, layout: KVLayout) -> None:
        self.cfg = cfg
        self.layout = layout
        self.counters = RemoteCounters()
        self.estimate = LinkEstimate()
        self._lock = threading.Lock()
        self._prefix = cfg.prefix.encode()
        self._nodes: dict[str, Node] = {}
        self._slots: list[Node | None] | None = None  # cluster: slot -> master
        for u in cfg.urls:
            p = urlsplit(u)
            name = f"{p.hostname}:{p.port or 6379}"
            self._nodes.setdefault(name, Node(name, u if not cfg.cluster
                                              else node_url(u, p.hostname, p.port or 6379),
                                              cfg))
        self.cluster = cfg.cluster  # also found at connect (INFO) or by a MOVED reply

    # ------------------------------------------------------------------ setup
    def connect(self) -> None:
        """Check every configured node at open: a refused password is :class:`RemoteAuthError`;
        an unreachable node only opens its breaker (the store works locally meanwhile)."""
        for node in list(self._nodes.values()):
            try:
                node.ping()
            except (AuthenticationError, redis.exceptions.AuthorizationError) as e:
                raise RemoteAuthError(f"Redis at {node.name} refused the credentials of the "
                                      f"remote URL: {e}") from None
            except ResponseError as e:
                if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
                    raise RemoteAuthError(f"Redis at {node.name} needs a password (give it in "
                                          f"the URL as redis://:PASSWORD@host:port): {e}") from None
                raise RemoteSetupError(
                    f"remote {self._shown()}: Redis at {node.name} refused the setup of a "
                    f"connection: {e}") from None
            except (RedisError, OSError) as e:
                node.reset()
                if _untrusted(e):
                    raise RemoteAuthError(
                        f"Redis at {node.name} presented a TLS certificate this client does not "
                        f"trust (name the CA as rediss://host:port/0?ssl_ca_certs=PATH): {e}"
                    ) from None
                self.count("call_errors")
                node.breaker.trip(e)
                continue
            if not self.cluster:
                try:
                    with call_deadline(self.cfg.timeout_s), \
                            round_trip(ROUND_OVERHEAD + (64 << 10), self.cfg.timeout_s):
                        info = node.client.info("cluster")
                except (RedisError, OSError) as e:
                    node.reset()
                    self.count("call_errors")
                    node.breaker.failure(e)
                    continue
                self.cluster = bool(info.get("cluster_enabled"))
        if self.cluster:
            self.refresh_slots()

    def refresh_slots(self) -> bool:
        """Reload the cluster's slot map from the first node that answers."""
        template = self.cfg.urls[0]
        for node in list(self._nodes.values()):
            if node.breaker.state != "closed":
                continue
            try:
                with call_deadline(self.cfg.timeout_s), \
                        round_trip(SLOTS_REPLY_BYTES, self.cfg.timeout_s):
                    ranges = node.client.execute_command("CLUSTER SLOTS")
            except (RedisError, OSError) as e:
                self._failed(node, e)
                continue
            slots: list[Node | None] = [None] * 16384
            try:  # the reply is untrusted: anything but slot ranges of masters is a failure
                for entry in ranges:
                    lo, hi, master = int(entry[0]), int(entry[1]), entry[2]
                    host = master[0].decode() if isinstance(master[0], bytes) \
                        else str(master[0])
                    host = host or urlsplit(template).hostname
                    port = int(master[1])
                    if not (0 <= lo <= hi < 16384 and 0 < port < 65536):
                        raise ValueError(f"slot range {lo}-{hi} at port {port}")
                    name = f"{host}:{port}"
                    with self._lock:
                        n = self._nodes.get(name)
                        if n is None:
                            n = self._nodes[name] = Node(name, node_url(template, host, port),
                                                         self.cfg)
                    for s in range(lo, hi + 1):
                        slots[s] = n
            except (TypeError, ValueError, IndexError, AttributeError,
                    UnicodeDecodeError) as e:
                self._failed(node, ValueError(f"CLUSTER SLOTS is not a slot map: {e}"))
                continue
            with self._lock:
                self._slots = slots
                self.counters.slot_refreshes += 1
            return True
        return False

    def close(self) -> None:
        for node in list(self._nodes.values()):
            node.breaker.close()
            node.reset()

    # ------------------------------------------------------------------ plumbing
    def redis_key(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def node_of(self, rkey: bytes) -> Node | None:
        """The node holding Redis key ``rkey`` (None: a cluster whose slot map is unknown)."""
        if not self.cluster:
            return next(iter(self._nodes.values()))
        slots = self._slots
        if slots is None:
            return None
        return slots[key_slot(rkey)]

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.counters, name, getattr(self.counters, name) + n)

    def _shown(self) -> str:
        return ", ".join(hide_password(u) for u in self.cfg.urls)

    def _failed(self, node: Node, e: BaseException) -> None:
        """A round trip to ``node`` failed: its connections go (one may hold a half-read
        reply), the breaker counts it."""
        node.reset()
        node.breaker.failure(e)
        self.count("call_errors")
        if isinstance(e, ReplyTooLarge):
            self.count("oversized_replies")
        elif isinstance(e, redis.exceptions.TimeoutError | TimeoutError):
            self.count("timeouts")

    def deadline(self) -> object:
        """A context manager bounding the remote round trips of one public call by the
        config's ``deadline_s`` (:func:`kvstore.tiers.shared.deadline.call_deadline`)."""
        return call_deadline(self.cfg.deadline_s)

    def _call(self, keys: Sequence[bytes], build: Callable[[object, int], None],
              reply_bytes: Callable[[int], int], *,
              probe: bool = False, redis_keys: bool = False,
              observe: bool = True) -> dict[int, object]:
        """One pipelined round trip per node for the commands ``build(pipe, i)`` of each
        chunk ``keys[i]`` (Redis keys themselves with ``redis_keys``); returns i -> reply (an
        exception object for a per-command error) for the nodes that answered. Failed and
        refused nodes' keys are absent from the result. ``reply_bytes(i)``: the most bytes
        command i's reply can legitimately carry; a node's round trip may receive their sum
        (plus protocol overhead) and ends by the public call's deadline."""
        groups: dict[str, tuple[Node, list[int]]] = {}
        unmapped = 0
        for i, k in enumerate(keys):
            node = self.node_of(k if redis_keys else self.redis_key(k))
            if node is None:
                unmapped += 1
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        if unmapped:
            self.count("refused_calls")
        out: dict[int, object] = {}
        moved = False
        call = call_expires()
        for node, idxs in groups.values():
            if call is not None and call <= time.monotonic():
                self.count("deadline_skipped")
                continue
            if not node.breaker.allow():
                self.count("refused_calls")
                continue
            pipe = node.client.pipeline(transaction=False)
            budget = ROUND_OVERHEAD
            for i in idxs:
                build(pipe, i)
                budget += reply_bytes(i) + REPLY_OVERHEAD
            t0 = time.perf_counter()
            try:
                with round_trip(budget, self.cfg.deadline_s):
                    replies = pipe.execute(raise_on_error=False)
            except (RedisError, OSError, ValueError) as e:
                self._failed(node, e)
                continue
            dt = time.perf_counter() - t0
            node.breaker.success()
            if len(replies) != len(idxs):  # never expected of redis-py: not the protocol
                node.reset()
                self.count("call_errors")
                continue
            nbytes = 0
            for i, r in zip(idxs, replies, strict=True):
                if isinstance(r, MovedError):
                    moved = True
                    continue
                out[i] = r
                if isinstance(r, bytes):
                    nbytes += len(r)
            if observe:
                self.estimate.observe(nbytes, dt, probe=probe)
            with self._lock:
                self.counters.fetched_bytes += nbytes
        if moved:  # the slot map changed, or a single URL named a cluster node
            self.cluster = True
            self.refresh_slots()
        return out

    def _bad(self, reply: object) -> None:
        """Count a reply that is not a usable value."""
        if reply is None:
            self.count("absent_chunks")
        else:
            self.count("bad_values")

    # ------------------------------------------------------------------ reads
    def kids_key(self, parent: bytes, tokens: np.ndarray) -> bytes:
        """The set of partial chunks stored after chunk ``parent`` whose first
        min(:data:`KID_PREFIX`, n) token ids are ``tokens[:KID_PREFIX]`` (members: key + token
        ids). Keyed by those tokens too, so a parent followed by many different partial chunks
        (a shared system prompt) does not make every lookup read them all."""
        head = np.ascontiguousarray(tokens[:KID_PREFIX], dtype="<u4").tobytes()
        return self._prefix + b"kids:" + parent.hex().encode() + b":" + head.hex().encode()

    def _kid_keys(self, wants: Sequence[tuple[bytes, np.ndarray]]) -> list[list[bytes]]:
        """For each (parent, tokens): the kids sets that may hold a partial chunk sharing a
        prefix with the tokens (one per head length up to KID_PREFIX)."""
        return [[self.kids_key(p, t[:h]) for h in range(1, min(KID_PREFIX, len(t)) + 1)]
                for p, t in wants]

    def _kids(self, reply: object) -> list[tuple[bytes, np.ndarray]]:
        """Members of a kids set: (chunk key, token ids); malformed members are skipped."""
        if not isinstance(reply, set | list):
            return []
        out = []
        for m in reply:
            if isinstance(m, bytes) and len(m) > rv.KEY_BYTES and \
                    (len(m) - rv.KEY_BYTES) % 4 == 0:
                out.append((m[:rv.KEY_BYTES], np.frombuffer(m, dtype="<u4",
                                                            offset=rv.KEY_BYTES).copy()))
        return out

    def kids(self, wants: Sequence[tuple[bytes, np.ndarray]]
             ) -> list[list[tuple[bytes, np.ndarray]]]:
        """The partial chunks stored after each (parent, tokens) that start like the tokens:
        one round trip (``SMEMBERS``)."""
        groups = self._kid_keys(wants)
        rkeys = [k for g in groups for k in g]
        replies = self._call(rkeys, lambda pipe, i: pipe.smembers(rkeys[i]),
                             lambda i: KIDS_REPLY_BYTES, redis_keys=True)
        return self._merge_kids(groups, replies, 0)

    def _merge_kids(self, groups: list[list[bytes]], replies: dict[int, object],
                    first: int) -> list[list[tuple[bytes, np.ndarray]]]:
        out, j = [], first
        for g in groups:
            members: list[tuple[bytes, np.ndarray]] = []
            for _ in g:
                members += self._kids(replies.get(j))
                j += 1
            out.append(members)
        return out

    def headers(self, items: Sequence[tuple[bytes, np.ndarray]],
                wants: Sequence[tuple[bytes, np.ndarray]] = ()) -> list[rv.Header | None]:
        """The verified header of each (key, tokens), None where absent or unusable (a value
        whose length disagrees with its header included): one round trip (``GETRANGE key 0
        header_size-1`` and ``STRLEN``)."""
        return self.headers_and_kids(items, wants)[0]

    def headers_and_kids(self, items: Sequence[tuple[bytes, np.ndarray]],
                         wants: Sequence[tuple[bytes, np.ndarray]]
                         ) -> tuple[list[rv.Header | None], list[list[tuple[bytes, np.ndarray]]]]:
        """:meth:`headers` of ``items`` and :meth:`kids` of ``wants`` in one round trip."""
        groups = self._kid_keys(wants)
        out, sets = self._headers_and_sets(items, [k for g in groups for k in g],
                                           KIDS_REPLY_BYTES)
        return out, self._merge_kids(groups, dict(enumerate(sets)), 0)

    def headers_and_marks(self, items: Sequence[tuple[bytes, np.ndarray]],
                          parents: Sequence[bytes]) -> tuple[list[rv.Header | None],
                                                             list[list[marks.Mark]]]:
        """:meth:`headers` of ``items`` and the boundary marks filed under each of
        ``parents`` (``SMEMBERS`` of their marks sets; malformed members are skipped), in one
        round trip."""
        out, sets = self._headers_and_sets(items, [self.marks_key(p) for p in parents],
                                           MARKS_REPLY_BYTES)
        return out, [[m for m in map(marks.parse_member, r if isinstance(r, set | list)
                                     else ()) if m is not None] for r in sets]

    def marks_key(self, parent: bytes) -> bytes:
        """The set of boundary marks filed under chunk ``parent`` (:mod:`.marks`)."""
        return self._prefix + b"marks:" + parent.hex().encode()

    def _headers_and_sets(self, items: Sequence[tuple[bytes, np.ndarray]],
                          sets: Sequence[bytes], set_bytes: int
                          ) -> tuple[list[rv.Header | None], list[object]]:
        """The verified header of each (key, tokens) and the members of each Redis set
        ``sets`` (a reply of at most ``set_bytes`` each; None where not answered): one
        pipelined round trip per node."""
        lay = self.layout
        rkeys = [self.redis_key(k) for k, _ in items for _ in range(2)] + list(sets)
        n2 = 2 * len(items)

        def build(pipe: object, j: int) -> None:
            if j >= n2:
                pipe.smembers(rkeys[j])
                return
            _, t = items[j // 2]
            if j % 2 == 0:
                pipe.getrange(rkeys[j], 0, rv.header_size(len(t), lay.num_layers) - 1)
            else:
                pipe.strlen(rkeys[j])

        def reply_bytes(j: int) -> int:
            if j >= n2:
                return set_bytes
            return rv.header_size(len(items[j // 2][1]), lay.num_layers) if j % 2 == 0 \
                else SMALL_REPLY

        replies = self._call(rkeys, build, reply_bytes, redis_keys=True)
        self.count("lookups")
        out: list[rv.Header | None] = []
        for i, (k, t) in enumerate(items):
            if 2 * i not in replies or 2 * i + 1 not in replies:
                out.append(None)
                continue
            r, n = replies[2 * i], replies[2 * i + 1]
            if r == b"":  # GETRANGE of an absent key
                r = None
            try:
                h = rv.checked_header(r, n, k, t, self.layout)
            except rv.BadValue:
                self._bad(r)
                out.append(None)
                continue
            self.count("found_chunks")
            out.append(h)
        return out, [replies.get(j) for j in range(n2, len(rkeys))]

    def values(self, items: Sequence[tuple[bytes, np.ndarray]]) -> list[np.ndarray | None]:
        """The extents of :meth:`values_and_headers` (None where absent or unusable)."""
        return [None if got is None else got[0] for got in self.values_and_headers(items)]

    def values_and_headers(self, items: Sequence[tuple[bytes, np.ndarray]]
                           ) -> list[tuple[np.ndarray, rv.Header] | None]:
        """The verified raw extent of each (key, tokens) with its value's header, None where
        absent or unusable (a value that fails its checksums or does not decode through its
        codec is counted as bad, never served): one pipelined round trip of ``STRLEN`` and
        ``GETRANGE`` of at most the size a value of those tokens can have (a value padded with
        junk is not read beyond it, and its length refuses it). Arrays of values stored
        uncoded may be read-only views of the received bytes (verified in place: no copy
        before the gather into the caller's output); coded ones are decoded."""
        lay = self.layout
        caps = [rv.max_value_bytes(len(t), lay) for _, t in items]

        def build(pipe: object, j: int) -> None:
            rk = self.redis_key(items[j // 2][0])
            if j % 2 == 0:
                pipe.strlen(rk)
            else:
                pipe.getrange(rk, 0, caps[j // 2] - 1)

        replies = self._call([k for k, _ in items for _ in range(2)], build,
                             lambda j: SMALL_REPLY if j % 2 == 0 else caps[j // 2])
        out: list[tuple[np.ndarray, rv.Header] | None] = []
        for i, (k, t) in enumerate(items):
            if 2 * i not in replies or 2 * i + 1 not in replies:
                out.append(None)
                continue
            n, r = replies[2 * i], replies[2 * i + 1]
            if n == 0:  # absent (GETRANGE of an absent key is empty)
                r = None
            try:
                h = rv.checked_header(r, n, k, t, self.layout)
                out.append((rv.decode(h, r), h))
            except rv.BadValue:
                self._bad(r)
                out.append(None)
                continue
            self.count("fetched_chunks")
        return out

    def layers(self, items: Sequence[tuple[bytes, rv.Header]], layers: Sequence[int]
               ) -> dict[int, list[np.ndarray | None]]:
        """The verified raw bytes of each of ``layers`` of each (key, header): one pipelined
        round trip of ``GETRANGE`` (layer -> one entry per item, None where unusable)."""
        pairs = [(i, layer) for layer in layers for i in range(len(items))]

        def build(pipe: object, j: int) -> None:
            i, layer = pairs[j]
            a, b = items[i][1].layer_range(layer)
            pipe.getrange(self.redis_key(items[i][0]), a, b)

        def reply_bytes(j: int) -> int:
            a, b = items[pairs[j][0]][1].layer_range(pairs[j][1])
            return b + 1 - a

        replies = self._call([items[i][0] for i, _ in pairs], build, reply_bytes)
        out: dict[int, list[np.ndarray | None]] = {layer: [] for layer in layers}
        for j, (i, layer) in enumerate(pairs):
            r = replies.get(j)
            try:
                if j not in replies:
                    raise rv.BadValue("not answered")
                out[layer].append(rv.decode_layer(items[i][1], layer, r))
            except rv.BadValue:
                if j in replies:
                    self._bad(r)
                out[layer].append(None)
                continue
            self.count("fetched_layers")
        return out

    def probe(self, found: Sequence[tuple[bytes, rv.Header]]) -> None:
        """Estimate the link's bandwidth from these values' payloads (``GETRANGE``): round
        trips of growing size (``PROBE_START`` bytes, x4 each time, up to ``probe_bytes``)
        until one takes ``PROBE_ENOUGH_S``; the last one is the bandwidth sample. So the probe
        costs what the link allows: tens of milliseconds on a slow link (where one 256 KiB range
        at 2 MB/s cost 0.13 s, more than what deciding not to fetch could save), a
        full-size range on a fast one, where a small range would be mostly latency."""
        size = min(PROBE_START, self.cfg.probe_bytes)
        self.count("probes")
        while True:
            ranges, left = [], size
            for key, h in found:
                if left <= 0:
                    break
                b = min(h.value_bytes, h.size + left) - 1
                ranges.append((key, h.size, b))
                left -= b + 1 - h.size
            t0 = time.perf_counter()
            got = self._call([k for k, _, _ in ranges],
                             lambda pipe, i, ranges=ranges: pipe.getrange(
                                 self.redis_key(ranges[i][0]), ranges[i][1], ranges[i][2]),
                             lambda i, ranges=ranges: ranges[i][2] + 1 - ranges[i][1],
                             observe=False)
            dt = time.perf_counter() - t0
            nbytes = sum(len(r) for r in got.values() if isinstance(r, bytes))
            if not got or dt >= PROBE_ENOUGH_S or size >= self.cfg.probe_bytes or left > 0:
                break
            size = min(size * 4, self.cfg.probe_bytes)
        if nbytes:
            # the round trip's latency (measured by the small calls) is not transfer time;
            # at most half of it is taken off, so a noisy latency cannot inflate the estimate
            lat = self.estimate.latency_s or 0.0
            self.estimate.observe(nbytes, max(dt - lat, dt / 2), probe=True)

    # ------------------------------------------------------------------ small documents
    def put_doc(self, name: str, data: bytes) -> bool:
        """Store a small document (e.g. a conversation's state) under ``prefix + "doc:" +
        name``; False if its node did not answer."""
        rk = self._prefix + b"doc:" + name.encode()
        with self.deadline():
            r = self._call([rk], lambda pipe, i: pipe.set(rk, data), lambda i: SMALL_REPLY,
                           redis_keys=True)
        return r.get(0) is True

    def get_doc(self, name: str) -> bytes | None:
        """A document stored by :meth:`put_doc` (None if absent, longer than ``DOC_BYTES``,
        or the node did not answer). Untrusted bytes: the caller validates them."""
        rk = self._prefix + b"doc:" + name.encode()
        with self.deadline():
            got = self._call([rk, rk], lambda pipe, i: pipe.strlen(rk) if i == 0
                             else pipe.getrange(rk, 0, DOC_BYTES - 1),
                             lambda i: SMALL_REPLY if i == 0 else DOC_BYTES, redis_keys=True)
        n, r = got.get(0), got.get(1)
        if not isinstance(n, int) or not n or not isinstance(r, bytes) or len(r) != n:
            return None
        return r

    # ------------------------------------------------------------------ writes
    def exists(self, keys: Sequence[bytes]) -> list[bool | None]:
        """Whether each key is in Redis (None: its node did not answer)."""
        replies = self._call(keys, lambda pipe, i: pipe.exists(self.redis_key(keys[i])),
                             lambda i: SMALL_REPLY)
        return [None if i not in replies or not isinstance(replies[i], int)
                else bool(replies[i]) for i in range(len(keys))]

    def put(self, items: Sequence[tuple[bytes, bytes]],
            kids: Sequence[tuple[bytes, bytes, np.ndarray]] = ()) -> list[bool | None]:
        """``SET key value NX`` for each (key, value): True stored, False already there, None
        not sent (node down or error). ``kids``: (parent, key, tokens) of partial chunks to
        add to their parent's kids set (``SADD``), so a longer prompt can find them."""
        n = len(items)
        rkeys = [self.redis_key(k) for k, _ in items] + [self.kids_key(p, t) for p, _, t in kids]

        def build(pipe: object, i: int) -> None:
            if i < n:
                pipe.set(rkeys[i], items[i][1], nx=True)
            else:
                _, key, toks = kids[i - n]
                pipe.sadd(rkeys[i], key + np.ascontiguousarray(toks, dtype="<u4").tobytes())

        replies = self._call(rkeys, build, lambda i: SMALL_REPLY, redis_keys=True)
        out: list[bool | None] = []
        for i in range(n):
            r = replies.get(i)
            out.append(None if i not in replies or isinstance(r, Exception)
                       else r is True)
        return out

    def delete(self, keys: Sequence[bytes],
               kids: Sequence[tuple[bytes, bytes, np.ndarray]] = ()) -> list[bool | None]:
        """``DEL key`` for each key: True deleted, False absent, None not answered (node down
        or error). ``kids``: (parent, key, tokens) of partial chunks to remove from their
        parent's kids set (``SREM``)."""
        n = len(keys)
        rkeys = [self.redis_key(k) for k in keys] + [self.kids_key(p, t) for p, _, t in kids]

        def build(pipe: object, i: int) -> None:
            if i < n:
                pipe.delete(rkeys[i])
            else:
                _, key, toks = kids[i - n]
                pipe.srem(rkeys[i], key + np.ascontiguousarray(toks, dtype="<u4").tobytes())

        replies = self._call(rkeys, build, lambda i: SMALL_REPLY, redis_keys=True,
                             observe=False)
        out: list[bool | None] = []
        for i in range(n):
            r = replies.get(i)
            out.append(None if i not in replies or not isinstance(r, int) else r > 0)
        return out

    def put_marks(self, items: Sequence[tuple[bytes, marks.Mark]]) -> int:
        """``SADD`` each (parent, mark) to its parent's marks set; how many sets answered."""
        rkeys = [self.marks_key(p) for p, _ in items]
        replies = self._call(rkeys, lambda pipe, i: pipe.sadd(
            rkeys[i], marks.encode_member(items[i][1])), lambda i: SMALL_REPLY,
            redis_keys=True, observe=False)
        return sum(isinstance(r, int) for r in replies.values())

    def delete_marks(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Remove every mark naming ``key`` from the marks set of ``parent``, for each (parent,
        key): ``SMEMBERS``, then ``SREM`` of the members that name it; how many went."""
        rkeys = [self.marks_key(p) for p, _ in items]
        sets = self._call(rkeys, lambda pipe, i: pipe.smembers(rkeys[i]),
                          lambda i: MARKS_REPLY_BYTES, redis_keys=True, observe=False)
        gone = [(rkeys[i], m) for i, (_, key) in enumerate(items)
                for m in (sets.get(i) if isinstance(sets.get(i), set | list) else ())
                if (mk := marks.parse_member(m)) is not None and mk.key == key]
        replies = self._call([rk for rk, _ in gone], lambda pipe, i: pipe.srem(*gone[i]),
                             lambda i: SMALL_REPLY, redis_keys=True, observe=False)
        return sum(r for r in replies.values() if isinstance(r, int))

    def stats(self) -> dict[str, object]:
        with self._lock:
            c = asdict(self.counters)
            nodes = list(self._nodes.values())
        states = {n.name: n.breaker.stats() for n in nodes}
        return {"urls": [hide_password(u) for u in self.cfg.urls],
                "cluster": self.cluster, **c, "link": self.estimate.stats(),
                "breaker": "open" if any(s["state"] != "closed" for s in states.values())
                else "closed", "nodes": states}
