"""Block hashes as vLLM computes them, so that a router matches the store's events against the
prompts it hashes.

vLLM hashes a request's tokens in blocks of ``block_size``: ``h_i = H((h_{i-1}, tokens_i,
extra_keys_i))`` with ``h_{-1} = NONE_HASH = H(seed)`` (``vllm.v1.core.kv_cache_utils.
hash_block_tokens``), ``H`` the engine's ``--prefix-caching-hash-algo``. The store's own
publisher uses ``sha256_cbor`` (SHA-256 of canonical CBOR), the one of vLLM's algorithms that
another language can reproduce, with vLLM's default seed ``"vllm-none-hash"`` (vLLM takes
``PYTHONHASHSEED`` instead when it is set: give the same string as ``hash_seed``). A
namespace is hashed as vLLM hashes a request's ``cache_salt``: the extra key
``("cache_salt", namespace)`` of the first block. The store's own chain hash (xxh3 of chunks,
:mod:`kvstore.format.hashing`) is not a vLLM hash and never appears in events.

:func:`cbor` is the canonical CBOR of the values these hashes take (unsigned and negative ints,
byte and text strings, tuples and lists, None): ``tests/kvstore/events/test_hashing.py``
checks it against ``cbor2.dumps(..., canonical=True)`` and every hash against vLLM's own
functions.

Thread-safety: pure functions; a :class:`CborBlockHasher` is immutable.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from typing import Any, Protocol

DEFAULT_SEED = "vllm-none-hash"  # vLLM's NONE_HASH seed for cryptographic hashes
_U8, _U16, _U32, _U64 = (struct.Struct(f">{c}") for c in "BHIQ")


def _head(major: int, n: int, out: bytearray) -> None:
    m = major << 5
    if n < 24:
        out.append(m | n)
    elif n < 1 << 8:
        out.append(m | 24)
        out += _U8.pack(n)
    elif n < 1 << 16:
        out.append(m | 25)
        out += _U16.pack(n)
    elif n < 1 << 32:
        out.append(m | 26)
        out += _U32.pack(n)
    elif n < 1 << 64:
        out.append(m | 27)
        out += _U64.pack(n)
    else:
        raise ValueError(f"an int of {n.bit_length()} bits has no CBOR head")


def _encode(value: Any, out: bytearray) -> None:
    if value is None:
        out.append(0xF6)
    elif value is True or value is False:
        out.append(0xF5 if value else 0xF4)
    elif isinstance(value, int):
        if value >= 0:
            _head(0, value, out)
        else:
            _head(1, -1 - value, out)
    elif isinstance(value, bytes | bytearray | memoryview):
        b = bytes(value)
        _head(2, len(b), out)
        out += b
    elif isinstance(value, str):
        b = value.encode("utf-8")
        _head(3, len(b), out)
        out += b
    elif isinstance(value, tuple | list):
        _head(4, len(value), out)
        for v in value:
            _encode(v, out)
    else:
        raise TypeError(f"no canonical CBOR for a {type(value).__name__} in a block hash")


def cbor(value: Any) -> bytes:
    """The canonical CBOR encoding of ``value`` (what ``cbor2.dumps(value, canonical=True)``
    writes for these types)."""
    out = bytearray()
    _encode(value, out)
    return bytes(out)


def sha256_cbor(value: Any) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of the canonical CBOR of ``value``."""
    return hashlib.sha256(cbor(value)).digest()


@functools.lru_cache(maxsize=1 << 17)
def _token_cbor(t: int) -> bytes:
    """One token id's canonical CBOR (cached: a vocabulary's ids recur)."""
    if t < 24:
        return bytes((t,))
    if t < 1 << 8:
        return b"\x18" + _U8.pack(t)
    if t < 1 << 16:
        return b"\x19" + _U16.pack(t)
    return b"\x1a" + _U32.pack(t)


def tokens_cbor(tokens: Sequence[int]) -> bytes:
    """The canonical CBOR of a tuple of token ids (each in [0, 2**32))."""
    out = bytearray()
    _head(4, len(tokens), out)
    return bytes(out) + b"".join(map(_token_cbor, tokens))


def namespace_extra_keys(namespace: str | None) -> tuple[tuple[str, str], ...] | None:
    """The extra keys of a context's first block in ``namespace`` (vLLM's for a request with
    ``cache_salt=namespace``); None for the default namespace."""
    return None if namespace is None else (("cache_salt", namespace),)


def event_extra_keys(keys: tuple[tuple[Any, ...], ...] | None) -> tuple[Any, ...] | None:
    """Extra keys as events publish them (vLLM's ``to_event_extra_keys``, per block): the
    values without their tags (a ``("cache_salt", s)`` key is published as ``s``)."""
    if keys is None:
        return None
    return tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)


class BlockHasher(Protocol):
    """How one engine hashes blocks: ``block_hash(parent, tokens, extra_keys)`` (parent None
    for a prompt's first block), and the form hashes take in events."""

    def block_hash(self, parent: bytes | None, tokens: Sequence[int],
                   extra_keys: tuple[Any, ...] | None) -> bytes: ...

    def external(self, digest: bytes) -> bytes | int: ...


class CborBlockHasher:
    """vLLM's block hash with ``--prefix-caching-hash-algo sha256_cbor`` and NONE_HASH seed
    ``seed``; hashes go out as ints (their last 8 bytes, big-endian: vLLM's default) unless
    ``int_hashes`` is False."""

    def __init__(self, seed: str = DEFAULT_SEED, *, int_hashes: bool = True) -> None:
        if not isinstance(seed, str):
            raise TypeError(f"hash_seed must be a str, got {type(seed).__name__}")
        self.seed = seed
        self.int_hashes = int_hashes
        self.none_hash = sha256_cbor(seed)
        # (parent, tokens, extra): a 3-array whose first item is a 32-byte string
        self._head = b"\x83\x58\x20"

    def block_hash(self, parent: bytes | None, tokens: Sequence[int],
                   extra_keys: tuple[Any, ...] | None) -> bytes:
        p = parent or self.none_hash
        if len(p) != 32:  # a parent of another length (not SHA-256): the general encoder
            return sha256_cbor((p, tuple(tokens), extra_keys))
        tail = b"\xf6" if extra_keys is None else cbor(extra_keys)
        return hashlib.sha256(self._head + p + tokens_cbor(tokens) + tail).digest()

    def external(self, digest: bytes) -> bytes | int:
        return int.from_bytes(digest[-8:], "big") if self.int_hashes else digest


__all__ = ["BlockHasher", "CborBlockHasher", "DEFAULT_SEED", "cbor", "event_extra_keys",
           "namespace_extra_keys", "sha256_cbor", "tokens_cbor"]
