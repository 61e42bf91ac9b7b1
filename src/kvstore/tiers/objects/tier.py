"""The object tier: chunk values in an S3-compatible bucket, by chain hash.

It answers what the store's shared-tier link asks of a tier of chunk values (the same calls as
the Redis tier, :class:`kvstore.tiers.remote.tier.RemoteTier`, so reads, layer-wise loads,
write-through and prefetch are the link's, :mod:`kvstore.pipelines.shared.link`), with requests
instead of pipelined commands:

* headers: a ranged ``GET`` of exactly a header's bytes per chunk, all in parallel (the
  reply's ``Content-Range`` gives the value's size, which must be what the header says);
* values: a ranged ``GET`` of at most the size a value of those tokens can have (a value padded
  with junk is refused by its size, never read beyond it); layers: one ranged ``GET`` per
  chunk and layer, in parallel (``ObjectsConfig.parallel`` requests in flight);
* chunks a prompt's chunk is a prefix of: listed under their parent
  (:mod:`kvstore.tiers.objects.names`), then their headers read; a hybrid layout's boundary
  marks (:mod:`kvstore.tiers.shared.marks`): listed under their parent, one listing per
  parent, in the round of the headers;
* writes: ``PUT`` with ``If-None-Match: *`` (an object is written whole or not at all, and one
  that is there is not written again; every store writes the same bytes under a name anyway).

Every request of a public call ends by the call's deadline and receives at most what it asked
for (:mod:`kvstore.tiers.objects.s3`); failed requests count against one circuit breaker, and
while it is open every call is a miss at once. Nothing unverified is returned: a value of the
wrong size, bytes, key, tokens or layout is a miss, counted. Each value fetched or found is
renewed (its use marker rewritten, at most every quarter of ``ttl_s`` per process, in the
background), and the tier sweeps what is unused in the background
(:mod:`kvstore.tiers.objects.lifecycle`).

Thread-safety: every method may be called from any number of threads at once.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass

import numpy as np

from kvstore.errors import KVStoreError
from kvstore.layout import KVLayout
from kvstore.threads.background import Worker
from kvstore.tiers.objects import lifecycle
from kvstore.tiers.objects import names as on
from kvstore.tiers.objects.config import ObjectsConfig
from kvstore.tiers.objects.s3 import Reply, ReplyTooLarge, S3Client, S3Error, S3Timeout
from kvstore.tiers.shared import marks
from kvstore.tiers.shared import value as rv
from kvstore.tiers.shared.breaker import Breaker
from kvstore.tiers.shared.deadline import call_deadline, call_expires
from kvstore.tiers.shared.estimate import LinkEstimate

LIST_BYTES = 4 << 20  # one page of a listing (1,000 entries)
SMALL = 0  # the body of a HEAD, or of a PUT's or DELETE's success
MAX_KIDS = 32  # chunks after one parent whose headers one lookup reads
PROBE_START = 64 << 10
PROBE_ENOUGH_S = 0.02
RENEWED = 1 << 16  # keys whose renewal this process remembers


class ObjectsSetupError(KVStoreError):
    """The object service refused the tier's setup when the store opened it (the bucket cannot
    be reached or created); the message names the ``objects`` URL."""


class ObjectsAuthError(ObjectsSetupError):
    """The object service refused the credentials (HTTP 403 at open)."""


@dataclass(slots=True)
class ObjectCounters:
    lookups: int = 0  # match-time header rounds
    found_chunks: int = 0  # chunks whose header verified
    absent_chunks: int = 0  # names not in the bucket (never written, or swept)
    bad_values: int = 0  # truncated, corrupt, foreign or wrong-sized objects: misses
    fetched_chunks: int = 0
    fetched_layers: int = 0
    fetched_bytes: int = 0
    requests: int = 0
    call_errors: int = 0  # requests that failed (timeouts, connection errors, 5xx, 403)
    timeouts: int = 0  # ... of which cut by the call's deadline or the socket timeout
    oversized_replies: int = 0  # ... of which replies longer than the request allows
    deadline_skipped: int = 0  # requests not started: the call's deadline had passed
    refused_calls: int = 0  # calls not made: the breaker was open
    written_chunks: int = 0
    already_present: int = 0
    write_failed: int = 0
    renewed: int = 0  # use markers written
    renew_dropped: int = 0  # ... not queued: the renewal queue was full
    probes: int = 0
    sweeps: int = 0
    swept_objects: int = 0
    swept_bytes: int = 0


class ObjectTier:
    """An S3-compatible bucket as a tier of chunk values by chain key: it answers
    :class:`~kvstore.tiers.shared.chunk_server.ChunkServer`'s calls (a
    :class:`~kvstore.tiers.interface.ChunkTier`) with parallel ranged GETs and conditional PUTs,
    every value verified, a failure a miss. Thread-safety: every method from any thread."""

    tier_name = "objects"
    thread_safe = True

    def __init__(self, cfg: ObjectsConfig, layout: KVLayout) -> None:
        self.cfg = cfg
        self.layout = layout
        self.counters = ObjectCounters()
        self.estimate = LinkEstimate()
        self.last_sweep: lifecycle.SweepReport | None = None
        self.last_sweep_error = ""
        self.on_swept: Callable[[list[bytes]], None] | None = None  # keys a sweep deleted
        self._lock = threading.Lock()
        self._prefix = cfg.prefix
        self._client: S3Client | None = None
        self._pool: ThreadPoolExecutor | None = None
        # write-through and renewals: threads of their own, never queued ahead of a read
        self._background: ThreadPoolExecutor | None = None
        self.breaker = Breaker("objects", failures=cfg.breaker_failures,
                               retry_s=cfg.breaker_retry_s, probe=self._ping)
        self._renewed: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._renewals: Worker[bytes] = Worker(self._renew_batch, name="kvstore-objects-renew",
                                               batch=64, max_items=4096, key=lambda k: k)
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None

    # ------------------------------------------------------------------ setup
    def connect(self) -> None:
        """Check the bucket at open (creating it if it does not exist): refused credentials
        are :class:`ObjectsAuthError`; an endpoint that does not answer only opens the breaker
        (the store works from its other tiers meanwhile). Starts the background sweeper."""
        self._client = self.cfg.client()
        self._pool = ThreadPoolExecutor(self.cfg.parallel, thread_name_prefix="kvstore-objects")
        self._background = ThreadPoolExecutor(self.cfg.parallel,
                                              thread_name_prefix="kvstore-objects-write")
        try:
            r = self._client.request("HEAD", None, max_bytes=SMALL,
                                     expires=time.monotonic() + self.cfg.deadline_s)
            if r.status == 404:
                r = self._client.request("PUT", None, max_bytes=SMALL,
                                         expires=time.monotonic() + self.cfg.deadline_s)
        except S3Error as e:
            self.count("call_errors")
            self.breaker.trip(e)
        else:
            if r.status == 403:
                raise ObjectsAuthError(f"objects {self.cfg.shown}: the service refused the "
                                       f"credentials (HTTP 403): {_error_code(r)}")
            if not 200 <= r.status < 300 and r.status != 409:  # 409: another store made it
                raise ObjectsSetupError(f"objects {self.cfg.shown}: bucket "
                                        f"{self.cfg.bucket!r} cannot be used (HTTP {r.status} "
                                        f"{_error_code(r)})")
        if self.cfg.sweep_interval_s is not None:
            # a daemon: it holds no work anyone waits for (a sweep cut at exit deletes whole
            # objects or nothing, and the next sweep does the rest), and a process that exits
            # without closing its store must not wait for its next interval
            self._sweeper = threading.Thread(target=self._sweep_loop, daemon=True,
                                             name="kvstore-objects-sweep")
            self._sweeper.start()

    def _ping(self) -> None:
        assert self._client is not None
        r = self._client.request("HEAD", None, max_bytes=SMALL,
                                 expires=time.monotonic() + self.cfg.timeout_s)
        if r.status >= 500:
            raise S3Error(f"HTTP {r.status}")

    def close(self) -> None:
        """Stop sweeping, send the queued renewals (each batch by its deadline; refused at
        once while the breaker is open), close the connections."""
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join()
        self._renewals.close()
        self.breaker.close()
        for pool in (self._pool, self._background):
            if pool is not None:
                pool.shutdown(wait=True)
        if self._client is not None:
            self._client.close()

    # ------------------------------------------------------------------ plumbing
    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.counters, name, getattr(self.counters, name) + n)

    def deadline(self) -> object:
        """A context manager bounding the requests of one public call by ``deadline_s``."""
        return call_deadline(self.cfg.deadline_s)

    def _one(self, method: str, name: str | None, kw: dict, expires: float,
             then: Callable[[int, Reply], object] | None = None, i: int = 0) -> object:
        """One request by ``expires``; None if it failed (counted, and against the breaker).
        ``then``: applied to the reply in the worker thread (verification and decoding
        overlap the other requests' transfers), its result returned instead."""
        if time.monotonic() >= expires:
            self.count("deadline_skipped")
            return None
        if not self.breaker.allow():
            self.count("refused_calls")
            return None
        assert self._client is not None
        self.count("requests")
        try:
            r = self._client.request(method, name, expires=expires, **kw)
        except S3Error as e:
            self.count("call_errors")
            if isinstance(e, S3Timeout):
                self.count("timeouts")
            elif isinstance(e, ReplyTooLarge):
                self.count("oversized_replies")
            self.breaker.failure(e)
            return None
        if r.status >= 500 or r.status in (401, 403):
            self.count("call_errors")
            self.breaker.failure(S3Error(f"HTTP {r.status} {_error_code(r)}"))
            return None
        self.breaker.success()
        if r.status in (200, 206):
            self.count("fetched_bytes", len(r.body))
        return r if then is None else then(i, r)

    def _requests(self, reqs: Sequence[tuple[str, str | None, dict]], *,
                  observe: bool = True, probe: bool = False,
                  then: Callable[[int, Reply], object] | None = None,
                  background: bool = False) -> list:
        """The requests (method, object name, request options), in parallel, each ending by
        the public call's deadline; a reply per request (None: failed or not in time), or
        what ``then(i, reply)`` made of request i's reply in the worker thread.
        ``background``: write-through's and renewals' own threads (never queued ahead of a
        read)."""
        if not reqs:
            return []
        expires = call_expires()
        if expires is None:
            expires = time.monotonic() + self.cfg.deadline_s
        if not self.breaker.allow():
            self.count("refused_calls")
            return [None] * len(reqs)
        pool = self._background if background else self._pool
        assert pool is not None
        t0 = time.perf_counter()
        futs = [pool.submit(self._one, m, n, kw, expires, then, i)
                for i, (m, n, kw) in enumerate(reqs)]
        out: list = []
        for f in futs:
            try:  # each request ends by ``expires`` on its own; this wait only backs it up
                out.append(f.result(timeout=max(0.0, expires - time.monotonic()) + 1.0))
            except FutureTimeout:
                self.count("timeouts")
                out.append(None)
        dt = time.perf_counter() - t0
        if observe:
            nbytes = sum(_reply_bytes(r) for r in out)
            self.estimate.observe(nbytes, dt, probe=probe)
        return out

    def _bad(self, r: Reply | None) -> None:
        if r is not None and r.status == 404:
            self.count("absent_chunks")
        elif r is not None:
            self.count("bad_values")

    def _ranged(self, name: str, a: int, b: int) -> tuple[str, str, dict]:
        return ("GET", name, {"headers": {"range": f"bytes={a}-{b}"}, "max_bytes": b + 1 - a})

    # ------------------------------------------------------------------ reads
    def headers(self, items: Sequence[tuple[bytes, np.ndarray]],
                wants: Sequence[tuple[bytes, np.ndarray]] = ()) -> list[rv.Header | None]:
        return self.headers_and_kids(items, wants)[0]

    def kids(self, wants: Sequence[tuple[bytes, np.ndarray]]
             ) -> list[list[tuple[bytes, np.ndarray]]]:
        return self.headers_and_kids([], wants)[1]

    def headers_and_kids(self, items: Sequence[tuple[bytes, np.ndarray]],
                         wants: Sequence[tuple[bytes, np.ndarray]]
                         ) -> tuple[list[rv.Header | None], list[list[tuple[bytes, np.ndarray]]]]:
        """The verified header of each (key, tokens) (None where absent or unusable), and
        the partial chunks stored after each (parent, tokens) that start like the tokens:
        one parallel round of ranged GETs, then one listing and its candidates' headers. With
        ``items``, ``wants[i]`` goes with ``items[i]``, and only the first item without a
        header is listed (a partial chunk can only extend the prefix there; the other wants
        get none); without, every want is listed."""
        lay, p = self.layout, self._prefix
        replies = self._requests([
            self._ranged(on.value_name(p, k), 0, rv.header_size(len(t), lay.num_layers) - 1)
            for k, t in items])
        self.count("lookups")
        out: list[rv.Header | None] = []
        found: list[bytes] = []
        for (k, t), r in zip(items, replies, strict=True):
            h = self._checked_header(r, k, t)
            out.append(h)
            if h is not None:
                found.append(k)
        self._renew(found)
        listed = list(range(len(wants)))
        if items:
            first = next((i for i, h in enumerate(out) if h is None), len(out))
            listed = [first] if first < len(wants) else []
        lists = dict(zip(listed, self._requests([
            ("GET", None, {"query": {"list-type": "2", "max-keys": "1000",
                                     "prefix": on.kids_listing(p, *wants[i])},
                           "max_bytes": LIST_BYTES})
            for i in listed]), strict=True))
        cands: list[list[tuple[bytes, int]]] = []
        for i, (parent, t) in enumerate(wants):
            r = lists.get(i)
            mine: list[tuple[bytes, int]] = []
            if r is not None and r.status == 200:
                d = on.kids_dir(p, parent)
                for obj in on.parse_listing(r.body).objects:
                    kid = on.parse_kid(obj.name, d)
                    if kid is None:
                        continue
                    head, n, key = kid
                    if len(head) <= len(t) and np.array_equal(head, t[:len(head)]):
                        mine.append((key, n))
            cands.append(mine[:MAX_KIDS])
        flat = [(key, n) for mine in cands for key, n in mine]
        heads = self._requests([self._ranged(on.value_name(p, key), 0,
                                              rv.header_size(n, lay.num_layers) - 1)
                                for key, n in flat])
        kid_headers = iter(self._checked_header(r, key, None)
                           for (key, _), r in zip(flat, heads, strict=True))
        kids = []
        for mine in cands:
            got = []
            for key, _ in mine:
                h = next(kid_headers)
                if h is not None:
                    got.append((key, h.tokens))
            kids.append(got)
        return out, kids

    def headers_and_marks(self, items: Sequence[tuple[bytes, np.ndarray]],
                          parents: Sequence[bytes]) -> tuple[list[rv.Header | None],
                                                             list[list[marks.Mark]]]:
        """The verified header of each (key, tokens) and the boundary marks listed under each
        of ``parents`` (one page each; entries that do not parse are skipped): one parallel
        round of ranged GETs and listings."""
        lay, p = self.layout, self._prefix
        replies = self._requests(
            [self._ranged(on.value_name(p, k), 0, rv.header_size(len(t), lay.num_layers) - 1)
             for k, t in items]
            + [("GET", None, {"query": {"list-type": "2", "max-keys": "1000",
                                        "prefix": on.marks_dir(p, parent)},
                              "max_bytes": LIST_BYTES}) for parent in parents])
        self.count("lookups")
        out = [self._checked_header(r, k, t) for (k, t), r in zip(items, replies, strict=False)]
        self._renew([k for (k, _), h in zip(items, out, strict=True) if h is not None])
        found: list[list[marks.Mark]] = []
        for parent, r in zip(parents, replies[len(items):], strict=True):
            d = on.marks_dir(p, parent)
            listed = on.parse_listing(r.body).objects if r is not None and r.status == 200 \
                else []
            found.append([m for m in (on.parse_mark(o.name, d) for o in listed)
                          if m is not None])
        return out, found

    def _total(self, r: Reply) -> int | None:
        """The object's size from a ranged GET's reply."""
        if r.status == 200:
            return len(r.body)
        cr = r.header("content-range") or ""
        total = cr.rpartition("/")[2]
        return int(total) if cr.startswith("bytes ") and total.isdigit() else None

    def _checked_header(self, r: Reply | None, key: bytes, tokens: np.ndarray | None
                        ) -> rv.Header | None:
        if r is None or r.status not in (200, 206):
            self._bad(r)
            return None
        try:
            total = self._total(r)
            if total is None:
                raise rv.BadValue("a ranged reply without the object's size")
            h = rv.checked_header(r.body, total, key, tokens, self.layout)
        except rv.BadValue:
            self.count("bad_values")
            return None
        self.count("found_chunks")
        return h

    def values(self, items: Sequence[tuple[bytes, np.ndarray]]) -> list[np.ndarray | None]:
        return [None if got is None else got[0] for got in self.values_and_headers(items)]

    def values_and_headers(self, items: Sequence[tuple[bytes, np.ndarray]]
                           ) -> list[tuple[np.ndarray, rv.Header] | None]:
        """The verified raw extent of each (key, tokens) with its header (None where absent
        or unusable): ranged GETs of at most the size a value of those tokens can have, in
        parallel."""
        lay = self.layout
        caps = [rv.max_value_bytes(len(t), lay) for _, t in items]

        def verify(i: int, r: Reply) -> tuple[np.ndarray, rv.Header] | Reply | rv.BadValue:
            """In the worker: the verified, decoded extent; the reply if it is not one."""
            if r.status not in (200, 206):
                return r
            k, t = items[i]
            try:
                total = self._total(r)
                if total != len(r.body):
                    raise rv.BadValue(f"an object of {total} bytes; a value of these tokens "
                                      f"has at most {len(r.body)}")
                h = rv.checked_header(r.body, total, k, t, lay)
                return rv.decode(h, r.body), h
            except rv.BadValue as e:
                return e

        got = self._requests([self._ranged(on.value_name(self._prefix, k), 0, cap - 1)
                              for (k, _), cap in zip(items, caps, strict=True)], then=verify)
        out: list[tuple[np.ndarray, rv.Header] | None] = []
        used = []
        for (k, _), g in zip(items, got, strict=True):
            if isinstance(g, tuple):
                out.append(g)
                used.append(k)
                self.count("fetched_chunks")
                continue
            if isinstance(g, rv.BadValue):
                self.count("bad_values")
            else:
                self._bad(g)
            out.append(None)
        self._renew(used)
        return out

    def layers(self, items: Sequence[tuple[bytes, rv.Header]], layers: Sequence[int]
               ) -> dict[int, list[np.ndarray | None]]:
        """The verified raw bytes of each of ``layers`` of each (key, header): one ranged GET
        per chunk of each run of consecutive layers (their payloads lie next to each other),
        in parallel, each layer verified and decoded in the worker that fetched it (layer ->
        one entry per item, None where unusable)."""
        runs: list[list[int]] = []
        for layer in sorted(set(layers)):
            if runs and runs[-1][-1] == layer - 1:
                runs[-1].append(layer)
            else:
                runs.append([layer])
        pairs = [(i, run) for run in runs for i in range(len(items))]
        reqs = []
        for i, run in pairs:
            a, b = items[i][1].layer_range(run[0])[0], items[i][1].layer_range(run[-1])[1]
            reqs.append(self._ranged(on.value_name(self._prefix, items[i][0]), a, b))

        def verify(j: int, r: Reply) -> list[np.ndarray | None] | Reply:
            """In the worker: each layer of the run, verified and decoded (None: refused)."""
            i, run = pairs[j]
            h = items[i][1]
            if r.status != 206 or len(r.body) != h.layer_range(run[-1])[1] + 1 \
                    - h.layer_range(run[0])[0]:
                return r
            base, parts = h.layer_range(run[0])[0], []
            for layer in run:
                a, b = h.layer_range(layer)
                try:
                    parts.append(rv.decode_layer(h, layer, memoryview(r.body)[a - base:b + 1
                                                                              - base]))
                except rv.BadValue:
                    parts.append(None)
            return parts

        got = self._requests(reqs, then=verify)
        out: dict[int, list[np.ndarray | None]] = {layer: [] for layer in layers}
        for (_, run), g in zip(pairs, got, strict=True):
            if isinstance(g, list):  # fetched: each layer verified on its own
                bad = sum(p is None for p in g)
                self.count("bad_values", bad)
                self.count("fetched_layers", len(g) - bad)
            else:  # failed, absent, or not the range asked for
                self._bad(g)
                g = [None] * len(run)
            for layer, part in zip(run, g, strict=True):
                out[layer].append(part)
        return out

    def probe(self, found: Sequence[tuple[bytes, rv.Header]]) -> None:
        """Estimate the link's bandwidth from these values' payloads: parallel ranged GETs of
        growing total size (from ``PROBE_START`` bytes, x4, up to ``probe_bytes``) until one
        round takes ``PROBE_ENOUGH_S``."""
        size = min(PROBE_START, self.cfg.probe_bytes)
        self.count("probes")
        nbytes, dt = 0, 0.0
        while True:
            reqs, left = [], size
            for key, h in found:
                if left <= 0:
                    break
                b = min(h.value_bytes, h.size + left) - 1
                reqs.append(self._ranged(on.value_name(self._prefix, key), h.size, b))
                left -= b + 1 - h.size
            t0 = time.perf_counter()
            got = self._requests(reqs, observe=False)
            dt = time.perf_counter() - t0
            nbytes = sum(len(r.body) for r in got if r is not None and r.status == 206)
            if not nbytes or dt >= PROBE_ENOUGH_S or size >= self.cfg.probe_bytes or left > 0:
                break
            size = min(size * 4, self.cfg.probe_bytes)
        if nbytes:
            lat = self.estimate.latency_s or 0.0
            self.estimate.observe(nbytes, max(dt - lat, dt / 2), probe=True)

    # ------------------------------------------------------------------ writes
    def exists(self, keys: Sequence[bytes]) -> list[bool | None]:
        """Whether each key's value is in the bucket (None: no answer). Found ones are
        renewed."""
        replies = self._requests([("HEAD", on.value_name(self._prefix, k),
                                   {"max_bytes": SMALL}) for k in keys], background=True)
        out = [None if r is None or r.status not in (200, 404) else r.status == 200
               for r in replies]
        self._renew([k for k, e in zip(keys, out, strict=True) if e])
        return out

    def put(self, items: Sequence[tuple[bytes, bytes]],
            kids: Sequence[tuple[bytes, bytes, np.ndarray]] = ()) -> list[bool | None]:
        """Write each (key, value) unless it is there (``If-None-Match: *``): True stored,
        False already there, None not sent. ``kids``: (parent, key, tokens) of partial chunks
        whose entries are written after their values, so a longer prompt finds them."""
        p = self._prefix
        replies = self._requests([("PUT", on.value_name(p, k),
                                   {"body": v, "headers": {"if-none-match": "*"},
                                    "max_bytes": SMALL}) for k, v in items], observe=False,
                                 background=True)
        out: list[bool | None] = []
        for r in replies:
            out.append(None if r is None else True if 200 <= r.status < 300
                       else False if r.status in (409, 412) else None)
        self._renew([k for (k, _), ok in zip(items, out, strict=True) if ok is False])
        stored = {k for (k, _), ok in zip(items, out, strict=True) if ok is not None}
        self._requests([("PUT", on.kid_name(p, parent, key, toks),
                         {"max_bytes": SMALL}) for parent, key, toks in kids if key in stored],
                       observe=False, background=True)
        return out

    def delete(self, keys: Sequence[bytes],
               kids: Sequence[tuple[bytes, bytes, np.ndarray]] = ()) -> list[bool | None]:
        """``DELETE`` each key's value and use marker: True deleted (S3 answers a delete of
        an absent object as a success too), False absent, None not answered. ``kids``: (parent, key,
        tokens) of partial chunks whose entries under their parent go too."""
        p = self._prefix
        with self._lock:
            for k in keys:
                self._renewed.pop(k, None)
        replies = self._requests(
            [("DELETE", on.value_name(p, k), {"max_bytes": SMALL}) for k in keys]
            + [("DELETE", on.use_name(p, k), {"max_bytes": SMALL}) for k in keys]
            + [("DELETE", on.kid_name(p, parent, key, toks), {"max_bytes": SMALL})
               for parent, key, toks in kids], observe=False)
        return [None if r is None else True if 200 <= r.status < 300
                else False if r.status == 404 else None for r in replies[:len(keys)]]

    def put_marks(self, items: Sequence[tuple[bytes, marks.Mark]]) -> int:
        """Write the entry of each (parent, mark) (an empty object); how many were written."""
        got = self._requests([("PUT", on.mark_name(self._prefix, parent, m),
                               {"max_bytes": SMALL}) for parent, m in items], observe=False,
                             background=True)
        return sum(r is not None and 200 <= r.status < 300 for r in got)

    def delete_marks(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Delete every mark entry naming ``key`` under ``parent``, for each (parent, key): a
        listing per parent, then a ``DELETE`` of each entry that names it; how many went."""
        p = self._prefix
        lists = self._requests([("GET", None, {
            "query": {"list-type": "2", "max-keys": "1000", "prefix": on.marks_dir(p, parent)},
            "max_bytes": LIST_BYTES}) for parent, _ in items], observe=False)
        names = [o.name for (parent, key), r in zip(items, lists, strict=True)
                 if r is not None and r.status == 200
                 for o in on.parse_listing(r.body).objects
                 if (m := on.parse_mark(o.name, on.marks_dir(p, parent))) is not None
                 and m.key == key]
        got = self._requests([("DELETE", n, {"max_bytes": SMALL}) for n in names],
                             observe=False)
        return sum(r is not None and 200 <= r.status < 300 for r in got)

    # ------------------------------------------------------------------ lifecycle
    def _renew(self, keys: Sequence[bytes]) -> None:
        """Queue the use markers of these values (those this process did not renew within a
        quarter of ``ttl_s``); never waits."""
        now = time.monotonic()
        fresh = []
        with self._lock:
            for k in keys:
                t = self._renewed.get(k)
                if t is None or now - t > self.cfg.ttl_s / 4:
                    self._renewed[k] = now
                    self._renewed.move_to_end(k)
                    fresh.append(k)
            while len(self._renewed) > RENEWED:
                self._renewed.popitem(last=False)
        for k in fresh:
            if not self._renewals.offer(k):
                self.count("renew_dropped")

    def _renew_batch(self, keys: list[bytes]) -> None:
        with self.deadline():
            got = self._requests([("PUT", on.use_name(self._prefix, k), {"max_bytes": SMALL})
                                  for k in keys], observe=False, background=True)
        self.count("renewed", sum(r is not None and 200 <= r.status < 300 for r in got))

    def sweep(self) -> lifecycle.SweepReport:
        """Delete what is unused for ``ttl_s`` and what is beyond ``max_bytes`` (see
        :mod:`kvstore.tiers.objects.lifecycle`)."""
        assert self._client is not None
        report = lifecycle.sweep(self._client, self._prefix, ttl_s=self.cfg.ttl_s,
                                 max_bytes=self.cfg.max_bytes, deadline_s=self.cfg.deadline_s,
                                 stop=self._stop, on_deleted=self.on_swept)
        with self._lock:
            self.counters.sweeps += 1
            self.counters.swept_objects += report.deleted_objects
            self.counters.swept_bytes += report.deleted_bytes
            self.last_sweep = report
        return report

    def _sweep_loop(self) -> None:
        interval = self.cfg.sweep_interval_s
        assert interval is not None
        while not self._stop.wait(interval):
            if self.breaker.state != "closed":
                continue
            try:
                self.sweep()
            except (S3Error, lifecycle.SweepFailed) as e:  # shown in stats(); next interval
                with self._lock:
                    self.last_sweep_error = f"{type(e).__name__}: {e}"[:300]

    def stats(self) -> dict[str, object]:
        with self._lock:
            c = asdict(self.counters)
            last = None if self.last_sweep is None else asdict(self.last_sweep)
            err = self.last_sweep_error
        b = self.breaker.stats()
        return {"url": self.cfg.shown, **c, "link": self.estimate.stats(),
                "breaker": b["state"], "breaker_stats": b, "last_sweep": last,
                "last_sweep_error": err, "renew_queue": self._renewals.pending}


def _reply_bytes(got: object) -> int:
    """Payload bytes a request received: a reply's body, a verified extent or layers."""
    if isinstance(got, Reply):
        return len(got.body) if got.status in (200, 206) else 0
    if isinstance(got, tuple):
        return got[0].nbytes
    if isinstance(got, list):
        return sum(p.nbytes for p in got if p is not None)
    return 0


def _error_code(r: Reply) -> str:
    """The ``<Code>`` of an S3 error document, for messages (untrusted: short, printable)."""
    body = r.body[:4096]
    a, b = body.find(b"<Code>"), body.find(b"</Code>")
    code = body[a + 6:b].decode("ascii", "replace") if 0 <= a < b else ""
    return "".join(ch for ch in code if ch.isalnum())[:64]
