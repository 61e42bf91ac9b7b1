"""The indexes of one stored context: one per (layer, kv-head), kept as a directory of files.

A context's directory holds ``L{layer}H{head}.kvidx`` (:mod:`kvstore.index.files`, each
checksummed and validated on load) and ``manifest.json`` (the spec, the token count and the
shape, under its own xxh3). It is written under a temporary name, every file fsynced, then
renamed into place, so a reader sees all of it or none. Every file is reached through the
store's confinement (:class:`kvstore.format.directory.Dir`). Indexes are over *positioned* keys:
RoPE
applied at positions ``0..T-1``, which is what a decode query at a later position scores
against; the files hold no keys, and loaded indexes are bound to a
:class:`~kvstore.index.keys.KeySource` that reads them from the KV.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np
import torch
import xxhash

from kvstore.errors import CorruptData
from kvstore.format.directory import Dir, UnsafePath
from kvstore.index.build import build_index
from kvstore.index.files import decode_index, encode_index
from kvstore.index.keys import ArrayKeys, KeySource
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
        heads = tuple(tuple(build_index(ArrayKeys(keys_pos[layer, h]), spec) for h in range(H))
                      for layer in range(L))
        return cls(spec=spec, n_tokens=T, heads=heads)

    def bind(self, source: KeySource) -> ContextIndexes:
        """The same indexes reading keys from ``source`` (ValueError if a head's keys do not
        have its shape)."""
        heads = tuple(tuple(ix.bind(source.head(layer, h)) for h, ix in enumerate(row))
                      for layer, row in enumerate(self.heads))
        return ContextIndexes(spec=self.spec, n_tokens=self.n_tokens, heads=heads)

    def stage(self, parent: Dir) -> tuple[str, int]:
        """Write every file, fsynced, into a new temporary directory in ``parent``; returns
        (its name, bytes written). :func:`publish` then renames it into place."""
        tmp = _new_temp_dir(parent, ".tmp-")
        try:
            total = 0
            with parent.sub(tmp) as d:
                for layer, row in enumerate(self.heads):
                    for h, ix in enumerate(row):
                        raw = encode_index(ix)
                        d.atomic_write(_file(layer, h), raw)
                        total += len(raw)
                body = json.dumps({"version": MANIFEST_VERSION, "spec": _spec_dict(self.spec),
                                   "n_tokens": self.n_tokens, "num_layers": self.num_layers,
                                   "num_kv_heads": self.num_kv_heads}, sort_keys=True)
                raw = json.dumps({"body": body,
                                  "xxh3": xxhash.xxh3_64_intdigest(body.encode())})
                d.atomic_write(MANIFEST, raw)
            return tmp, total + len(raw)
        except BaseException:
            parent.rmtree(tmp)
            raise

    def write(self, directory: str) -> int:
        """Write into ``directory`` atomically (an existing one is replaced); returns bytes."""
        parent_path, name = os.path.split(os.path.abspath(directory))
        with Dir.open_root(parent_path, create=True) as parent:
            tmp, n = self.stage(parent)
            publish(parent, tmp, name)
        return n


def _new_temp_dir(parent: Dir, prefix: str) -> str:
    for _ in range(100):
        name = f"{prefix}{secrets.token_hex(8)}"
        try:
            os.mkdir(name, 0o755, dir_fd=parent.fd)
            return name
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {parent.path!r}")


def publish(parent: Dir, tmp: str, name: str) -> None:
    """Rename a staged directory into place, replacing an existing one, durably. The old one
    is renamed aside first: a crash between the two renames leaves the context without
    indexes (the old ones a leftover collected at open), never with a mix of two."""
    old = None
    if parent.lstat(name) is not None:
        old = _new_temp_dir(parent, ".tmp-old-")
        with parent.sub(old) as aside:
            parent.rename(name, "indexes", into=aside)
    parent.rename(tmp, name)
    parent.fsync()
    if old is not None:
        parent.rmtree(old)


def read_manifest(d: Dir) -> dict[str, object]:
    """The checked manifest of the index directory ``d``; :class:`CorruptData` if it is
    missing, fails its checksum or does not describe a valid spec and shape."""
    path = d.show(MANIFEST)
    try:
        outer = json.loads(d.read_bytes(MANIFEST, limit=1 << 20))
        body = outer["body"]
        if xxhash.xxh3_64_intdigest(body.encode()) != outer["xxh3"]:
            raise CorruptData(f"index manifest {path!r} fails its checksum")
        meta = json.loads(body)
        if meta["version"] != MANIFEST_VERSION:
            raise CorruptData(f"index manifest {path!r} has unknown version {meta['version']!r}")
        meta["spec"] = IndexSpec(**meta["spec"])
        for name in ("n_tokens", "num_layers", "num_kv_heads"):
            if not isinstance(meta[name], int) or not 1 <= meta[name] <= 1 << 31:
                raise CorruptData(f"index manifest {path!r}: bad {name} {meta[name]!r}")
        return meta
    except (CorruptData, UnsafePath):
        raise
    except FileNotFoundError:
        raise CorruptData(f"index manifest {path!r} is missing") from None
    except (OSError, KeyError, TypeError, ValueError, AttributeError, RecursionError) as err:
        raise CorruptData(f"index manifest {path!r} is unreadable ({err})") from None


def read_context_indexes(d: Dir, source: KeySource | None = None, *,
                         rebuild: Callable[[int, int, IndexSpec], object] | None = None,
                         rewrite: bool = True) -> tuple[ContextIndexes, list[tuple[int, int]]]:
    """Load the index directory ``d``, each head bound to ``source.head(layer, head)``
    (unbound without a source: enough to check the files). A head file that is corrupt,
    missing, of an older format, or does not fit its manifest or its keys is rebuilt with
    ``rebuild(layer, head, spec)`` when given (and, with ``rewrite``, saved in place
    atomically), else raises :class:`CorruptData`. Returns (indexes, the (layer, head) pairs
    that were rebuilt). A bad manifest always raises: without it nothing can be rebuilt."""
    meta = read_manifest(d)
    spec, T = meta["spec"], meta["n_tokens"]
    rebuilt: list[tuple[int, int]] = []
    rows = []
    for layer in range(meta["num_layers"]):
        row = []
        for h in range(meta["num_kv_heads"]):
            name = _file(layer, h)
            what = repr(d.show(name))
            try:
                try:
                    raw = d.read_bytes(name)
                except FileNotFoundError:
                    raise CorruptData(f"index file {what} is missing") from None
                ix = decode_index(raw, what)
                if ix.kind != spec.kind or ix.n != T:
                    raise CorruptData(f"index file {what} does not match its manifest "
                                      f"({ix.kind}, {ix.n} tokens)")
                if source is not None:
                    try:
                        ix = ix.bind(source.head(layer, h))
                    except ValueError as err:
                        raise CorruptData(f"index file {what} does not fit its keys "
                                          f"({err})") from None
            except CorruptData:
                if rebuild is None:
                    raise
                ix = rebuild(layer, h, spec)
                if rewrite:
                    d.atomic_write(name, encode_index(ix))
                rebuilt.append((layer, h))
            row.append(ix)
        rows.append(tuple(row))
    return ContextIndexes(spec=spec, n_tokens=T, heads=tuple(rows)), rebuilt


def directory_bytes(d: Dir) -> int:
    return sum(d.check_file(f).st_size for f in d.listdir())
