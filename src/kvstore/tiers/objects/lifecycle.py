"""What no store uses any more leaves the bucket: a time-to-live renewed on use, and a cap.

Many stores on many machines write one prefix, and none knows what the others still need. The
rule therefore needs nobody's inventory: **a value is kept while it was used within ``ttl_s``**.
Its last use is the later of its own write time and its use marker's (``u/<key>``, rewritten
by every store that fetches the value, or finds it there when writing it, at most every
quarter of ``ttl_s`` per process). Times are the service's own (``LastModified``, and its
``Date`` header as "now"), so machines' clocks do not matter. Since a process rewrites a marker
at most every quarter of ``ttl_s``, a value used within the last three quarters of ``ttl_s`` is
never deleted; one unused for ``ttl_s`` may be, and is recomputed (a miss, never wrong bytes)
if it returns. Partial-chunk entries and boundary marks whose value is gone are deleted with
it.

``ttl_s`` 0 (an operator's "everything now", :func:`sweep_objects`): every value the listing
finds counts as unused now and is deleted, with its markers, entries and marks; a store that
uses one afterwards misses and recomputes it.

``max_bytes`` caps the values' bytes under the prefix: after the TTL, a sweep deletes the least
recently used values until the rest fit.

A sweep lists the prefix (pages of 1,000), then deletes; any store may run one, and several at
once only delete the same objects twice. :func:`sweep` is what a store's background sweeper
and ``kvstore objects sweep`` run.

Thread-safety: :func:`sweep` may run in any thread; it shares nothing but the client.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from kvstore.tiers.objects import names as on
from kvstore.tiers.objects.config import ObjectsConfig
from kvstore.tiers.objects.s3 import S3Client, S3Error

LIST_BYTES = 4 << 20
MAX_PAGES = 10_000  # 10 million objects (a few GB of listing in memory): a listing that
# never ends is a hostile service, and a prefix that large wants sweeping by prefix parts
DELETERS = 8


class SweepFailed(Exception):
    """A sweep could not list the prefix (nothing was deleted on a partial listing)."""


@dataclass(frozen=True, slots=True)
class SweepReport:
    listed_objects: int
    deleted_objects: int
    deleted_bytes: int
    kept_values: int
    kept_bytes: int
    delete_errors: int
    seconds: float


def _list(client: S3Client, prefix: str, deadline_s: float, stop: threading.Event | None
          ) -> tuple[list[on.Listed], float]:
    """Every object under ``prefix``, and the service's time at the listing's start."""
    out: list[on.Listed] = []
    token: str | None = None
    now: float | None = None
    for _ in range(MAX_PAGES):
        if stop is not None and stop.is_set():
            raise SweepFailed("the store is closing")
        q = {"list-type": "2", "prefix": prefix, "max-keys": "1000"}
        if token:
            q["continuation-token"] = token
        r = client.request("GET", None, query=q, max_bytes=LIST_BYTES,
                           expires=time.monotonic() + deadline_s)
        if r.status == 404 and b"NoSuchBucket" in r.body:  # nothing was ever written
            return [], on.http_date(r.header("date")) or time.time()
        if r.status != 200:
            raise SweepFailed(f"listing {prefix!r} answered HTTP {r.status}")
        if now is None:
            now = on.http_date(r.header("date")) or time.time()
        page = on.parse_listing(r.body)
        out += page.objects
        token = page.next_token
        if token is None:
            return out, now
    raise SweepFailed(f"listing {prefix!r} did not end after {MAX_PAGES} pages")


def sweep(client: S3Client, prefix: str, *, ttl_s: float, max_bytes: int | None,
          deadline_s: float, stop: threading.Event | None = None,
          as_of: float | None = None,
          on_deleted: Callable[[list[bytes]], None] | None = None) -> SweepReport:
    """Delete the values under ``prefix`` unused for ``ttl_s`` (and their markers and
    partial-chunk entries; ``ttl_s`` 0: every value listed), then the least recently used
    beyond ``max_bytes``. ``as_of``:
    the time (seconds since the epoch) the ages are taken at; default the service's clock at
    the listing. ``on_deleted``: given the chain keys of the values deleted (KV events)."""
    t0 = time.perf_counter()
    try:
        listed, now = _list(client, prefix, deadline_s, stop)
    except S3Error as e:
        raise SweepFailed(f"listing {prefix!r} failed: {e}") from None
    if as_of is not None:
        now = as_of
    vdir, udir, kdir, bdir = f"{prefix}v/", f"{prefix}u/", f"{prefix}k/", f"{prefix}b/"
    values: dict[bytes, on.Listed] = {}
    used: dict[bytes, float] = {}
    marker_name: dict[bytes, str] = {}
    kid_entries: list[tuple[on.Listed, bytes]] = []
    for obj in listed:
        if (k := on.key_of(obj.name, vdir)) is not None:
            values[k] = obj
        elif (k := on.key_of(obj.name, udir)) is not None:
            used[k] = max(used.get(k, 0.0), obj.modified)
            marker_name[k] = obj.name
        elif obj.name.startswith(kdir):
            parent_dir = obj.name[:obj.name.rfind("/") + 1]
            kid = on.parse_kid(obj.name, parent_dir)
            if kid is not None:
                kid_entries.append((obj, kid[2]))
        elif obj.name.startswith(bdir):  # a boundary's mark goes with its chunk's value
            mark = on.parse_mark(obj.name, obj.name[:obj.name.rfind("/") + 1])
            if mark is not None:
                kid_entries.append((obj, mark.key))
    def unused(t: float) -> bool:  # the service's clock ticks in seconds: ttl 0 is "all"
        return ttl_s == 0 or now - t > ttl_s

    last = {k: max(v.modified, used.get(k, 0.0)) for k, v in values.items()}
    doomed = {k for k, t in last.items() if unused(t)}
    kept = sorted((t, k) for k, t in last.items() if k not in doomed)
    kept_bytes = sum(values[k].size for _, k in kept)
    if max_bytes is not None:
        for _, k in kept:
            if kept_bytes <= max_bytes:
                break
            doomed.add(k)
            kept_bytes -= values[k].size
    gone = list(doomed)
    names: list[tuple[str, int]] = [(values[k].name, values[k].size) for k in gone]
    names += [(marker_name[k], 0) for k in used if (k in doomed or k not in values)
              and unused(used[k])]
    names += [(obj.name, 0) for obj, key in kid_entries if key in doomed
              or (key not in values and unused(obj.modified))]

    def delete(item: tuple[str, int]) -> tuple[bool, int]:
        if stop is not None and stop.is_set():
            return False, 0
        try:
            r = client.request("DELETE", item[0], max_bytes=0,
                               expires=time.monotonic() + deadline_s)
        except S3Error:
            return False, 0
        return 200 <= r.status < 300 or r.status == 404, item[1]

    with ThreadPoolExecutor(DELETERS, thread_name_prefix="kvstore-objects-delete") as pool:
        results = list(pool.map(delete, names))
    deleted = sum(ok for ok, _ in results)
    if on_deleted is not None:
        on_deleted([k for k, (ok, _) in zip(gone, results, strict=False) if ok])
    return SweepReport(listed_objects=len(listed), deleted_objects=deleted,
                       deleted_bytes=sum(n for ok, n in results if ok),
                       kept_values=len(values) - len(doomed), kept_bytes=kept_bytes,
                       delete_errors=len(results) - deleted,
                       seconds=time.perf_counter() - t0)


def sweep_objects(objects: str | ObjectsConfig, *, ttl_s: float | None = None,
                  max_bytes: int | None = None) -> SweepReport:
    """Sweep an object tier's prefix once, without a store (an operator's periodic job):
    values unused for ``ttl_s`` seconds (default: the config's; 0: every value, "sweep
    everything unused now"), then the least recently used beyond ``max_bytes`` (default:
    the config's cap). ValueError naming ``ttl_s`` for a negative, NaN or infinite one."""
    ttl = None if ttl_s is None else check_sweep_ttl(ttl_s)
    cfg = ObjectsConfig.of(objects)
    if max_bytes is not None:
        cfg = replace(cfg, max_bytes=max_bytes)
    client = cfg.client()
    try:
        return sweep(client, cfg.prefix, ttl_s=cfg.ttl_s if ttl is None else ttl,
                     max_bytes=cfg.max_bytes, deadline_s=cfg.deadline_s)
    finally:
        client.close()


def check_sweep_ttl(ttl_s: object) -> float:
    """``ttl_s`` of one sweep: a finite number of seconds >= 0 (0: every value)."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float):
        raise TypeError(f"ttl_s must be a number of seconds, got {type(ttl_s).__name__}")
    try:
        ttl = float(ttl_s)
    except OverflowError:
        ttl = math.inf
    if not math.isfinite(ttl) or ttl < 0:
        raise ValueError(f"ttl_s must be a finite number of seconds >= 0 (0: every value "
                         f"not in use now), got {ttl_s!r}")
    return ttl
