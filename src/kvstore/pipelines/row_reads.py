"""Row reads: chosen token positions of one stored context, one layer at a time.

Offloaded sparse decode keeps a context's KV in the store and, each step and layer, reads only
the rows of the tokens it attends. A :class:`RowReader` resolves the context once; each
:meth:`RowReader.read` then gathers rows ``ids[h, j]`` of kv-head ``h`` from the chunks that
hold them:

- a chunk in the DRAM tier: the rows are gathered straight from its verified copy (DRAM copies
  are verified when they enter the tier);
- a chunk on disk, with room in the DRAM tier: its whole extent is read, verified layer by
  layer and cached in DRAM (the get path's rule), so the later layers and steps hit DRAM;
- a chunk on disk without room: only the layer's span is read (K and V of every head: one
  contiguous read) and verified against that layer's checksum before any row is used.

Checksums cover a whole layer of a chunk, so bytes read from disk are never fewer than one
chunk-layer; :attr:`RowReader.stats` counts both the rows moved to the caller and the bytes
read from disk. A chunk that fails its checksum is quarantined and raises
:class:`~kvstore.errors.CorruptData`; a chunk that left the store (or was stored again) since
the reader was made raises KeyError.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from kvstore.format import chunk_extent
from kvstore.pipelines.chunk_reads import copy_layer, fill_copy, read_layer, reading
from kvstore.residency.core import Core

DURING = "this row read"


class RowReader:
    """Reads rows of the stored context of ``toks`` (every token must be stored: KeyError).

    ``stats``: ``rows_bytes`` (K and V bytes handed to the caller), ``disk_bytes`` (bytes read
    from disk), ``dram_chunks`` / ``disk_chunks`` (chunk-layer reads served by each tier),
    ``promoted`` (chunks read whole into DRAM). Thread-safety: :meth:`read` may be called from
    any thread; ``stats`` are updated under the reader's own lock.
    """

    def __init__(self, core: Core, files: object, toks: np.ndarray,
                 namespace: str | None, queued) -> None:
        self._core = core
        self._files = files
        self._queued = queued  # chunk key -> where the job queue next needs it
        self._pieces = core.resolve(toks, namespace)
        self.n_tokens = len(toks)
        self._starts = np.array([p.start for p in self._pieces], dtype=np.int64)  # [P]
        self._lock = threading.Lock()  # over stats
        self.stats = {"rows_bytes": 0, "disk_bytes": 0, "dram_chunks": 0, "disk_chunks": 0,
                      "promoted": 0}

    def read(self, layer: int, ids: object, *, heads: object = None, keys: bool = True,
             values: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Rows ``ids`` [h, r] (int token positions in 0..n_tokens-1; row i for kv-head
        ``heads[i]``, by default every kv-head in order) of layer ``layer``: (k, v), each
        [h, r, D] in the layout dtype (keys pre-RoPE), or None where not asked for."""
        H = self._core.layout.num_kv_heads
        hsel = np.arange(H) if heads is None else np.asarray(heads)
        if hsel.dtype.kind not in "iu" or hsel.ndim != 1 or not len(hsel):
            raise ValueError(f"heads must be a non-empty list of kv-heads in 0..{H - 1}, got "
                             f"{heads!r}")
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu" or ids.ndim != 2 or ids.shape[0] != len(hsel):
            raise ValueError(f"ids must be an int array [{len(hsel)}, r], got {ids.dtype} "
                             f"{ids.shape}")
        h, r = ids.shape
        k, v = self.read_rows(layer, np.repeat(hsel, r), ids.reshape(-1), keys=keys,
                              values=values)
        D = self._core.layout.head_dim
        return (None if k is None else k.view(h, r, D), None if v is None else v.view(h, r, D))

    def read_rows(self, layer: int, heads: object, ids: object, *, keys: bool = True,
                  values: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Row j: token ``ids[j]`` of kv-head ``heads[j]`` (1-D int arrays of one length) of
        layer ``layer``: (k, v), each [r, D] in the layout dtype (keys pre-RoPE), or None
        where not asked for. Heads may ask for different tokens and counts (no padding)."""
        core = self._core
        lay = core.layout
        L, H, D = lay.num_layers, lay.num_kv_heads, lay.head_dim
        if isinstance(layer, bool) or not isinstance(layer, int | np.integer) \
                or not 0 <= layer < L:
            raise ValueError(f"layer must be an int in 0..{L - 1}, got {layer!r}")
        hs, ids = np.asarray(heads), np.asarray(ids)
        if hs.dtype.kind not in "iu" or hs.ndim != 1 or (len(hs) and (
                int(hs.min()) < 0 or int(hs.max()) >= H)):
            raise ValueError(f"heads must be kv-heads in 0..{H - 1}, got {heads!r}")
        if ids.dtype.kind not in "iu" or ids.shape != hs.shape:
            raise ValueError(f"ids must be an int array of the heads' shape {hs.shape}, got "
                             f"{ids.dtype} {ids.shape}")
        hs, ids = hs.astype(np.int64), ids.astype(np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.n_tokens):
            raise ValueError(f"ids must be token positions in 0..{self.n_tokens - 1}")
        if not (keys or values):
            raise ValueError("keys and values must not both be False")
        r = len(ids)
        k_out = np.empty((r, D), dtype=chunk_extent._NP_INT[lay.itemsize]) if keys else None
        v_out = np.empty((r, D), dtype=chunk_extent._NP_INT[lay.itemsize]) if values else None
        piece = np.searchsorted(self._starts, ids, side="right") - 1  # [r] piece of each row
        order = np.argsort(piece, kind="stable")  # rows grouped by chunk
        ps = piece[order]
        cuts = np.flatnonzero(np.diff(ps)) + 1
        firsts = np.r_[0, cuts]
        segments = list(zip(ps[firsts].tolist(), firsts.tolist(), np.r_[cuts, r].tolist(),
                            strict=True)) if r else []
        touched = [i for i, _, _ in segments]
        disk = 0
        with core.leased_chunks([self._pieces[i].rec for i in touched], self._queued) as lease:
            for j, (i, a, b) in enumerate(segments):
                e = lease.hits.get(j)
                if e is not None:  # [2, H, n, D] raw of a verified DRAM copy
                    part = self._dram_layer(self._pieces[i].rec, e, layer)
                else:
                    part, nbytes = self._read_disk(self._pieces[i].rec, layer, lease.misses[j])
                    lease.ok.add(j)
                    disk += nbytes
                rows = order[a:b]
                loc = ids[rows] - self._pieces[i].start
                if k_out is not None:
                    k_out[rows] = part[0, hs[rows], loc]
                if v_out is not None:
                    v_out[rows] = part[1, hs[rows], loc]
        with self._lock:
            s = self.stats
            s["rows_bytes"] += (int(keys) + int(values)) * r * D * lay.itemsize
            s["disk_bytes"] += disk
            s["dram_chunks"] += len(lease.hits)
            s["disk_chunks"] += len(lease.misses)
            s["promoted"] += sum(1 for c in lease.misses.values() if c is not None)
        dt = lay.torch_dtype
        return (None if k_out is None else torch.from_numpy(k_out).view(dt),
                None if v_out is None else torch.from_numpy(v_out).view(dt))

    def _dram_layer(self, rec, e, layer: int) -> np.ndarray:
        """Layer ``layer`` of ``rec``'s DRAM copy ``e`` as raw [2, H, n, D] (a coded copy that
        does not decode is quarantined: CorruptData)."""
        core = self._core
        with reading(core, rec, self._files, during=DURING):
            return copy_layer(core, rec, core.buffer(e), layer)

    # ------------------------------------------------------------------ disk
    def _read_disk(self, rec, layer: int, cache) -> tuple[np.ndarray, int]:
        """Layer ``layer`` of ``rec`` from disk, verified: (raw [2, H, n, D], bytes read).
        With a pending DRAM entry the whole extent is read and verified into it."""
        core = self._core
        lay = core.layout
        n = rec.n_tokens
        shape = (lay.num_layers, 2, lay.num_kv_heads, n, lay.head_dim)
        with reading(core, rec, self._files, during=DURING):
            if cache is not None:
                buf = core.buffer(cache)
                fill_copy(core, rec, buf)
                nbytes = rec.stored_bytes(n * lay.layer_token_bytes)
                return copy_layer(core, rec, buf, layer), nbytes
            off, nbytes = rec.layer_span(layer, n * lay.layer_token_bytes)
            data = read_layer(core, rec, layer, [np.empty(nbytes, dtype=np.uint8)], off)[0]
            return data.view(chunk_extent._NP_INT[lay.itemsize]).reshape(shape[1:]), nbytes
