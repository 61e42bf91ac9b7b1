"""The put pipeline and its commit order.

1. **Plan** (one catalog write transaction, :mod:`kvstore.residency.plans`): reclaim the
   reservations of dead processes, catch up with the catalog, resolve what is stored already,
   evict whole contexts (policy order) until enough disk slots are free, and record a
   *reservation*: the slots this put will write and the stored chunks it reuses (which no
   process may free meanwhile). Disk budget is hard across processes because slots are only
   ever taken inside a write transaction.
2. **Write** (no lock, this module): the new extents go into the reserved slots and are made
   durable (``fdatasync``), while this thread computes checksums and fills DRAM copies.
3. **Commit** (one catalog write transaction, :mod:`kvstore.residency.plans`): the chunk
   records and the context record become visible together and the reservation is deleted. A
   chunk another process committed in the meantime is not stored twice (its slot goes back).
   Contexts that are strict prefixes of this one are superseded.

A crash at any instant is safe: extent bytes are durable before the commit that points to them;
freed slots are reserved (and written) only in transactions after the one that freed them; a
dead process's reservation points to no record and is reclaimed by the survivors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import wait
from contextlib import contextmanager

import numpy as np
import torch

from kvstore.codecs import layer_codec
from kvstore.format import chunk_extent
from kvstore.format.records import ChunkRecord
from kvstore.index.lifecycle import IndexFiles
from kvstore.residency.core import Core
from kvstore.residency.plans import BYPASSED, Plans, PutPlan


class Writer:
    """Puts, from any thread (several at once: their IO runs in parallel)."""

    def __init__(self, core: Core, plans: Plans, files: IndexFiles,
                 on_commit: Callable[[], None]) -> None:
        self.core = core
        self._plans = plans
        self._files = files
        self._on_commit = on_commit  # after each commit (the prefetcher looks again)

    def wait_idle(self) -> None:
        """Block until no put is writing (they hold no lock while they do)."""
        self._plans.wait_idle()

    # ------------------------------------------------------------------ put
    def put(self, toks: np.ndarray, kr: np.ndarray, vr: np.ndarray, namespace: str | None,
            base: int = 0, *, learn: bool = True) -> bool:
        """Store ``toks`` given raw KV kr/vr [L, H, T - base, D] of tokens [base, T). Returns
        False if the policy's admission refused it (nothing written, nothing evicted), True
        once it is stored (or was already). ``learn``: a save that a learning policy counts as
        its conversation's new turn (False: a copy of a context from elsewhere, a remote fill,
        which teaches nothing)."""
        self._check_codable(toks, kr, vr, base)
        with self.core.turns.put(), self._planned(toks, namespace, base, learn) as plan:
            if plan is BYPASSED:
                return False
            if isinstance(plan, PutPlan):
                self._plans.check_new_segments(list(plan.reservation.slots))
                self.core.segments.ensure_ready(list(plan.reservation.slots))
                self._write_extents(plan, kr, vr, base)
                self._commit(plan)
        return True

    def _check_codable(self, toks: np.ndarray, kr: np.ndarray, vr: np.ndarray,
                       base: int) -> None:
        """Where disk slots are sized for a lossy codec (``slot_codec``), a chunk that codec
        cannot take (non-finite values) and whose raw extent does not fit a slot cannot be
        stored: ValueError naming its tokens, before the put plans anything (evicts, stages
        or reserves)."""
        core = self.core
        codec, c = core.config.disk_codec, core.config.chunk_tokens
        if not core.config.tier_codecs.refuses_uncodable:
            return
        dtype = core.layout.torch_dtype
        for a in range(base // c * c, len(toks), c):
            n = min(c, len(toks) - a)
            if core.raw_bytes(n) <= core.geo.slot_stride:
                continue  # stored raw if it must be
            lo = max(a, base) - base
            for x in (kr, vr):  # [L, H, T - base, D] raw integer views
                if not torch.from_numpy(x[:, :, lo : a + n - base]).view(dtype).isfinite().all():
                    raise ValueError(
                        f"tokens {a}..{a + n - 1} hold non-finite KV values, which "
                        f"codecs['disk']={codec!r} cannot encode, and this store's disk slots "
                        f"(slot_codec={core.config.slot_codec!r}) cannot hold them raw; "
                        f"nothing was stored")

    @contextmanager
    def _planned(self, toks: np.ndarray, namespace: str | None, base: int, learn: bool = True
                 ) -> Iterator[PutPlan | object | None]:
        """A put's plan (None: nothing to write; BYPASSED: admission refused it), whose
        reservation, holds, DRAM staging and in-flight marks are released when the block ends,
        however it ends: a plan that did not commit is aborted (its reservation deleted, its
        slots free again)."""
        plan = self._plans.plan(toks, namespace, base, learn, self._files.remove)
        if not isinstance(plan, PutPlan):
            yield plan
            return
        try:
            yield plan
        finally:
            self._plans.end(plan)

    # ------------------------------------------------------------------ write
    def _write_extents(self, plan: PutPlan, kr: np.ndarray, vr: np.ndarray, base: int) -> None:
        """Without the lock: write the new extents into the reserved slots and make them
        durable on a helper thread (one pwritev per chunk straight from the caller's arrays,
        then fdatasync), while this thread computes checksums and fills the DRAM copies from
        the same bytes. Fills ``plan.records``.

        With a disk codec, each chunk's layers are encoded first (on this thread) and the
        encoded bytes are written and checksummed; a lossy codec's DRAM copy is the decoded
        chunk (or, with a DRAM codec, the encoded bytes themselves), so every tier serves the
        same values. A chunk the codec cannot take (non-finite
        values for a lossy codec, or encoded bytes larger than a slot) is stored raw (where
        the slots are sized for coded chunks, ``slot_codec``, only one whose raw extent fits:
        :meth:`_check_codable` refused the others)."""
        core = self.core
        lay, c = core.layout, core.config.chunk_tokens
        n_tok = len(plan.toks)
        codec = core.config.disk_codec
        stride = core.geo.slot_stride
        jobs: list[tuple[int, list[np.ndarray]]] = []
        coded: list[list[bytes] | None] = []
        for slot, (_, _, i) in zip(plan.reservation.slots, plan.specs, strict=True):
            n = min(c, n_tok - i * c)
            parts = chunk_extent.pieces(kr, vr, i * c - base, n)
            enc = (None if codec == "none" else
                   chunk_extent.encode_layers(lay, codec, parts, n, stride))
            # _check_codable refused such a chunk before planning
            assert enc is not None or core.raw_bytes(n) <= stride, (i, n)
            coded.append(enc)
            jobs.append((slot, parts if enc is None else
                         [np.frombuffer(b, dtype=np.uint8) for b in enc]))

        def write_all() -> None:
            # One task: buffered writes to one file serialize in the kernel anyway, and two
            # concurrent writers measured slower here.
            for slot, parts in jobs:
                core.segments.write(slot, parts)
            core.segments.sync(list(plan.reservation.slots))

        fut = core.helpers.submit(write_all)
        try:
            for (key, parent, i), (slot, parts), enc in zip(plan.specs, jobs, coded,
                                                             strict=True):
                n, t0 = min(c, n_tok - i * c), i * c - base
                sums = None
                e = plan.staged.get(key)
                if e is not None and core.config.dram_coded:
                    if enc is None:  # kept raw: not the coded copy staged for it
                        self._plans.unstage(plan, key)
                    else:  # the stored bytes, as a read from disk would fill it
                        buf = core.buffer(e)
                        at = 0
                        for b in enc:
                            buf[at : at + len(b)] = np.frombuffer(b, dtype=np.uint8)
                            at += len(b)
                elif e is not None and enc is not None and layer_codec.is_lossy(codec):
                    buf = core.buffer(e)
                    lb = n * lay.layer_token_bytes
                    for layer, b in enumerate(enc):
                        layer_codec.decode(codec, b, chunk_extent.layer_shape(lay, n),
                                      buf[layer * lb : (layer + 1) * lb])
                elif e is not None:
                    ext = chunk_extent.view(lay, core.buffer(e), n)  # [L, 2, H, n, D]
                    np.copyto(ext[:, 0], kr[:, :, t0 : t0 + n])  # [L, H, n, D]
                    np.copyto(ext[:, 1], vr[:, :, t0 : t0 + n])
                    if enc is None:  # one call per layer over the contiguous copy (the
                        # interpreter is free meanwhile: a compute thread beside it is not held)
                        sums = chunk_extent.checksums(core.buffer(e)[: core.raw_bytes(n)],
                                                      lay.num_layers)
                if sums is None:
                    sums = chunk_extent.piece_checksums(parts, lay.num_layers)
                tokens = plan.toks[i * c : i * c + n].copy()
                if enc is None:
                    rec = ChunkRecord(key, parent, n, slot, 0, sums, tokens)
                else:
                    rec = ChunkRecord(key, parent, n, slot, 0, sums, tokens,
                                      layer_codec.codec_id(codec),
                                      np.array([len(b) for b in enc], dtype=np.uint32))
                plan.records.append(rec)
        finally:
            wait([fut])  # the helper is done with the slots before anything reuses them
        fut.result()  # durable (or the IO error, re-raised here)

    # ------------------------------------------------------------------ commit
    def _commit(self, plan: PutPlan) -> None:
        """Make a written plan visible (:meth:`Plans.commit`), then remove the index
        directories of the contexts it superseded."""
        self._files.remove(self._plans.commit(plan))
        self._on_commit()
