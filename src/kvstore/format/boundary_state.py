"""The bytes of a boundary state: how a hybrid model's sliding windows and recurrent states
after exactly ``b`` tokens are laid out as the rows of a stored context.

The state at boundary ``b`` of tokens ``T`` is stored as the context::

    T[:b] + [STATE] * (d - b + m)        d = ceil(b / c) * c  (c: chunk_tokens)

where :data:`STATE` (2**32 - 2) is a token id no vocabulary has (public calls refuse it), and
the ``m`` positions from ``d`` on hold the state as K and V rows: a 16-byte header (magic,
version, length) then the engine's bytes, zero-padded to ``m`` whole rows and viewed as
``[num_layers, 2, num_kv_heads, m, head_dim]`` (K then V of each layer). Positions ``b..d-1``
(the rest of the chunk holding ``b``) keep what the caller gave there (an engine's whole last
block, as its pages hold it) or zeros; the state's rows begin on a chunk boundary, so an
engine's paged chunk is never split. Why and how it is found: :mod:`kvstore.view.boundaries`.
"""


from __future__ import annotations

import struct

import numpy as np

from kvstore.errors import CorruptData
from kvstore.format.chunk_extent import int_dtype
from kvstore.format.hashing import STATE_TOKEN
from kvstore.layout import KVLayout

STATE = STATE_TOKEN
_HEADER = struct.Struct("<4sIQ")  # magic, version, length of the engine's bytes
_MAGIC = b"KVBS"
_VERSION = 1


def data_start(b: int, chunk_tokens: int) -> int:
    """The position where the rows of a state at boundary ``b`` begin: the first chunk
    boundary at or after ``b``."""
    return -(-b // chunk_tokens) * chunk_tokens


def state_rows(layout: KVLayout, nbytes: int) -> int:
    """Rows (positions) a state of ``nbytes`` engine bytes takes."""
    return -(-(_HEADER.size + nbytes) // layout.token_bytes)


def max_state_tokens(layout: KVLayout, chunk_tokens: int) -> int:
    """The most STATE positions one boundary adds after its tokens (the rest of a chunk, then
    the rows of the largest state)."""
    return chunk_tokens - 1 + state_rows(layout, layout.state_bytes)


def check_state(layout: KVLayout, state: object, name: str = "state") -> memoryview:
    """``state`` as bytes a boundary of ``layout`` may carry (TypeError/ValueError naming
    ``name``)."""
    if not layout.boundary_state:
        raise ValueError(f"{name} is for layouts with sliding-window or recurrent layers "
                         f"(KVLayout.layers); this layout keeps the KV of every token only")
    if isinstance(state, np.ndarray):
        if state.dtype != np.uint8 or state.ndim != 1:
            raise TypeError(f"{name} must be bytes or a 1-D uint8 array, got {state.dtype} "
                            f"{state.shape}")
        view = memoryview(np.ascontiguousarray(state))
    elif isinstance(state, bytes | bytearray | memoryview):
        view = memoryview(state).cast("B")
    else:
        raise TypeError(f"{name} must be bytes or a 1-D uint8 array, got "
                        f"{type(state).__name__}")
    if not 0 < view.nbytes <= layout.state_bytes:
        raise ValueError(f"{name} must hold 1..{layout.state_bytes} bytes (the layout's "
                         f"state_bytes), got {view.nbytes}")
    return view


def encode(layout: KVLayout, state: memoryview) -> np.ndarray:
    """The rows of ``state``: raw integer views [L, 2, H, m, D] (K then V of each layer)."""
    m = state_rows(layout, state.nbytes)
    buf = np.zeros(m * layout.token_bytes, dtype=np.uint8)
    _HEADER.pack_into(buf, 0, _MAGIC, _VERSION, state.nbytes)
    buf[_HEADER.size : _HEADER.size + state.nbytes] = np.frombuffer(state, dtype=np.uint8)
    L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
    return buf.view(int_dtype(layout)).reshape(L, 2, H, m, D)  # the raw views' dtype


def decode(layout: KVLayout, rows: np.ndarray) -> bytes:
    """The engine's bytes from a state's rows [L, 2, H, m, D] (raw); CorruptData if the
    header is not one this module wrote for a state that fits them (a store is untrusted)."""
    buf = np.ascontiguousarray(rows).view(np.uint8).reshape(-1)
    magic, version, n = _HEADER.unpack_from(buf, 0)
    if magic != _MAGIC or version != _VERSION or not 0 < n <= min(
            layout.state_bytes, len(buf) - _HEADER.size) or state_rows(layout, n) != \
            rows.shape[3]:
        raise CorruptData(f"a stored boundary state's header is not valid (magic "
                          f"{magic!r}, version {version}, {n} bytes in {rows.shape[3]} rows)")
    return buf[_HEADER.size : _HEADER.size + n].tobytes()


def state_tokens(toks: np.ndarray, chunk_tokens: int, m: int) -> np.ndarray:
    """The tokens of the context carrying a state of ``m`` rows at boundary len(toks)."""
    b = len(toks)
    out = np.full(data_start(b, chunk_tokens) + m, STATE, dtype="<u4")
    out[:b] = toks
    return out




def with_state(layout: KVLayout, chunk_tokens: int, toks: np.ndarray, kr: np.ndarray,
               vr: np.ndarray, state: memoryview) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tokens and raw K/V [L, H, n, D] of the context carrying ``state`` at boundary
    len(toks), given the raw KV of ``toks`` (positions between the boundary and the state's
    rows are zeros)."""
    rows = encode(layout, state)  # [L, 2, H, m, D]
    b, m = len(toks), rows.shape[3]
    out_toks = state_tokens(toks, chunk_tokens, m)
    d = data_start(b, chunk_tokens)
    out = []
    for i, src in enumerate((kr, vr)):
        assert src.shape[2] == b, (src.shape, b)
        dst = np.empty(src.shape[:2] + (len(out_toks),) + src.shape[3:], dtype=src.dtype)
        dst[:, :, :b] = src
        dst[:, :, b:d] = 0
        dst[:, :, d:] = rows[:, i]
        out.append(dst)
    return out_toks, out[0], out[1]
