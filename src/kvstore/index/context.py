"""The indexes of one stored context: one per (layer, kv-head), kept as a directory of files.

A context's directory holds ``L{layer}H{head}.kvidx`` (:func:`kvstore.index.save_index`, each
checksummed) and ``manifest.json`` (the spec, the token count and the shape, under its own
xxh3). It is written under a temporary name, every file fsynced, then renamed into place, so a
reader sees all of it or none. Indexes are built over *positioned* keys: RoPE applied at
positions ``0..T-1``, which is what a decode query at a later position scores against.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np
import torch
import xxhash

from kvstore.errors import CorruptData
from kvstore.fsutil import fsync_dir
from kvstore.index.build import build_index
from kvstore.index.persist import load_index, save_index
from kvstore.index.spec import IndexSpec
from kvstore.layout import KVLayout
from kvstore.rope import apply_rope

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


def positioned_keys(keys: torch.Tensor, layout: KVLayout) -> np.ndarray:
    """Stored (pre-RoPE) keys [L, H, T, D] -> float32 keys with RoPE at 0..T-1, [L, H, T, D]
    (the same float32 arithmetic the runtime's attention uses, so scores agree exactly)."""
    assert keys.dim() == 4 and keys.shape[-1] == layout.head_dim, tuple(keys.shape)
    return apply_rope(keys.detach().to("cpu", torch.float32), 0, layout).numpy()


def _file(layer: int, head: int) -> str:
    return f"L{layer:03d}H{head:02d}.kvidx"


def _spec_dict(spec: IndexSpec) -> dict[str, object]:
    return {f.name: getattr(spec, f.name) for f in fields(spec)}


@dataclass(frozen=True, kw_only=True)
class ContextIndexes:
    """``heads[layer][kv_head]``: the index over that head's positioned keys of ``n_tokens``
    tokens. Thread-safety: read-only; queries may run concurrently (see each index type)."""

    spec: IndexSpec
    n_tokens: int
    heads: tuple[tuple[object, ...], ...]

    @property
    def num_layers(self) -> int:
        return len(self.heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.heads[0])

    def head(self, layer: int, head: int):
        return self.heads[layer][head]

    @classmethod
    def build(cls, keys_pos: np.ndarray, spec: IndexSpec) -> ContextIndexes:
        """Indexes over positioned keys [L, H, T, D] (see :func:`positioned_keys`)."""
        if not isinstance(spec, IndexSpec):
            raise TypeError(f"spec must be a kvstore.index.IndexSpec, got {type(spec).__name__}")
        L, H, T, _ = keys_pos.shape
        heads = tuple(tuple(build_index(keys_pos[layer, h], spec) for h in range(H))
                      for layer in range(L))
        return cls(spec=spec, n_tokens=T, heads=heads)

    def stage(self, parent: str) -> tuple[str, int]:
        """Write every file, fsynced, into a new temporary directory under ``parent``; returns
        (its path, bytes written). :func:`publish` then renames it into place."""
        if not os.path.isdir(parent):
            os.makedirs(parent, exist_ok=True)
            fsync_dir(os.path.dirname(os.path.abspath(parent)))  # the new directory's entry
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
        try:
            total = 0
            for layer, row in enumerate(self.heads):
                for h, ix in enumerate(row):
                    p = os.path.join(tmp, _file(layer, h))
                    save_index(ix, p)
                    total += os.path.getsize(p)
            body = json.dumps({"version": MANIFEST_VERSION, "spec": _spec_dict(self.spec),
                               "n_tokens": self.n_tokens, "num_layers": self.num_layers,
                               "num_kv_heads": self.num_kv_heads}, sort_keys=True)
            raw = json.dumps({"body": body, "xxh3": xxhash.xxh3_64_intdigest(body.encode())})
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            return tmp, total + len(raw)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def write(self, directory: str) -> int:
        """Write into ``directory`` atomically (an existing one is replaced); returns bytes."""
        tmp, n = self.stage(os.path.dirname(os.path.abspath(directory)))
        publish(tmp, directory)
        return n


def publish(tmp: str, directory: str) -> None:
    """Rename a staged directory into place, replacing an existing one, durably. The old one
    is renamed aside first: a crash between the two renames leaves the context without
    indexes (the old ones a leftover collected at open), never with a mix of two."""
    parent = os.path.dirname(os.path.abspath(directory))
    old = None
    if os.path.exists(directory):
        old = tempfile.mkdtemp(prefix=".tmp-old-", dir=parent)
        os.rename(directory, os.path.join(old, "indexes"))
    os.rename(tmp, directory)
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old)


def read_manifest(directory: str) -> dict[str, object]:
    """The checked manifest of an index directory; :class:`CorruptData` if it is missing,
    fails its checksum or does not describe a valid spec and shape."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "rb") as f:
            outer = json.loads(f.read())
        body = outer["body"]
        if xxhash.xxh3_64_intdigest(body.encode()) != outer["xxh3"]:
            raise CorruptData(f"index manifest {path!r} fails its checksum")
        meta = json.loads(body)
        if meta["version"] != MANIFEST_VERSION:
            raise CorruptData(f"index manifest {path!r} has unknown version {meta['version']!r}")
        meta["spec"] = IndexSpec(**meta["spec"])
        for name in ("n_tokens", "num_layers", "num_kv_heads"):
            if not isinstance(meta[name], int) or meta[name] < 1:
                raise CorruptData(f"index manifest {path!r}: bad {name} {meta[name]!r}")
        return meta
    except CorruptData:
        raise
    except FileNotFoundError:
        raise CorruptData(f"index manifest {path!r} is missing") from None
    except (OSError, KeyError, TypeError, ValueError, AttributeError) as err:
        raise CorruptData(f"index manifest {path!r} is unreadable ({err})") from None


def read_context_indexes(directory: str, *,
                         rebuild: Callable[[int, int, IndexSpec], object] | None = None,
                         rewrite: bool = True) -> tuple[ContextIndexes, list[tuple[int, int]]]:
    """Load an index directory. A head file that is corrupt or missing is rebuilt with
    ``rebuild(layer, head, spec)`` when given (and, with ``rewrite``, saved in place
    atomically), else raises :class:`CorruptData`. Returns (indexes, the (layer, head) pairs
    that were rebuilt). A bad manifest always raises: without it nothing can be rebuilt."""
    meta = read_manifest(directory)
    spec, T = meta["spec"], meta["n_tokens"]
    rebuilt: list[tuple[int, int]] = []
    rows = []
    for layer in range(meta["num_layers"]):
        row = []
        for h in range(meta["num_kv_heads"]):
            path = os.path.join(directory, _file(layer, h))
            try:
                ix = load_index(path)
                if ix.kind != spec.kind or ix.n != T:
                    raise CorruptData(f"index file {path!r} does not match its manifest "
                                      f"({ix.kind}, {ix.n} tokens)")
            except CorruptData:
                if rebuild is None:
                    raise
                ix = rebuild(layer, h, spec)
                if rewrite:
                    save_index(ix, path)
                rebuilt.append((layer, h))
            row.append(ix)
        rows.append(tuple(row))
    return ContextIndexes(spec=spec, n_tokens=T, heads=tuple(rows)), rebuilt


def directory_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))


