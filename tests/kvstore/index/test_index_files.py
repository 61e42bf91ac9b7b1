"""Index files are untrusted input: crafted or mutated files with recomputed checksums (bad ids,
bad counts, truncated arrays, wrong dtypes, an old-format file embedding an hnswlib blob, a
hostile header) load as a typed error, never a crash. The loading runs in a subprocess, so a
signal death (a segfault in native code) fails the test instead of killing pytest. Files that
stay valid after a mutation must still search without crashing."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import xxhash

from kvstore.index import IndexSpec, build_index
from kvstore.index.files import _PRE, ALIGN, MAGIC, encode_index

N, D = 400, 16


def _keys() -> np.ndarray:
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((N, D)).astype(np.float32) * 3
    keys[0] *= 0.1  # a small-norm sink
    return keys


def _parts(raw: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """(header, arrays) of an index file."""
    _, hlen, _ = _PRE.unpack_from(raw)
    meta = json.loads(raw[_PRE.size:_PRE.size + hlen])
    base = -(-(_PRE.size + hlen) // ALIGN) * ALIGN
    arrs = {e["name"]: np.frombuffer(raw[base + e["offset"]: base + e["offset"] + e["nbytes"]],
                                     dtype=np.dtype(e["dtype"])).reshape(e["shape"]).copy()
            for e in meta["arrays"]}
    return meta, arrs


def _assemble(kind: str, extra: dict, arrs: dict[str, np.ndarray], *, magic: bytes = MAGIC,
              lie: dict | None = None) -> bytes:
    """An index file with every checksum recomputed (``lie``: header fields of one array
    replaced after the fact, e.g. a shape that the bytes do not have)."""
    entries, offset, blobs = [], 0, []
    for name, a in arrs.items():
        a = np.ascontiguousarray(a)
        e = {"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset,
             "nbytes": a.nbytes, "xxh3": xxhash.xxh3_64_intdigest(a.tobytes())}
        if lie and lie.get("name") == name:
            e.update({k: v for k, v in lie.items() if k != "name"})
        entries.append(e)
        blobs.append(a.tobytes())
        offset += -(-a.nbytes // ALIGN) * ALIGN
    header = json.dumps({"kind": kind, "extra": extra, "arrays": entries}).encode()
    base = -(-(_PRE.size + len(header)) // ALIGN) * ALIGN
    out = bytearray(base + offset)
    _PRE.pack_into(out, 0, magic, len(header), xxhash.xxh3_64_intdigest(header))
    out[_PRE.size:_PRE.size + len(header)] = header
    for e, b in zip(entries, blobs, strict=True):
        out[base + e["offset"]: base + e["offset"] + len(b)] = b
    return bytes(out[: base + entries[-1]["offset"] + len(blobs[-1])] if entries else out)


def _graph_cases(raw: bytes) -> dict[str, bytes]:
    meta, a = _parts(raw)
    ex = meta["extra"]
    n = len(a["deg"])

    def g(**change):
        arrs = {k: change.pop(k, v) for k, v in a.items()}
        return _assemble("graph", change.pop("extra", ex), arrs, **change)

    idx = a["idx"]
    big = idx.copy()
    big[len(big) // 2] = n + 5  # a link past the keys
    neg = idx.copy()
    neg[7] = -1
    huge = idx.copy()
    huge[3] = 2**31 - 1
    deg_more = a["deg"].copy()
    deg_more[5] += 1  # counts no longer sum to the links
    deg_max = a["deg"].copy()
    deg_max[0] = 65535
    deg_max[1] = 0
    deg_zero = np.zeros_like(a["deg"])
    ent_bad = a["entries"].copy()
    ent_bad[0] = n
    ent_dup = a["entries"].copy()
    ent_dup[1] = ent_dup[0]
    side_bad = a["side"].copy()
    side_bad[-1] = n + 100
    # the previous format: hnswlib's own file (a header inside the blob claiming a huge
    # element count) under the old magic, with recomputed checksums
    hnsw_blob = np.frombuffer(struct.pack("<QQQQQQ", 0, 2**40, 2**40, 10**9, 0, 0) * 8,
                              dtype=np.uint8)
    keys_old = np.zeros((n, D), np.float32)
    return {
        "link past n": g(idx=big),
        "negative link": g(idx=neg),
        "link 2**31-1": g(idx=huge),
        "links as int64": g(idx=idx.astype(np.int64)),
        "links as float": g(idx=idx.astype(np.float32)),
        "counts do not sum": g(deg=deg_more),
        "count past the degree bound": g(deg=deg_max),
        "no links, links left": g(deg=deg_zero),
        "links truncated": g(idx=idx[: len(idx) // 2]),
        "links truncated, shape lies": g(idx=idx[: len(idx) // 2],
                                         lie={"name": "idx", "shape": [len(idx)]}),
        "nbytes lies": g(lie={"name": "idx", "nbytes": 10**12}),
        "offset past the end": g(lie={"name": "side", "offset": 10**9}),
        "negative offset": g(lie={"name": "deg", "offset": -64}),
        "entry past n": g(entries=ent_bad),
        "duplicate entries": g(entries=ent_dup),
        "side id past n": g(side=side_bad),
        "2-D links": g(idx=idx.reshape(-1, 1)),
        "object dtype claimed": g(lie={"name": "idx", "dtype": "|O"}),
        "missing array": _assemble("graph", ex, {k: v for k, v in a.items() if k != "side"}),
        "extra array": _assemble("graph", ex, {**a, "hnsw": hnsw_blob}),
        "dim 0": g(extra={**ex, "dim": 0}),
        "dim a string": g(extra={**ex, "dim": "64"}),
        "spec with a bad field": g(extra={**ex, "spec": {**ex["spec"], "graph_m": -1}}),
        "spec with an unknown field": g(extra={**ex, "spec": {**ex["spec"], "evil": 1}}),
        "old format with an hnswlib blob": _assemble(
            "graph", {"spec": ex["spec"]}, {"keys": keys_old, "hnsw": hnsw_blob},
            magic=b"KVIDX001"),
        "unknown kind": _assemble("hnsw", ex, a),
        "nested header": _nested_header(),
        "trailing bytes": raw + b"\0" * 64,
        "truncated file": raw[: len(raw) - 100],
        "header only": raw[:_PRE.size + 10],
        "empty": b"",
    }


def _nested_header() -> bytes:
    header = b"[" * 100000 + b"]" * 100000
    return _PRE.pack(MAGIC, len(header), xxhash.xxh3_64_intdigest(header)) + header


def _pq_cases(raw: bytes) -> dict[str, bytes]:
    meta, a = _parts(raw)
    ex = meta["extra"]

    def p(**change):
        return _assemble("pq", change.pop("extra", ex), {k: change.pop(k, v) for k, v in a.items()})

    codes = a["codes"].copy()
    codes[9, 2] = a["codebooks"].shape[1]  # a centroid past the codebooks (K < 256 here)
    books = a["codebooks"].copy()
    books[0, 0, 0] = np.inf
    return {
        "code past K": p(codes=codes),
        "codes with other m": p(codes=np.ascontiguousarray(a["codes"][:, :3])),
        "infinite centroid": p(codebooks=books),
        "codebooks as float64": p(codebooks=a["codebooks"].astype(np.float64)),
        "side past n": p(side=np.array([0, N + 1], np.int32)),
        "rerank 0": p(extra={**ex, "rerank": 0}),
        "rerank missing": p(extra={}),
        "no codes": p(codes=np.zeros((0, a["codes"].shape[1]), np.uint8)),
    }


_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    from kvstore import CorruptData
    from kvstore.index.files import decode_index
    d = sys.argv[1]
    keys = np.load(d + "/keys.npy")
    out = {}
    for i, name in enumerate(json.load(open(d + "/names.json"))):
        raw = open(d + f"/{i}.kvi", "rb").read()
        try:
            ix = decode_index(raw, name)
        except CorruptData as e:
            out[name] = "CorruptData"
            continue
        except Exception as e:  # noqa: BLE001 -- the test reports it
            out[name] = f"{type(e).__name__}: {e}"
            continue
        try:  # loaded: it must search without crashing
            ix = ix.bind(keys)
            q = keys[1]
            ix.topk(q, 10); ix.topk(q, 10, limit=50); ix.dipr(q, 5.0)
            out[name] = "loaded and searched"
        except ValueError as e:
            out[name] = "ValueError at bind: " + str(e)
    print(json.dumps(out))
""")


def _run_child(tmp_path, cases: dict[str, bytes], keys: np.ndarray, native: str) -> dict:
    np.save(tmp_path / "keys.npy", keys)
    (tmp_path / "names.json").write_text(json.dumps(list(cases)))
    for i, raw in enumerate(cases.values()):
        (tmp_path / f"{i}.kvi").write_bytes(raw)
    env = {**os.environ, "KVSTORE_NATIVE": native}
    r = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])  # < 0: killed by a signal
    return json.loads(r.stdout)


@pytest.mark.parametrize("native", ["1", "0"])
def test_crafted_graph_and_pq_files_are_corrupt_data_never_a_crash(tmp_path, native):
    keys = _keys()
    graph = encode_index(build_index(keys, IndexSpec(kind="graph", graph_m=8)))
    pq = encode_index(build_index(keys, IndexSpec(kind="pq", pq_subspaces=4)))
    cases = {**_graph_cases(graph), **{f"pq: {k}": v for k, v in _pq_cases(pq).items()}}
    got = _run_child(tmp_path, cases, keys, native)
    assert got == {name: "CorruptData" for name in cases}, \
        {k: v for k, v in got.items() if v != "CorruptData"}


def test_mutated_links_that_stay_in_range_load_and_search(tmp_path):
    """Links shuffled, dropped or pointed at one node (in range, counts consistent): a valid
    but useless graph. It loads, and searches return k ids below the limit (the exact scan
    takes over when the walk reaches too few)."""
    keys = _keys()
    raw = encode_index(build_index(keys, IndexSpec(kind="graph", graph_m=8)))
    meta, a = _parts(raw)
    rng = np.random.default_rng(0)
    cases = {
        "shuffled links": _assemble("graph", meta["extra"],
                                    {**a, "idx": rng.permutation(a["idx"])}),
        "every link to node 0": _assemble("graph", meta["extra"],
                                          {**a, "idx": np.zeros_like(a["idx"])}),
        "no links at all": _assemble("graph", meta["extra"], {
            **a, "deg": np.zeros_like(a["deg"]), "idx": np.zeros(0, np.int32)}),
    }
    for native in ("1", "0"):
        got = _run_child(tmp_path, cases, keys, native)
        assert got == {name: "loaded and searched" for name in cases}, got


def test_a_crafted_head_file_in_a_store_is_rebuilt_not_a_crash(tmp_path):
    """In a store: a head file replaced by a crafted one with valid checksums (a link past n)
    and another by an old-format file is rebuilt from the stored keys by indexes(), in a
    subprocess (a crash would be a signal death)."""
    import kvstore
    from tests.support.kvgen import SMALL, causal_kv

    toks = list(range(100, 160))
    path = str(tmp_path / "store")
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, dram_bytes=1 << 20,
                      disk_bytes=4 << 20) as s:
        k, v = causal_kv(SMALL, toks)
        s.put(toks, k, v, index=IndexSpec(kind="graph", graph_m=4))
        (d,) = s.index_dirs().values()
    f0, f1 = os.path.join(d, "L000H00.kvidx"), os.path.join(d, "L001H01.kvidx")
    meta, a = _parts(open(f0, "rb").read())
    bad = a["idx"].copy()
    bad[0] = 10**6
    open(f0, "wb").write(_assemble("graph", meta["extra"], {**a, "idx": bad}))
    old = _assemble("graph", {}, {"hnsw": np.zeros(64, np.uint8)}, magic=b"KVIDX001")
    open(f1, "wb").write(old)
    code = textwrap.dedent(f"""
        import numpy as np, kvstore
        with kvstore.open({path!r}) as s:
            ci = s.indexes({toks!r})
            q = np.ones({SMALL.head_dim}, np.float32)
            ci.head(0, 0).topk(q, 5); ci.head(1, 1).dipr(q, 3.0)
            print(s.stats()["indexes"]["rebuilt_heads"])
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=os.getcwd())
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert r.stdout.split() == ["2"]
