"""Index files, and every filesystem operation on the store's ``indexes/`` tree.

**Files are bytes in and out**: :func:`encode_index` and :func:`decode_index`. Inside a store
every index file is read and written through the store's confinement
(:class:`kvstore.format.directory.Dir`: relative to a directory descriptor, never following a
symlink);
:func:`save_index` and :func:`load_index` do the same in the directory of a path.

**File format** (version 2, magic ``KVIDX002``): the magic, header length (u32), header xxh3-64
(u64), a JSON header, then each array at a 64-byte aligned offset. The header names the index
kind, its parameters and, per array, dtype, shape, offset, length and xxh3-64. No pickle and no
native blob: a graph is its own arrays (links, entry points, side list), never hnswlib's
serialized index. No key vectors either: indexes read keys from the KV
(:mod:`kvstore.index.keys`).

**Loading is a validation.** A checksum proves integrity, not that the bytes are safe: every
array must have the exact dtype and rank its kind expects (:data:`SCHEMA`), and the index types'
constructors check every id against n, every count against its bound and every shape against
the others before any of it reaches native code. A file that fails any check, a truncated or
missing file, and a file of the previous format (``KVIDX001``, which embedded hnswlib's blob
and the keys) raise :class:`kvstore.CorruptData`; the store then rebuilds that head from its
keys.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import xxhash

from kvstore.errors import CorruptData
from kvstore.format.directory import Dir
from kvstore.index.flat import FlatIndex
from kvstore.index.graph import GraphIndex
from kvstore.index.pq import PQIndex
from kvstore.index.spec import IndexSpec

# ---------------------------------------------------------------- the index file format

MAGIC = b"KVIDX002"
OLD_MAGICS = (b"KVIDX001",)
_PRE = struct.Struct("<8sIQ")  # magic, header length, header checksum
ALIGN = 64
MAX_HEADER = 1 << 20

#: per kind, each array's allowed dtypes and rank (every listed array is required)
SCHEMA: dict[str, dict[str, tuple[tuple[str, ...], int]]] = {
    "flat": {},
    "pq": {"codebooks": (("<f2",), 3), "codes": (("|u1",), 2), "side": (("<i4",), 1)},
    "graph": {"deg": (("<u2",), 1), "idx": (("<i4",), 1), "entries": (("<i4",), 1),
              "side": (("<i4",), 1)},
}


def _arrays(index) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    if isinstance(index, FlatIndex):
        return {}, {"n": index.n, "dim": index.dim}
    if isinstance(index, PQIndex):
        return ({"codebooks": index.codebooks.astype(np.float16), "codes": index.codes,
                 "side": index.side.astype(np.int32)}, {"rerank": index.rerank})
    if isinstance(index, GraphIndex):
        spec = {k: getattr(index.spec, k) for k in index.spec.__dataclass_fields__}
        return ({"deg": index.deg, "idx": index.idx, "entries": index.entries.astype(np.int32),
                 "side": index.side.astype(np.int32)}, {"spec": spec, "dim": index.dim})
    raise TypeError(f"index must be a FlatIndex, PQIndex or GraphIndex, got {type(index)}")


def encode_index(index) -> bytes:
    """The file bytes of ``index`` (its own arrays only, never the keys)."""
    arrs, extra = _arrays(index)
    entries, offset = [], 0
    for name, a in arrs.items():
        a = np.ascontiguousarray(a)
        arrs[name] = a
        entries.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape),
                        "offset": offset, "nbytes": a.nbytes,
                        "xxh3": xxhash.xxh3_64_intdigest(a.tobytes())})
        offset += -(-a.nbytes // ALIGN) * ALIGN
    header = json.dumps({"kind": index.kind, "extra": extra, "arrays": entries}).encode()
    base = -(-(_PRE.size + len(header)) // ALIGN) * ALIGN
    end = base + entries[-1]["offset"] + entries[-1]["nbytes"] if entries \
        else _PRE.size + len(header)
    out = bytearray(end)
    _PRE.pack_into(out, 0, MAGIC, len(header), xxhash.xxh3_64_intdigest(header))
    out[_PRE.size:_PRE.size + len(header)] = header
    for e, a in zip(entries, arrs.values(), strict=True):
        out[base + e["offset"]: base + e["offset"] + e["nbytes"]] = a.tobytes()
    return bytes(out)


def decode_index(raw: bytes, what: str):
    """The index in file bytes ``raw`` (unbound to keys); :class:`CorruptData` naming
    ``what`` on any mismatch."""
    if len(raw) < _PRE.size:
        raise CorruptData(f"index file {what}: truncated")
    magic, hlen, hsum = _PRE.unpack_from(raw)
    if magic in OLD_MAGICS:
        raise CorruptData(f"index file {what}: an older format ({magic!r}), to be rebuilt")
    header = raw[_PRE.size:_PRE.size + hlen]
    if magic != MAGIC or hlen > MAX_HEADER or len(header) != hlen \
            or xxhash.xxh3_64_intdigest(header) != hsum:
        raise CorruptData(f"index file {what}: bad magic or header checksum")
    try:
        meta = json.loads(header)
        kind = meta["kind"]
        schema = SCHEMA[kind]
        base = -(-(_PRE.size + hlen) // ALIGN) * ALIGN
        arrs = {}
        for e in meta["arrays"]:
            name = e["name"]
            dtypes, ndim = schema[name]
            shape = e["shape"]
            if name in arrs or e["dtype"] not in dtypes or not isinstance(shape, list) \
                    or len(shape) != ndim \
                    or not all(isinstance(x, int) and 0 <= x < 2**40 for x in shape):
                raise CorruptData(f"index file {what}: array {name!r} has a bad dtype or shape")
            off, nbytes = e["offset"], e["nbytes"]
            if not (isinstance(off, int) and isinstance(nbytes, int) and off >= 0
                    and nbytes == int(np.prod(shape)) * np.dtype(e["dtype"]).itemsize):
                raise CorruptData(f"index file {what}: array {name!r} has a bad extent")
            blob = raw[base + off: base + off + nbytes]
            if len(blob) != nbytes or xxhash.xxh3_64_intdigest(blob) != e["xxh3"]:
                raise CorruptData(f"index file {what}: array {name!r} fails its checksum")
            arrs[name] = np.frombuffer(blob, dtype=np.dtype(e["dtype"])).reshape(shape).copy()
        if set(arrs) != set(schema):
            raise CorruptData(f"index file {what}: arrays {sorted(arrs)} are not "
                              f"{sorted(schema)}")
        es = meta["arrays"]
        end = base + es[-1]["offset"] + es[-1]["nbytes"] if es else _PRE.size + hlen
        if len(raw) != end:
            raise CorruptData(f"index file {what}: {len(raw)} bytes, its header says {end}")
        return _rebuild(kind, meta["extra"], arrs)
    except CorruptData:
        raise
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError,
            RecursionError) as err:
        # checksums only catch accidents: a consistent but malformed file lands here
        raise CorruptData(f"index file {what}: inconsistent contents ({err})") from None


def _rebuild(kind: str, extra: dict, arrs: dict[str, np.ndarray]):
    """The index from schema-checked arrays; the constructors check ids, counts and shapes
    (ValueError if they do not fit together)."""
    if not isinstance(extra, dict):
        raise ValueError("extra must be an object")
    if kind == "flat":
        return FlatIndex(extra["n"], extra["dim"])
    if kind == "pq":
        return PQIndex(arrs["codebooks"], arrs["codes"], arrs["side"], extra["rerank"])
    spec = IndexSpec(**extra["spec"])
    if spec.kind != "graph":
        raise ValueError("a graph file with a non-graph spec")
    return GraphIndex(arrs["deg"], arrs["idx"], arrs["entries"], arrs["side"], extra["dim"],
                      spec)


def save_index(index, path: str | os.PathLike[str]) -> int:
    """Write ``index`` to ``path`` atomically and durably; returns the bytes written."""
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    raw = encode_index(index)
    with Dir.open_root(directory, create=False) as d:
        d.atomic_write(name, raw)
    return len(raw)


def load_index(path: str | os.PathLike[str], keys: object | None = None):
    """Read an index written by :func:`save_index` (bound to ``keys`` when given: a HeadKeys
    or an array); :class:`CorruptData` on any mismatch."""
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    try:
        with Dir.open_root(directory, create=False) as d:
            raw = d.read_bytes(name)
    except FileNotFoundError:
        raise CorruptData(f"index file {os.fspath(path)!r} is missing") from None
    ix = decode_index(raw, repr(os.fspath(path)))
    if keys is None:
        return ix
    try:
        return ix.bind(keys)
    except ValueError as err:
        raise CorruptData(f"index file {os.fspath(path)!r} does not fit its keys ({err})") \
            from None
