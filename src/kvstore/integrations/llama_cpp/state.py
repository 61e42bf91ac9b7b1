"""llama.cpp's KV state, field by field: the sequence state and the whole-context state of the
llama.cpp that llama-cpp-python 0.3.36 vendors.

The bytes (little-endian; ``llama-context.cpp`` and ``llama-kv-cache.cpp``)::

    sequence state       u32 magic 0xaf143cd8, i32 seq_id, KV section
    whole-context state  u32 len, the architecture name (len bytes), KV section
    KV section           u32 n_stream, then per stream: u32 cell_count, and if cells:
                           cell_count x (i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id)
                           u32 v_trans, u32 n_layer
                           per layer: i32 k_type, u64 k_row_bytes, cell_count K rows
                           V, per layer, either (v_trans = 0, flash attention on)
                             i32 v_type, u64 v_row_bytes, cell_count V rows
                           or (v_trans = 1, flash attention off)
                             i32 v_type, u32 v_element_bytes, u32 n_embd_v_gqa,
                             n_embd_v_gqa x cell_count elements (V transposed)

A row is one token's K (or V) of one layer, head-major: ``[kv_heads, head_dim]``. The section
has no version field and its layout changes with the attention mode, the KV type, the number
of streams and the model kind, so a :class:`StateFormat` states every one of those, and the
codec checks every field against it: anything else (quantized KV types, several streams,
cells shared by several sequences, cells out of position order, M-RoPE cell extras, a byte
too many or too few) is a :class:`StateError` naming the field, never a guess.

Parsed KV is ``[layers, kv_heads, tokens, head_dim]`` in the KV type, keys rotated exactly as
llama.cpp holds them; writing it back gives the same bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

SEQ_MAGIC = 0xAF143CD8
# ggml type id -> (KVLayout dtype, raw integer view used to move the bytes)
KV_TYPES: dict[int, tuple[str, np.dtype]] = {
    0: ("float32", np.dtype("<i4")),
    1: ("float16", np.dtype("<i2")),
    30: ("bfloat16", np.dtype("<i2")),
}
# names of the ggml types a KV cache may hold, for messages
GGML_TYPE_NAMES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0",
                   20: "iq4_nl", 30: "bf16"}
MAX_CELLS = 1 << 24  # more cells than any context llama.cpp can hold: a damaged count


class StateError(ValueError):
    """A llama.cpp state (or a model's KV layout) this codec does not understand; the message
    names the field and what was expected."""


def type_name(ggml_type: int) -> str:
    return GGML_TYPE_NAMES.get(ggml_type, f"ggml type {ggml_type}")


@dataclass(frozen=True, kw_only=True)
class StateFormat:
    """Everything that decides the bytes of a KV state, for one llama.cpp context: the model's
    architecture name (the whole-context state's tag), its layers, kv-heads and head size, the
    KV type (one ggml type for K and V: f32, f16 or bf16) and whether V is stored transposed
    (``v_trans``: flash attention off). One stream, each cell in exactly one sequence.

    Thread-safety: immutable; every method may be called from any number of threads (each
    reads only its arguments and writes only the buffers it returns)."""

    arch: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_type: int
    v_trans: bool

    def __post_init__(self) -> None:
        if not isinstance(self.arch, str) or not self.arch or not self.arch.isascii():
            raise ValueError(f"StateFormat.arch must be a non-empty ASCII str, got "
                             f"{self.arch!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"StateFormat.{name} must be a positive int, got {v!r}")
        if isinstance(self.kv_type, bool) or not isinstance(self.kv_type, int):
            raise ValueError(f"StateFormat.kv_type must be a ggml type id, got "
                             f"{self.kv_type!r}")
        if self.kv_type not in KV_TYPES:
            raise StateError(f"KV type {type_name(self.kv_type)} is not supported: only "
                             f"f32, f16 and bf16 KV are stored (a quantized KV cache's blocks "
                             f"are not one value per element)")
        if not isinstance(self.v_trans, bool):
            raise ValueError(f"StateFormat.v_trans must be a bool, got {self.v_trans!r}")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def dtype(self) -> str:
        """The KVLayout dtype of this KV type."""
        return KV_TYPES[self.kv_type][0]

    @property
    def raw_dtype(self) -> np.dtype:
        return KV_TYPES[self.kv_type][1]

    @property
    def itemsize(self) -> int:
        return self.raw_dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer: ``[kv_heads, head_dim]``."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @cached_property
    def arch_tag(self) -> bytes:
        """The whole-context state's opening: u32 length, then the architecture name."""
        name = self.arch.encode("ascii")
        return struct.pack("<I", len(name)) + name

    def section_bytes(self, n: int) -> int:
        """Bytes of the KV section holding ``n`` cells of one sequence."""
        if n == 0:
            return 8  # n_stream, cell_count
        return 8 + 12 * n + 8 + 2 * self.num_layers * (12 + n * self.row_bytes)

    def seq_bytes(self, n: int) -> int:
        return 8 + self.section_bytes(n)

    def context_bytes(self, n: int) -> int:
        return len(self.arch_tag) + self.section_bytes(n)

    # ---- parsing ---------------------------------------------------------------------------
    def parse_seq(self, data: bytes | bytearray | memoryview | np.ndarray) -> StateKV:
        """The KV of a sequence state (``llama_state_seq_get_data``): checked field by field
        (StateError naming the first that differs). Its cells must hold positions 0..n-1 in
        order, each in the state's sequence alone."""
        r, seq_id = _seq_reader(data)
        return self._parse_section(r, seq_id)

    def parse_seq_head(self, data: bytes | bytearray | memoryview | np.ndarray
                       ) -> tuple[StateKV, int]:
        """The full-attention KV of a hybrid model's sequence state (its first section, checked
        as :meth:`parse_seq` checks a whole one) and the offset where that section ends: the
        partial section (:mod:`.partial`) follows."""
        r, seq_id = _seq_reader(data)
        kv = self._parse_section(r, seq_id, to_end=False)
        return kv, r.pos

    def parse_context(self, data: bytes | bytearray | memoryview | np.ndarray) -> StateKV:
        """The KV of a whole-context state (``llama_state_get_data``, the ``llama_state`` of a
        ``LlamaState``): the architecture tag must be this format's, and every cell must hold
        position i of sequence 0 alone (one sequence, filled in order)."""
        r = _Reader(data, "whole-context state")
        n = r.u32("architecture name length")
        name = r.take(n, "architecture name").tobytes() if n <= 64 else None
        if name != self.arch.encode("ascii"):
            shown = repr(name.decode("ascii", "replace")) if name is not None \
                else f"a name of {n} bytes"
            raise StateError(f"whole-context state: the architecture is {shown}, expected "
                             f"{self.arch!r}")
        return self._parse_section(r, 0)

    def _parse_section(self, r: _Reader, seq_id: int, *, to_end: bool = True) -> StateKV:
        n_stream = r.u32("n_stream")
        if n_stream != 1:
            raise StateError(f"{r.what}: n_stream is {n_stream}; only one stream (a unified "
                             f"KV cache, or one sequence) is supported")
        n = r.u32("cell_count")
        if n == 0:
            if to_end:
                r.end()
            L, H, D = self.num_layers, self.num_kv_heads, self.head_dim
            empty = torch.empty((L, H, 0, D), dtype=_torch_dtype(self.dtype))
            return StateKV(keys=empty, values=empty.clone())
        if n > MAX_CELLS:
            raise StateError(f"{r.what}: cell_count is {n}, more than {MAX_CELLS}")
        self._check_cells(r, n, seq_id)
        v_trans = r.u32("v_trans")
        if v_trans != int(self.v_trans):
            mode = "off" if v_trans else "on"
            raise StateError(f"{r.what}: v_trans is {v_trans} (flash attention {mode}), "
                             f"expected {int(self.v_trans)}: the state comes from a context "
                             f"with another flash-attention mode")
        n_layer = r.u32("n_layer")
        if n_layer != self.num_layers:
            raise StateError(f"{r.what}: n_layer is {n_layer}, expected {self.num_layers}")
        k_at = self._check_rows(r, n, "K")
        if self.v_trans:
            v_at = self._check_transposed(r, n)
        else:
            v_at = self._check_rows(r, n, "V")
        if to_end:
            r.end()
        keys = self._copy_out(r.buf, k_at, n, transposed=False)
        values = self._copy_out(r.buf, v_at, n, transposed=self.v_trans)
        return StateKV(keys=keys, values=values)

    def _check_cells(self, r: _Reader, n: int, seq_id: int) -> None:
        cells = r.take(12 * n, "cells").view("<i4").reshape(n, 3)  # (pos, n_seq_id, seq_id)
        bad = np.flatnonzero(cells[:, 1] != 1)
        if len(bad):
            i = int(bad[0])
            raise StateError(f"{r.what}: cell {i} belongs to {int(cells[i, 1])} sequences; "
                             f"only cells of exactly one sequence are supported")
        bad = np.flatnonzero(cells[:, 0] != np.arange(n, dtype=np.int32))
        if len(bad):
            i = int(bad[0])
            raise StateError(f"{r.what}: cell {i} holds position {int(cells[i, 0])}, expected "
                             f"{i}: only cells holding positions 0..{n - 1} in order are "
                             f"supported (or the cells carry M-RoPE extras)")
        bad = np.flatnonzero(cells[:, 2] != seq_id)
        if len(bad):
            i = int(bad[0])
            raise StateError(f"{r.what}: cell {i} belongs to sequence {int(cells[i, 2])}, "
                             f"expected {seq_id}")

    def _check_type(self, r: _Reader, layer: int, which: str) -> None:
        t = r.i32(f"layer {layer} {which} type")
        if t != self.kv_type:
            raise StateError(f"{r.what}: layer {layer} {which} type is {type_name(t)}, "
                             f"expected {type_name(self.kv_type)}")

    def _check_rows(self, r: _Reader, n: int, which: str) -> list[int]:
        """Check each layer's (type, row bytes) header; return the offsets of its rows."""
        at = []
        for layer in range(self.num_layers):
            self._check_type(r, layer, which)
            row = r.u64(f"layer {layer} {which} row bytes")
            if row != self.row_bytes:
                raise StateError(f"{r.what}: layer {layer} {which} rows are {row} bytes, "
                                 f"expected {self.row_bytes} ({self.num_kv_heads} kv-heads x "
                                 f"{self.head_dim} x {self.itemsize} bytes)")
            at.append(r.pos)
            r.take(n * row, f"layer {layer} {which} rows")
        return at

    def _check_transposed(self, r: _Reader, n: int) -> list[int]:
        at = []
        embd = self.num_kv_heads * self.head_dim
        for layer in range(self.num_layers):
            self._check_type(r, layer, "V")
            el = r.u32(f"layer {layer} V element bytes")
            if el != self.itemsize:
                raise StateError(f"{r.what}: layer {layer} V elements are {el} bytes, "
                                 f"expected {self.itemsize}")
            e = r.u32(f"layer {layer} n_embd_v_gqa")
            if e != embd:
                raise StateError(f"{r.what}: layer {layer} n_embd_v_gqa is {e}, expected "
                                 f"{embd}")
            at.append(r.pos)
            r.take(n * embd * self.itemsize, f"layer {layer} V")
        return at

    def _views(self, buf: np.ndarray, at: list[int], n: int, *, transposed: bool
               ) -> np.ndarray:
        """Raw integer views [L, H, n, D] of the layers' data at byte offsets ``at`` of
        ``buf``: rows ``[n, H, D]`` per layer, or (transposed) ``[H, D, n]``."""
        L, H, D, s = self.num_layers, self.num_kv_heads, self.head_dim, self.itemsize
        step = at[1] - at[0] if L > 1 else 0
        assert all(a == at[0] + i * step for i, a in enumerate(at))
        base = buf[at[0]:]
        if transposed:  # [H*D, n] per layer
            strides = (step, D * n * s, s, n * s)
        else:  # [n, H*D] per layer
            strides = (step, D * s, H * D * s, s)
        return _as_strided(base, (L, H, n, D), strides, self.raw_dtype)

    def _copy_out(self, buf: np.ndarray, at: list[int], n: int, *, transposed: bool
                  ) -> torch.Tensor:
        src = self._views(buf, at, n, transposed=transposed)  # [L, H, n, D] raw, strided
        out = np.empty(src.shape, dtype=self.raw_dtype)  # numpy memory: fast first touch
        np.copyto(out, src)
        return torch.from_numpy(out).view(_torch_dtype(self.dtype))

    # ---- writing ---------------------------------------------------------------------------
    def seq_buffer(self, n: int, *, seq_id: int = 0, partial: bytes | None = None
                   ) -> StateBuffer:
        """A sequence state of ``n`` cells (positions 0..n-1 of ``seq_id``) whose headers are
        written and whose K and V are views to fill: ``StateBuffer.keys``/``values`` are
        [L, H, n, D] tensors over the state's bytes (e.g. ``store.get(..., out=(k, v))``).
        ``partial``: a hybrid model's partial section (checked by the caller), appended."""
        _check_count(n)
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < 0:
            raise ValueError(f"seq_id must be an int >= 0, got {seq_id!r}")
        tail = b"" if partial is None else partial
        buf = np.empty(self.seq_bytes(n) + len(tail), dtype=np.uint8)
        struct.pack_into("<Ii", buf, 0, SEQ_MAGIC, seq_id)
        if tail:
            buf[self.seq_bytes(n):] = np.frombuffer(tail, dtype=np.uint8)
        return self._fill_section(buf, 8, n, seq_id, end=self.seq_bytes(n))

    def context_buffer(self, n: int) -> StateBuffer:
        """A whole-context state of ``n`` cells (positions 0..n-1 of sequence 0), headers
        written, K and V to fill as for :meth:`seq_buffer`. Its data offsets follow the
        architecture name, so the views may be unaligned: fill them with numpy
        (:meth:`write_context`), not as torch outputs."""
        _check_count(n)
        tag = self.arch_tag
        buf = np.empty(self.context_bytes(n), dtype=np.uint8)
        buf[: len(tag)] = np.frombuffer(tag, dtype=np.uint8)
        return self._fill_section(buf, len(tag), n, 0)

    def _fill_section(self, buf: np.ndarray, at: int, n: int, seq_id: int,
                      end: int | None = None) -> StateBuffer:
        struct.pack_into("<II", buf, at, 1, n)
        at += 8
        if n == 0:
            return StateBuffer(data=buf, raw_keys=None, raw_values=None, dtype=self.dtype)
        cells = buf[at : at + 12 * n].view("<i4").reshape(n, 3)
        cells[:, 0] = np.arange(n, dtype=np.int32)
        cells[:, 1] = 1
        cells[:, 2] = seq_id
        at += 12 * n
        struct.pack_into("<II", buf, at, int(self.v_trans), self.num_layers)
        at += 8
        k_at = []
        for _ in range(self.num_layers):
            struct.pack_into("<iQ", buf, at, self.kv_type, self.row_bytes)
            k_at.append(at + 12)
            at += 12 + n * self.row_bytes
        v_at = []
        embd = self.num_kv_heads * self.head_dim
        for _ in range(self.num_layers):
            if self.v_trans:
                struct.pack_into("<iII", buf, at, self.kv_type, self.itemsize, embd)
            else:
                struct.pack_into("<iQ", buf, at, self.kv_type, self.row_bytes)
            v_at.append(at + 12)
            at += 12 + n * self.row_bytes
        assert at == (len(buf) if end is None else end)
        return StateBuffer(data=buf, raw_keys=self._views(buf, k_at, n, transposed=False),
                           raw_values=self._views(buf, v_at, n, transposed=self.v_trans),
                           dtype=self.dtype)

    def write_seq(self, keys: torch.Tensor, values: torch.Tensor, *, seq_id: int = 0
                  ) -> np.ndarray:
        """The sequence state (uint8 array) of KV ``[L, H, n, D]`` at positions 0..n-1."""
        n = self._check_kv(keys, values)
        state = self.seq_buffer(n, seq_id=seq_id)
        state.fill(keys, values)
        return state.data

    def write_context(self, keys: torch.Tensor, values: torch.Tensor) -> np.ndarray:
        """The whole-context state (uint8 array) of KV ``[L, H, n, D]`` at positions 0..n-1
        of sequence 0."""
        n = self._check_kv(keys, values)
        state = self.context_buffer(n)
        state.fill(keys, values)
        return state.data

    def _check_kv(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        want = (self.num_layers, self.num_kv_heads, None, self.head_dim)
        dt = _torch_dtype(self.dtype)
        for name, t in (("keys", keys), ("values", values)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != dt or t.device.type != "cpu" or t.dim() != 4 or any(
                    w is not None and s != w for s, w in zip(t.shape, want, strict=True)):
                raise ValueError(f"{name} must be a CPU {dt} tensor [num_layers="
                                 f"{self.num_layers}, num_kv_heads={self.num_kv_heads}, n, "
                                 f"head_dim={self.head_dim}], got {t.dtype} {list(t.shape)} "
                                 f"on {t.device}")
        if keys.shape != values.shape:
            raise ValueError(f"keys and values must have one shape, got {list(keys.shape)} and "
                             f"{list(values.shape)}")
        return int(keys.shape[2])


@dataclass(frozen=True)
class StateKV:
    """KV parsed from a state: keys and values [layers, kv_heads, tokens, head_dim] (keys
    rotated, as llama.cpp holds them), at positions 0..tokens-1."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])


@dataclass(frozen=True)
class StateBuffer:
    """A state's bytes with its K and V regions as raw integer views [L, H, n, D]."""

    data: np.ndarray  # uint8, the whole state
    raw_keys: np.ndarray | None
    raw_values: np.ndarray | None
    dtype: str

    @property
    def keys(self) -> torch.Tensor:
        """The K region as a tensor [L, H, n, D] sharing the state's memory (strided)."""
        return _tensor(self.raw_keys, self.dtype)

    @property
    def values(self) -> torch.Tensor:
        return _tensor(self.raw_values, self.dtype)

    def fill(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy KV [L, H, n, D] (CPU, the state's dtype) into the state."""
        if self.raw_keys is None:
            return
        for dst, src in ((self.raw_keys, keys), (self.raw_values, values)):
            np.copyto(dst, src.contiguous().view(_torch_int(dst.dtype)).numpy())


class _Reader:
    """Reads fields from a state's bytes; a field past the end is a StateError naming it."""

    def __init__(self, data: bytes | bytearray | memoryview | np.ndarray, what: str) -> None:
        if isinstance(data, np.ndarray):
            if data.dtype != np.uint8 or data.ndim != 1:
                raise TypeError(f"{what} must be bytes or a 1-D uint8 array, got "
                                f"{data.dtype} {data.shape}")
            self.buf = data
        elif isinstance(data, bytes | bytearray | memoryview):
            self.buf = np.frombuffer(data, dtype=np.uint8)
        else:
            raise TypeError(f"{what} must be bytes or a 1-D uint8 array, got "
                            f"{type(data).__name__}")
        self.what = what
        self.pos = 0

    def take(self, n: int, field: str) -> np.ndarray:
        if n > len(self.buf) - self.pos:
            raise StateError(f"{self.what}: ends inside {field} (needs {n} bytes at offset "
                             f"{self.pos}, {len(self.buf) - self.pos} left)")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def _unpack(self, fmt: str, field: str) -> int:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size, field).tobytes())[0]

    def u32(self, field: str) -> int:
        return self._unpack("<I", field)

    def i32(self, field: str) -> int:
        return self._unpack("<i", field)

    def u64(self, field: str) -> int:
        return self._unpack("<Q", field)

    def end(self) -> None:
        if self.pos != len(self.buf):
            raise StateError(f"{self.what}: {len(self.buf) - self.pos} bytes after the end of "
                             f"the KV section (offset {self.pos})")


def _seq_reader(data: bytes | bytearray | memoryview | np.ndarray) -> tuple[_Reader, int]:
    """A reader past a sequence state's header (magic and sequence id, checked), and the id."""
    r = _Reader(data, "sequence state")
    magic = r.u32("magic")
    if magic != SEQ_MAGIC:
        raise StateError(f"sequence state: magic is {magic:#010x}, expected {SEQ_MAGIC:#010x}")
    seq_id = r.i32("seq_id")
    if seq_id < 0:
        raise StateError(f"sequence state: seq_id is {seq_id}, expected >= 0")
    return r, seq_id


def _check_count(n: object) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_CELLS:
        raise ValueError(f"n must be an int in [0, {MAX_CELLS}], got {n!r}")


def _as_strided(base: np.ndarray, shape: tuple[int, ...], strides: tuple[int, ...],
                raw: np.dtype) -> np.ndarray:
    """A raw-integer view of ``shape`` with byte ``strides`` starting at ``base[0]``."""
    arr = np.ndarray(shape, dtype=raw, buffer=base.data, offset=0, strides=strides)
    if not base.flags.writeable:
        arr.flags.writeable = False
    return arr


_INT = {2: torch.int16, 4: torch.int32}


def _torch_int(raw: np.dtype) -> torch.dtype:
    return _INT[np.dtype(raw).itemsize]


def _torch_dtype(dtype: str) -> torch.dtype:
    return {"float16": torch.float16, "bfloat16": torch.bfloat16,
            "float32": torch.float32}[dtype]


def _tensor(raw: np.ndarray | None, dtype: str) -> torch.Tensor:
    if raw is None:
        raise ValueError("a state of 0 cells has no KV")
    return torch.from_numpy(raw).view(_torch_dtype(dtype))
