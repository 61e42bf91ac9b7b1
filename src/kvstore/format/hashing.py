"""Content addresses: chained chunk hashes seeded with the layout fingerprint and a namespace.

``h_i = xxh3_128(h_{i-1} || tokens_i as little-endian uint32)`` with ``h_{-1}`` the seed. Equal
prefixes (same layout, same namespace) get equal addresses; anything else never collides in
practice, and the store also compares token ids before serving a chunk.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch
import xxhash

HASH_BYTES = 16
_MAX_TOKEN = np.iinfo(np.uint32).max
# The token id that marks a boundary state's positions (kvstore.format.boundary_state): no
# vocabulary has it, and public calls refuse it, so only the store writes it.
STATE_TOKEN = _MAX_TOKEN - 1
STATE_TOKEN_BYTES = int(STATE_TOKEN).to_bytes(4, "little")


def chain_seed(layout_fingerprint: bytes, namespace: str | None) -> bytes:
    """The hash that precedes the first chunk of every context in ``namespace``."""
    if namespace is not None and not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str or None, got {type(namespace).__name__}")
    try:
        ns = b"\x00" if namespace is None else b"\x01" + namespace.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"namespace must be text UTF-8 can encode, got {namespace!r} "
                         f"({e.reason} at index {e.start})") from None
    return xxhash.xxh3_128_digest(b"kvstore/chain/v1\x00" + layout_fingerprint + ns)


def chunk_hash(parent: bytes, tokens: np.ndarray) -> bytes:
    """Address of a chunk holding ``tokens`` (uint32) after the chunk addressed ``parent``."""
    assert tokens.dtype == np.uint32 and len(parent) == HASH_BYTES
    return xxhash.xxh3_128_digest(parent + tokens.tobytes())


def as_tokens(tokens: object, name: str = "tokens") -> np.ndarray:
    """Validate token ids and return them as a contiguous 1-D little-endian uint32 array.

    Accepts a list/tuple of ints, a 1-D integer numpy array, or a 1-D integer torch tensor.
    Raises TypeError for non-integer input and ValueError for empty input, wrong rank, ids
    outside [0, 2**32), or :data:`STATE_TOKEN` (the store's own marker).
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer token ids, got a {tokens.dtype} tensor")
        arr = tokens.detach().cpu().numpy()
    elif isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, list | tuple | range):
        # fast path: plain ints (the ABC check below costs ~1 us per token)
        for t in ([] if all(type(t) is int for t in tokens) else tokens):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TypeError(
                    f"{name} must hold integer token ids, got {type(t).__name__} {t!r}"
                )
        try:
            arr = np.asarray(tokens, dtype=np.int64) if len(tokens) else np.zeros(0, np.int64)
        except OverflowError:
            raise ValueError(f"{name} must be in [0, 2**32), got an id beyond 64 bits"
                             ) from None
    else:
        raise TypeError(
            f"{name} must be a list, numpy array or torch tensor of ints, "
            f"got {type(tokens).__name__}"
        )
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        raise ValueError(f"{name} must not be empty")
    if arr.min() < 0 or arr.max() > _MAX_TOKEN:
        raise ValueError(f"{name} must be in [0, 2**32), got min {arr.min()} max {arr.max()}")
    out = np.ascontiguousarray(arr, dtype="<u4")
    if arr.max() >= STATE_TOKEN and (out == STATE_TOKEN).any():
        raise ValueError(f"{name} must not hold {STATE_TOKEN} (2**32 - 2), the id the store "
                         f"marks boundary states with")
    return out


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if neq.size else n
