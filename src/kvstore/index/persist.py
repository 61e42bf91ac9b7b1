"""Index files: one index per file, numpy arrays under a JSON header, every part checksummed.

Layout: ``KVIDX001`` magic, header length (u32), header xxh3-64 (u64), the JSON header, then
each array at a 64-byte aligned offset. The header names the index kind, its parameters and,
per array, dtype, shape, offset, length and xxh3-64. No pickle or other code-executing format.
Files are written with :meth:`kvstore.confined.Dir.atomic_write`, so a crash leaves the old file or
the new one, never half of one. On load, a checksum mismatch, a truncated or missing file, or
contents that do not fit together raise :class:`kvstore.CorruptData` (alignment padding is not
checksummed: it is never read).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile

import numpy as np
import xxhash

from kvstore.confined import Dir
from kvstore.errors import CorruptData
from kvstore.index.flat import FlatIndex
from kvstore.index.graph import GraphIndex, _bottom_layer
from kvstore.index.pq import PQIndex
from kvstore.index.spec import IndexSpec, check_keys

MAGIC = b"KVIDX001"
_PRE = struct.Struct("<8sIQ")  # magic, header length, header checksum
ALIGN = 64


def _arrays(index) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    if isinstance(index, FlatIndex):
        return {"keys": index.keys}, {}
    if isinstance(index, PQIndex):
        arrs = {"codebooks": index.codebooks, "codes": index.codes}
        if index.keys is not None:
            arrs["keys"] = index.keys
        return arrs, {"rerank": index.rerank}
    if isinstance(index, GraphIndex):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "hnsw.bin")
            index.hnsw.save_index(p)
            with open(p, "rb") as f:
                blob = np.frombuffer(f.read(), dtype=np.uint8)
        spec = {k: getattr(index.spec, k) for k in index.spec.__dataclass_fields__}
        return {"keys": index.keys, "hnsw": blob}, {"spec": spec}
    raise TypeError(f"index must be a FlatIndex, PQIndex or GraphIndex, got {type(index)}")


def save_index(index, path: str | os.PathLike[str]) -> None:
    """Write ``index`` to ``path`` atomically and durably."""
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    with Dir.open_root(directory, create=False) as d:
        save_index_at(index, d, name)


def load_index(path: str | os.PathLike[str]):
    """Read an index written by :func:`save_index`; :class:`CorruptData` on any mismatch."""
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    with Dir.open_root(directory, create=False) as d:
        return load_index_at(d, name)


def save_index_at(index, d: Dir, name: str) -> None:
    """Write ``index`` as the file ``name`` of the store directory ``d``, atomically and
    durably (never through a symlink)."""
    arrs, extra = _arrays(index)
    entries, offset = [], 0
    for array_name, a in arrs.items():
        a = np.ascontiguousarray(a)
        entries.append({"name": array_name, "dtype": a.dtype.str, "shape": list(a.shape),
                        "offset": offset, "nbytes": a.nbytes,
                        "xxh3": xxhash.xxh3_64_intdigest(a.tobytes())})
        offset += -(-a.nbytes // ALIGN) * ALIGN
    header = json.dumps({"kind": index.kind, "extra": extra, "arrays": entries}).encode()
    base = -(-(_PRE.size + len(header)) // ALIGN) * ALIGN

    def write(f) -> None:
        f.write(_PRE.pack(MAGIC, len(header), xxhash.xxh3_64_intdigest(header)))
        f.write(header)
        for e, a in zip(entries, arrs.values(), strict=True):
            f.seek(base + e["offset"])
            f.write(np.ascontiguousarray(a).tobytes())
        f.truncate(base + entries[-1]["offset"] + entries[-1]["nbytes"])  # no trailing pad

    d.atomic_write(name, write)


def load_index_at(d: Dir, name: str):
    """Read the index file ``name`` of the store directory ``d`` (never through a symlink);
    :class:`CorruptData` on any mismatch, :class:`~kvstore.confined.UnsafePath` if a symlink or
    special file is there."""
    path = d.show(name)
    try:
        raw = d.read_bytes(name)
    except FileNotFoundError:
        raise CorruptData(f"index file {path!r} is missing") from None
    if len(raw) < _PRE.size:
        raise CorruptData(f"index file {path!r} is truncated")
    magic, hlen, hsum = _PRE.unpack_from(raw)
    header = raw[_PRE.size:_PRE.size + hlen]
    if magic != MAGIC or len(header) != hlen or xxhash.xxh3_64_intdigest(header) != hsum:
        raise CorruptData(f"index file {path!r}: bad magic or header checksum")
    try:
        meta = json.loads(header)
        base = -(-(_PRE.size + hlen) // ALIGN) * ALIGN
        arrs = {}
        for e in meta["arrays"]:
            blob = raw[base + e["offset"]: base + e["offset"] + e["nbytes"]]
            if len(blob) != e["nbytes"] or xxhash.xxh3_64_intdigest(blob) != e["xxh3"]:
                raise CorruptData(f"index file {path!r}: array {e['name']!r} fails its checksum")
            arrs[e["name"]] = np.frombuffer(blob, dtype=np.dtype(e["dtype"])).reshape(
                e["shape"]).copy()
        return _rebuild(meta["kind"], meta["extra"], arrs)
    except CorruptData:
        raise
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as err:
        # checksums only catch accidents: a consistent but malformed file lands here
        raise CorruptData(f"index file {path!r}: inconsistent contents ({err})") from None


def _rebuild(kind: str, extra: dict, arrs: dict[str, np.ndarray]):
    """The index from checked arrays; ValueError/KeyError/... if they do not fit together."""
    keys = check_keys(arrs["keys"]) if "keys" in arrs else None
    if kind == "flat":
        return FlatIndex(keys)
    if kind == "pq":
        books, codes = arrs["codebooks"], arrs["codes"]
        if books.ndim != 3 or codes.ndim != 2 or codes.dtype != np.uint8 \
                or codes.shape[1] != books.shape[0] or int(codes.max()) >= books.shape[1]:
            raise ValueError("codebooks and codes do not match")
        if keys is not None and (len(keys) != len(codes)
                                 or keys.shape[1] != books.shape[0] * books.shape[2]):
            raise ValueError("keys do not match the codes")
        return PQIndex(books, codes, keys, int(extra["rerank"]))
    if kind == "graph":
        import hnswlib

        spec = IndexSpec(**extra["spec"])
        hnsw = hnswlib.Index(space="l2", dim=keys.shape[1] + 1)
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "hnsw.bin")
            with open(p, "wb") as f:
                f.write(arrs["hnsw"].tobytes())
            hnsw.load_index(p, max_elements=keys.shape[0])
        if hnsw.get_current_count() != len(keys):
            raise ValueError("the graph and the keys have different sizes")
        hnsw.set_ef(spec.graph_ef_search)
        return GraphIndex(hnsw, keys, _bottom_layer(hnsw), spec)
    raise ValueError(f"unknown index kind {kind!r}")
