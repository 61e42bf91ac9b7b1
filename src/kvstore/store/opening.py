"""Opening a store directory: the lock, the format checks, repair, and the assembled parts.

An opener that finds the store unused by any other process (it holds it *alone* while it sets
up) may create it, upgrade its format, change its disk budget, resize segment files, and repair
everything a crash left: reservations of dead processes, contexts whose chunks are missing or
corrupt, orphan chunks, index directories without an entry and staging leftovers. An opener
that joins processes already using the store repairs only what is provably dead (reservations
of processes that are gone, records no process can still be writing), and must agree with them
on the settings they share (``disk_bytes``, ``chunk_tokens``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
from collections.abc import Iterator, Mapping
from dataclasses import replace

from kvstore.codecs import layer_codec
from kvstore.config import StoreConfig
from kvstore.errors import CorruptData, FormatError, LayoutMismatch, StoreTampered
from kvstore.events.config import EventsConfig
from kvstore.eviction.policies import make_policy
from kvstore.format.catalog import CATALOG, DATA_FILE, FORMAT_VERSION, Catalog
from kvstore.format.directory import Dir, UnsafePath
from kvstore.format.open_lock import DirLock, acquire
from kvstore.format.readahead import Readahead
from kvstore.format.writer_registry import PROCS, Owner, collect_dead
from kvstore.index.lifecycle import INDEXES, IndexFiles
from kvstore.layout import KVLayout
from kvstore.pipelines.saving import physical_memory
from kvstore.residency.catch_up import Mirror, gc_paused
from kvstore.residency.core import Core
from kvstore.residency.counters import Counters
from kvstore.store.facade import Store
from kvstore.threads.fork_join import Helpers
from kvstore.tiers.disk import SEGMENTS, SegmentFiles, SegmentGeometry
from kvstore.tiers.dram import DramTier
from kvstore.tiers.objects.config import ObjectsConfig
from kvstore.tiers.objects.tier import ObjectTier
from kvstore.tiers.output_pool import OutputPool
from kvstore.tiers.remote.config import RemoteConfig
from kvstore.tiers.remote.tier import RemoteTier
from kvstore.view.disk_slots import SlotAllocator
from kvstore.view.prefix_tree import ContextTree
from kvstore.view.recovery import RecoveryPlan
from kvstore.view.recovery import apply as apply_recovery
from kvstore.view.recovery import plan as recovery_plan

BUFFER_POOL_BYTES = 512 << 20  # idle host memory kept for get() results and save buffers

log = logging.getLogger("kvstore")


def _warn_beyond_device(path: str, config: StoreConfig) -> None:
    """Log a warning when the disk budget is more than the device can give the store (its
    free space and what the store's segment files take already): puts fail with
    CapacityError once the device is full, long before the budget is."""
    segs = os.path.join(path, SEGMENTS)
    try:
        free = shutil.disk_usage(path).free
        used = 0 if os.path.islink(segs) else sum(
            e.stat(follow_symlinks=False).st_blocks * 512 for e in os.scandir(segs)
            if e.is_file(follow_symlinks=False))
    except OSError:
        return
    if config.disk_bytes > free + used:
        log.warning("kvstore: disk_bytes=%d for %s is more than its device can give it (%d "
                    "bytes free, %d in the store's segments): puts fail with CapacityError "
                    "when the device is full", config.disk_bytes, path, free, used)


def open_store(path: str | os.PathLike[str], *, layout: KVLayout | None = None,
               dram_bytes: int | None = None, disk_bytes: int | None = None,
               hbm_bytes: int | None = None, write_buffer_bytes: int | None = None,
               chunk_tokens: int | None = None, policy: str | None = None,
               codecs: Mapping[str, str] | None = None, slot_codec: str | None = None,
               readonly: bool = False, exclusive: bool = False,
               remote: str | list[str] | tuple[str, ...] | RemoteConfig | None = None,
               objects: str | ObjectsConfig | None = None,
               pin_namespace_fraction: float | None = None,
               pin_total_fraction: float | None = None,
               events: EventsConfig | str | None = None) -> Store:
    """Open (or create) the store directory ``path``.

    On creation ``layout`` is required; omitted sizes get the defaults (dram 1 GiB, disk 16 GiB,
    hbm 1 GiB of execution buffers, write buffer 256 MiB, chunk_tokens 256, policy
    "scheduler"). On reopen, ``layout`` and ``chunk_tokens`` may be omitted (stored values are
    used) but must match if given (:class:`LayoutMismatch`); sizes, policy and codecs given
    replace the stored ones.

    ``codecs`` maps a tier to the codec new chunks are stored through on it, e.g.
    ``{"disk": "zstd"}`` (default ``none`` everywhere; see :mod:`kvstore.codecs.layer_codec`). Each
    chunk
    records its codec, so chunks stored under another config are still read right.
    ``slot_codec`` (creation only; default ``none``: slots of a raw chunk's size) sizes the
    disk slots for a fixed-size lossy codec's chunks (``int8``, ``fp8``, ``int4``): the disk
    budget holds that many more chunks, and a context's coded chunks lie next to each other
    (sequential reads). The disk codec must then be one whose chunks fit (ValueError), and a
    chunk that codec cannot take (non-finite values) cannot be stored (ValueError).

    Sharing: any number of processes may open one store at once, all reading and writing; each
    keeps a private DRAM tier and sees the others' committed puts. ``disk_bytes`` can change
    only while no other process has the store open (ValueError otherwise); the other sizes and
    the policy are each process's own. ``exclusive=True`` refuses to open while any other
    process has the store open, and keeps every later opener out (:class:`StoreLocked`).
    ``readonly`` opens a store that must exist and never writes to it; it may share the store
    with readers and writers.

    ``remote``: a shared tier below disk on Redis, ``"redis://[:password@]host:port[/db]"``, a
    list of Redis Cluster node URLs, or a :class:`kvstore.RemoteConfig` (see
    :mod:`kvstore.tiers.remote`). Credentials Redis refuses raise :class:`RemoteAuthError` here; a
    server that does not answer only leaves the tier's breaker open (the store serves from its
    local tiers and retries in the background).

    ``objects``: a shared tier on S3-compatible object storage,
    ``"s3://BUCKET/PREFIX?endpoint=http://HOST:PORT"`` (no endpoint: AWS S3) or a
    :class:`kvstore.ObjectsConfig` (see :mod:`kvstore.tiers.objects`); credentials from
    ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN`` or the URL's
    ``profile=``. Refused credentials raise :class:`ObjectsAuthError` here; an endpoint that
    does not answer only leaves the tier's breaker open. With both, Redis is tried first.

    ``pin_namespace_fraction`` (default 0.25) and ``pin_total_fraction`` (default 0.5): the
    share of the disk tier that one namespace's pinned contexts, and every namespace's
    together, may take (:meth:`Store.pin`; a pin beyond them raises :class:`PinRefused`).
    Persisted like the sizes, replaceable on reopen.

    ``events``: the store publishes KV events in vLLM's format itself (a
    :class:`kvstore.EventsConfig`, or its ZMQ endpoint such as ``"tcp://*:5557"``): what each
    tier gains and loses, by every process of the directory (docs/store.md, "KV events"). One
    process per directory publishes (:class:`StoreLocked` for a second); needs the ``events``
    extra (msgspec, pyzmq).
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.path.expanduser(os.fspath(path))
    if layout is not None and not isinstance(layout, KVLayout):
        raise TypeError(f"layout must be a kvstore.KVLayout, got {type(layout).__name__}")
    given = {k: v for k, v in {
        "dram_bytes": dram_bytes, "disk_bytes": disk_bytes, "hbm_bytes": hbm_bytes,
        "write_buffer_bytes": write_buffer_bytes, "chunk_tokens": chunk_tokens,
        "policy": policy, "codecs": codecs, "slot_codec": slot_codec,
        "pin_namespace_fraction": pin_namespace_fraction,
        "pin_total_fraction": pin_total_fraction}.items() if v is not None}
    asked = StoreConfig(**given)  # type: ignore[arg-type]  # checks them, before any file
    for name, flag in (("readonly", readonly), ("exclusive", exclusive)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if readonly and exclusive:
        raise ValueError("readonly and exclusive cannot both be set")
    events_cfg = None if events is None else EventsConfig.of(events)
    remote_cfg = None if remote is None else RemoteConfig.of(remote)
    objects_cfg = None if objects is None else ObjectsConfig.of(objects)
    if readonly and not os.path.isdir(os.path.join(path, CATALOG)):
        raise FileNotFoundError(f"no kvstore at {path!r}")
    if layout is None and not readonly and _nothing_at(path):
        # nothing created for an open that cannot create (a directory holding anything goes
        # on to the checks below, which say what it holds)
        raise ValueError(f"layout is required to create a new store at {path!r}")
    root = Dir.open_root(path, create=not readonly)
    try:
        lock = acquire(root, exclusive=exclusive, readonly=readonly)
        catalog = None
        try:
            with _catalog_readahead(root):  # the open reads all of a large catalog
                catalog = _open_catalog(root, lock, readonly)
                layout, config = _settle_format(root, catalog, layout, asked, set(given),
                                                lock, readonly)
                store = _assemble(root, catalog, lock, layout, config, readonly)
        except BaseException:
            lock.release()  # first, as Store.close does
            if catalog is not None:
                catalog.close()
            raise
    except BaseException:
        root.close()
        raise
    lock.settle()
    if not readonly:
        _warn_beyond_device(path, config)
    shared: list[tuple[str, RemoteConfig | ObjectsConfig]] = []
    if remote_cfg is not None:
        shared.append(("remote", remote_cfg))
    if objects_cfg is not None:
        shared.append(("objects", objects_cfg))
    for name, cfg in shared:
        try:
            codec = config.tier_codecs.remote_for(cfg.codec) if name == "remote" else cfg.codec
            if store.layout.boundary_state and layer_codec.is_lossy(codec):
                raise ValueError(f"{name} codec {codec!r} is lossy; a layout with "
                                 f"sliding-window or recurrent layers needs a lossless one")
            tier = RemoteTier(replace(cfg, codec=codec), store.layout) if name == "remote" \
                else ObjectTier(replace(cfg, codec=codec), store.layout)
            try:
                tier.connect()
            except BaseException:
                tier.close()
                raise
            store._attach_shared(tier, name)
        except BaseException:
            store.close()
            raise
    if events_cfg is not None:
        try:
            store._publish_events(events_cfg)
        except BaseException:
            store.close()
            raise
    return store


def _nothing_at(path: str) -> bool:
    """Whether ``path`` is absent or an empty directory (not following a symlink)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    if not stat.S_ISDIR(st.st_mode):
        return False
    try:
        with os.scandir(path) as it:
            return next(it, None) is None
    except OSError:
        return False


@contextlib.contextmanager
def _catalog_readahead(root: Dir) -> Iterator[None]:
    """:class:`~kvstore.format.readahead.Readahead` of the catalog's data file while the
    ``with`` block runs (nothing for a new store, or a catalog directory that is not one: the
    catalog's own checks report it)."""
    try:
        folder = root.sub(CATALOG)
    except (OSError, UnsafePath):
        yield
        return
    try:
        with Readahead(folder, DATA_FILE):
            yield
    finally:
        folder.close()


def _open_catalog(root: Dir, lock: DirLock, readonly: bool) -> Catalog:
    """The catalog, opened by this opener (which holds ``OPENING``). A joiner checks that the
    catalog's lock file is the one the others use (:class:`StoreTampered` otherwise); one that
    finds nobody using it because the others all closed meanwhile is alone after all."""
    try:
        catalog = Catalog(root, readonly=readonly, walk=lock.alone, joining=not lock.alone)
    except StoreTampered:
        if lock.alone or not lock.become_alone():
            raise
        catalog = Catalog(root, readonly=readonly, walk=True, joining=False)
    if catalog.unlocked:
        lock.keep_exclusive()  # read without a lock file: no writer may come in meanwhile
    if not lock.alone:
        lock.settle()  # its environment holds LMDB's lock now: later joiners can check it
    return catalog


def _settle_format(root: Dir, catalog: Catalog, layout: KVLayout | None, asked: StoreConfig,
                   given: set[str], lock: DirLock,
                   readonly: bool) -> tuple[KVLayout, StoreConfig]:
    """The store's layout and this opener's config: ``asked`` where this opener creates the
    store, else the stored config with the fields ``given`` taken from ``asked``. Creates or
    upgrades the catalog when this opener holds the store alone."""
    path = root.path
    try:
        fmt = catalog.get_meta("format")
    except (TypeError, ValueError) as e:
        raise CorruptData(f"the catalog of {path!r} has an unreadable format record: {e}"
                          ) from None
    writable_alone = lock.alone and not readonly
    if fmt is None:
        _refuse_new_over_old(root)
        if readonly:
            raise FormatError(f"{path!r} holds no initialized kvstore")
        if not lock.alone:
            raise FormatError(f"{path!r} is being created by another process; open it again "
                              f"once that process has opened it")
        if layout is None:
            raise ValueError(f"layout is required to create a new store at {path!r}")
        config = asked
        config.check_budget(layout)
        with catalog.write() as txn:
            txn.put_meta("layout", layout.to_dict())
            txn.put_meta("config", config.to_dict())
            txn.put_meta("clock", 0)
            txn.put_meta("format", FORMAT_VERSION)  # last: marks the store initialized
        return layout, config
    if fmt == 1:
        if not writable_alone:
            raise FormatError(f"store {path!r} has format 1; open it for writing, with no other "
                              f"process using it, once to upgrade it to format {FORMAT_VERSION}")
        catalog.migrate_v1()
    elif fmt != FORMAT_VERSION:
        raise FormatError(f"store format {fmt!r} is not supported (expected {FORMAT_VERSION})")
    try:
        stored = KVLayout.from_dict(catalog.get_meta("layout"))  # type: ignore[arg-type]
        stored_cfg = StoreConfig.from_dict(catalog.get_meta("config"))
    except (TypeError, ValueError, KeyError) as e:
        raise FormatError(f"store metadata at {path!r} is invalid: {e}") from None
    if layout is not None and layout != stored:
        raise LayoutMismatch(f"store at {path!r} holds KV of another model or engine setup "
                             f"(stored vs asked: {stored.differences(layout)})")
    if "chunk_tokens" in given and asked.chunk_tokens != stored_cfg.chunk_tokens:
        raise LayoutMismatch(f"store at {path!r} uses chunk_tokens={stored_cfg.chunk_tokens}, "
                             f"not {asked.chunk_tokens}")
    if "slot_codec" in given and asked.slot_codec != stored_cfg.slot_codec:
        raise LayoutMismatch(f"store at {path!r} has disk slots sized for "
                             f"slot_codec={stored_cfg.slot_codec!r}, not {asked.slot_codec!r} "
                             f"(fixed at creation)")
    if not lock.alone and "disk_bytes" in given and asked.disk_bytes != stored_cfg.disk_bytes:
        raise ValueError(f"disk_bytes={asked.disk_bytes} differs from the store's "
                         f"{stored_cfg.disk_bytes}, and other processes have {path!r} open: the "
                         f"disk budget can change only when no other process uses the store")
    config = replace(stored_cfg, **{k: getattr(asked, k) for k in given})
    config.check_budget(stored)
    if config != stored_cfg and writable_alone:
        with catalog.write() as txn:
            txn.put_meta("config", config.to_dict())
    return stored, config


def _refuse_new_over_old(root: Dir) -> None:
    """An empty catalog means a new store only in a directory that holds no store data: one
    with segment files, index directories or owner files lost its catalog (or had it
    damaged), and a new store must not start over the old data."""
    for name in (SEGMENTS, INDEXES):
        st = root.lstat(name)
        if st is None:
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafePath(f"{root.show(name)!r} is not the store's own directory")
        with root.sub(name) as d:
            if d.listdir():
                raise CorruptData(
                    f"the catalog of {root.path!r} records no store, but {root.show(name)!r} "
                    f"holds data: the catalog is lost or damaged; refusing to start a new "
                    f"store over it (move the directory away to start afresh)")


def _assemble(root: Dir, catalog: Catalog, lock: DirLock, layout: KVLayout,
              config: StoreConfig, readonly: bool) -> Store:
    path = root.path
    policy = make_policy(config.policy)
    if config.dram_bytes > physical_memory():
        raise ValueError(f"dram_bytes={config.dram_bytes} is more than this machine's memory "
                         f"({physical_memory()} bytes); give a smaller dram_bytes")
    geo = config.segment_geometry(layout)
    counters = Counters()
    tree = ContextTree(fingerprint=layout.fingerprint, chunk_tokens=config.chunk_tokens,
                       priority=lambda rec: 0.0)  # the store sets the policy's priority
    slots = SlotAllocator(geo.total_slots)
    dram = DramTier(capacity_bytes=config.dram_bytes, slot_bytes=config.slot_bytes(layout),
                    policy=policy)  # chunks decoded, or as stored
    mirror = Mirror(catalog=catalog, tree=tree, slots=slots, dram=dram, counters=counters)
    segments = SegmentFiles(root, geo, readonly=readonly)
    files = None
    owner = None
    repaired = None
    try:
        with gc_paused():  # one pass of the collector over what the repair and load made
            files = IndexFiles(root, readonly=readonly)
            if not readonly:
                procs = root.sub(PROCS, create=True)
                try:
                    if lock.alone:
                        repaired = _repair_alone(root, procs, catalog, segments, files, geo,
                                                 layout, config, counters)
                    owner = Owner(root, procs)
                except BaseException:
                    procs.close()
                    raise
            core = Core(path=path, root=root, layout=layout, config=config, readonly=readonly,
                        geo=geo, catalog=catalog, segments=segments, tree=tree, slots=slots,
                        dram=dram, mirror=mirror, counters=counters,
                        helpers=Helpers(2, "kvstore-io"),
                        buffers=OutputPool(BUFFER_POOL_BYTES), owner=owner)
            if not readonly and not lock.alone:
                core.rejoin()
            store = Store(core, lock=lock, policy=policy, files=files)
            core.load(repaired)  # an opener alone loads what its repair kept
            store.restore_policy_state()
    except BaseException:
        segments.close()
        if files is not None:
            files.close()
        if owner is not None:
            owner.close()
            owner.dir.close()
        raise
    return store


def _repair_alone(root: Dir, procs: Dir, catalog: Catalog, segments: SegmentFiles,
                  files: IndexFiles, geo: SegmentGeometry, layout: KVLayout, config: StoreConfig,
                  counters: Counters) -> RecoveryPlan:
    """Repair what crashes left, with no other process using the store. Returns the
    recovery plan it applied (its kept records are what the catalog now holds)."""
    present = segments.existing()
    layer_token_bytes = layout.layer_token_bytes

    def extent_end(rec):
        seg, off = geo.locate(rec.slot)
        return seg, off + rec.stored_bytes(rec.n_tokens * layer_token_bytes)

    with catalog.write() as txn:
        stale = txn.reservations()  # every owner is gone: nobody else has the store open
        for r in stale:
            txn.delete_reservation(r.key)
        counters.reclaimed_reservations += len(stale)
        chunks = txn.chunk_map()
        contexts = txn.context_map(chunks)
        p = recovery_plan(chunks, contexts, total_slots=geo.total_slots, extent_end=extent_end,
                          segment_sizes=present, chunk_tokens=config.chunk_tokens)
        apply_recovery(p, txn)
        entries = list(txn.indexes())
        indexed = {e.dirname(k) for k, e in entries if k in p.keep_contexts}
        for k, e in entries:
            if e.dirname(k) not in indexed:
                txn.delete_index(k)
        counters.malformed_records += txn.delete_malformed()
    counters.corrupt_chunks += p.bad_chunks
    counters.dropped_contexts += len(p.dropped)
    counters.evicted_contexts += len(p.evicted)
    counters.collected_orphans += len(p.orphans)
    counters.collected_indexes += files.collect(indexed)
    collect_dead(root, procs)
    # Segment files are created lazily on first write; existing ones of the wrong size
    # (truncated, or the budget changed) are resized now; files beyond the budget go.
    for seg, size in present.items():
        if seg >= geo.num_segments:
            segments.remove(seg)
        elif size == geo.segment_size(seg):
            segments.mark_ready(seg)
        else:
            segments.prepare(seg)
    return p
