"""The partial part of a llama.cpp sequence state: what a hybrid model keeps besides its
full-attention KV, checked field by field before llama.cpp sees it.

For the llama.cpp that llama-cpp-python 0.3.36 vendors, a sequence state of a model with
sliding-window layers (``llama_kv_cache_iswa``) or recurrent layers (``llama_memory_hybrid``)
is::

    u32 magic, i32 seq_id, base section, partial section

where the base section is the full-attention layers' KV section (:mod:`.state`) and the partial
section is what ``llama_state_seq_get_data_ext(..., LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)``
returns after its 8-byte header: either

* **sliding** (``llama_kv_cache::state_write`` of the SWA cache): ``u32 n_stream = 1, u32
  cell_count``, the cells ``(i32 pos, u32 n_seq_id = 1, i32 seq_id)``, then ``u32 v_trans,
  u32 n_layer`` and each sliding layer's K rows and V rows (or V transposed) as in any KV
  section. A sequence state keeps only the cells inside the window of its last position:
  after ``b`` tokens, positions ``b - min(b, W) .. b - 1`` (in the cache's ring order), so the
  section depends on ``b`` only;
* **recurrent** (``llama_memory_recurrent::state_write``): ``u32 cell_count = 1``, the cell
  ``(i32 pos = b - 1, u32 n_seq_id = 0)``, then ``u32 s_trans = 0, u32 n_layer`` and, for each
  recurrent layer, ``i32 type, u64 row bytes`` and its R row, then the same for S: a fixed size
  for a model.

That part exists only at ``b``: it is what the store keeps as the boundary state
(:mod:`kvstore.view.boundaries`). Its structure (types, row sizes, layer counts) is learned
once per model from a state llama.cpp itself writes (:func:`learn`: one token decoded in a
scratch context of the same model and settings), so a stored one is accepted only if every
field but its rows equals what this llama.cpp would write at that position; only then does it
reach ``llama_state_seq_set_data``, which checks them again against its own tensors.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.integrations.llama_cpp.state import MAX_CELLS, StateError

PARTIAL_ONLY = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
_HEADER = 8  # u32 magic, i32 seq_id
_MAX_TYPE = 64  # ggml type ids are below this


@dataclass(frozen=True)
class LayerRows:
    """One layer's K (or V, or R, or S) field: ggml type and bytes per cell (row bytes; for a
    transposed V, ``element`` bytes times ``n_embd`` values per cell)."""

    type: int
    row: int
    element: int = 0  # transposed V: bytes per element (then row = element * n_embd)


@dataclass(frozen=True)
class SlidingShape:
    """The sliding layers' KV section: layer count, V transposed or not, and each layer's K
    and V fields."""

    window: int
    v_trans: bool
    k: tuple[LayerRows, ...]
    v: tuple[LayerRows, ...]

    def cells(self, b: int) -> int:
        return min(b, self.window)

    def size(self, cells: int) -> int:
        return 8 + 12 * cells + 8 + sum(12 + cells * f.row for f in self.k + self.v)


@dataclass(frozen=True)
class RecurrentShape:
    """The recurrent section of a model: its bytes at one position (a live template) and the
    (offset, length) of every field that is not a row or the position."""

    template: bytes
    fields: tuple[tuple[int, int], ...]
    rows: tuple[LayerRows, ...]  # R of each recurrent layer, then S of each


@dataclass(frozen=True)
class PartialFormat:
    """What a boundary of this model keeps besides its full-attention KV: ``kind`` is
    ``"sliding"`` or ``"recurrent"``, ``shape`` its structure. Thread-safety: immutable."""

    kind: str
    shape: SlidingShape | RecurrentShape

    @property
    def max_bytes(self) -> int:
        """The most bytes a partial section of this model takes."""
        if isinstance(self.shape, SlidingShape):
            return self.shape.size(self.shape.window)
        return len(self.shape.template)

    def check(self, data: bytes | memoryview | np.ndarray, b: int) -> None:
        """StateError naming the field unless ``data`` is this model's partial section after
        exactly ``b`` tokens of sequence 0 (as llama.cpp writes it; rows not looked at)."""
        buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        if isinstance(self.shape, SlidingShape):
            _check_sliding(self.shape, buf, b)
        else:
            _check_recurrent(self.shape, buf, b)


def _u32(buf: np.ndarray, at: int) -> int:
    return struct.unpack_from("<I", buf, at)[0]


def _fail(what: str) -> StateError:
    return StateError(f"partial state: {what}")


def _check_sliding(shape: SlidingShape, buf: np.ndarray, b: int) -> None:
    n = shape.cells(b)
    if len(buf) != shape.size(n):
        raise _fail(f"{len(buf)} bytes, expected {shape.size(n)} for {n} window cells after "
                    f"{b} tokens")
    if _u32(buf, 0) != 1 or _u32(buf, 4) != n:
        raise _fail(f"n_stream {_u32(buf, 0)} and cell_count {_u32(buf, 4)}, expected 1 and "
                    f"{n}")
    cells = buf[8 : 8 + 12 * n].view("<i4").reshape(n, 3)  # (pos, n_seq_id, seq_id)
    if (cells[:, 1] != 1).any() or (cells[:, 2] != 0).any():
        raise _fail("a window cell is not of sequence 0 alone")
    if not np.array_equal(np.sort(cells[:, 0]), np.arange(b - n, b, dtype=np.int32)):
        raise _fail(f"the window cells do not hold positions {b - n}..{b - 1} once each")
    at = 8 + 12 * n
    if _u32(buf, at) != int(shape.v_trans) or _u32(buf, at + 4) != len(shape.k):
        raise _fail(f"v_trans {_u32(buf, at)} and n_layer {_u32(buf, at + 4)}, expected "
                    f"{int(shape.v_trans)} and {len(shape.k)}")
    at += 8
    for which, fields in (("K", shape.k), ("V", shape.v)):
        for layer, f in enumerate(fields):
            t = struct.unpack_from("<i", buf, at)[0]
            if f.element:
                el, embd = struct.unpack_from("<II", buf, at + 4)
                ok = (t, el, el * embd) == (f.type, f.element, f.row)
            else:
                ok = (t, struct.unpack_from("<Q", buf, at + 4)[0]) == (f.type, f.row)
            if not ok:
                raise _fail(f"window layer {layer} {which} header differs from this model's")
            at += 12 + n * f.row
    assert at == len(buf)


def _check_recurrent(shape: RecurrentShape, buf: np.ndarray, b: int) -> None:
    t = np.frombuffer(shape.template, dtype=np.uint8)
    if len(buf) != len(t):
        raise _fail(f"{len(buf)} bytes, expected this model's {len(t)}")
    if _u32(buf, 0) != 1 or struct.unpack_from("<i", buf, 4)[0] != b - 1 or _u32(buf, 8) != 0:
        raise _fail(f"the recurrent cell is not position {b - 1} of one sequence")
    for at, n in shape.fields:
        if not np.array_equal(buf[at : at + n], t[at : at + n]):
            raise _fail(f"the field at offset {at} differs from this model's")


def parse_sliding(buf: np.ndarray, window: int) -> SlidingShape:
    """The shape of a sliding layers' KV section llama.cpp wrote (a trusted template)."""
    if _u32(buf, 0) != 1:
        raise _fail("the window section has several streams")
    n = _u32(buf, 4)
    if not 0 < n <= MAX_CELLS:
        raise _fail(f"a template needs window cells, got {n}")
    at = 8 + 12 * n
    v_trans, n_layer = _u32(buf, at), _u32(buf, at + 4)
    at += 8
    k, v = [], []
    for _ in range(n_layer):
        t, row = struct.unpack_from("<iQ", buf, at)
        k.append(LayerRows(t, row))
        at += 12 + n * row
    for _ in range(n_layer):
        t = struct.unpack_from("<i", buf, at)[0]
        if v_trans:
            el, embd = struct.unpack_from("<II", buf, at + 4)
            v.append(LayerRows(t, el * embd, el))
            at += 12 + n * el * embd
        else:
            row = struct.unpack_from("<Q", buf, at + 4)[0]
            v.append(LayerRows(t, row))
            at += 12 + n * row
    if at != len(buf) or v_trans not in (0, 1):
        raise _fail("the window section's template does not parse")
    return SlidingShape(window=window, v_trans=bool(v_trans), k=tuple(k), v=tuple(v))


def parse_recurrent(buf: np.ndarray) -> RecurrentShape:
    """The shape of a recurrent section llama.cpp wrote for one cell (a trusted template):
    R entries then as many S entries, each ``i32 type, u64 row bytes, row``. A model whose
    section does not parse so (extra per-layer rows) is not supported."""
    if _u32(buf, 0) != 1 or _u32(buf, 8) != 0 or _u32(buf, 12) != 0:
        raise _fail("the recurrent template is not one cell of one sequence, untransposed")
    fields = [(0, 4), (8, 8), (16, 4)]  # cell_count; n_seq_id, s_trans; n_layer
    rows = []
    at = 20
    while at < len(buf):
        if at + 12 > len(buf):
            raise _fail("the recurrent template ends inside a field")
        t, row = struct.unpack_from("<iQ", buf, at)
        if not 0 <= t < _MAX_TYPE or not 0 <= row <= len(buf):
            raise _fail(f"the recurrent template has a field it does not know at {at}")
        fields.append((at, 12))
        rows.append(LayerRows(t, row))
        at += 12 + row
    if at != len(buf) or not rows or len(rows) % 2:
        raise _fail("the recurrent template is not R rows then S rows, one per layer")
    return RecurrentShape(template=bytes(buf), fields=tuple(fields), rows=tuple(rows))


def learn(llm: Any, *, kind: str, window: int) -> tuple[bytes, PartialFormat]:
    """Decode one token in a scratch context of ``llm``'s model and settings and read its
    sequence state: returns (the whole state, the partial format it shows). Leaves ``llm``'s
    own context alone. StateError if llama.cpp writes something this module does not know."""
    import llama_cpp

    params = llama_cpp.llama_context_params.from_buffer_copy(llm.context_params)
    params.n_ctx = max(256, 2 * window)
    params.n_batch = params.n_ubatch = 8
    params.n_seq_max = 1
    params.n_threads = params.n_threads_batch = 1
    ctx = llama_cpp.llama_init_from_model(llm.model, params)
    if ctx is None:
        raise StateError("llama.cpp could not make a scratch context to learn the state shape")
    try:
        tok = (llama_cpp.llama_token * 1)(max(0, int(llm.token_bos())))
        if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tok, 1)) != 0:
            raise StateError("llama.cpp could not decode a token in the scratch context")
        whole = read_seq(ctx, 0)
        part = read_seq(ctx, PARTIAL_ONLY)
    finally:
        llama_cpp.llama_free(ctx)
    if len(part) < _HEADER or not whole.endswith(part[_HEADER:]):
        raise StateError("the partial state is not the end of the sequence state")
    body = np.frombuffer(part, dtype=np.uint8)[_HEADER:]
    shape: SlidingShape | RecurrentShape = (parse_sliding(body, window) if kind == "sliding"
                                            else parse_recurrent(body))
    return whole, PartialFormat(kind=kind, shape=shape)


def read_seq(ctx: Any, flags: int) -> bytes:
    """Sequence 0's state of a llama.cpp context (``flags``: 0 whole, PARTIAL_ONLY)."""
    import llama_cpp

    n = llama_cpp.llama_state_seq_get_size_ext(ctx, 0, flags)
    buf = (ctypes.c_uint8 * n)()
    got = llama_cpp.llama_state_seq_get_data_ext(ctx, buf, n, 0, flags)
    if got != n:
        raise StateError(f"llama.cpp wrote {got} bytes of a {n}-byte sequence state")
    return bytes(buf)
