"""Read a GGUF file: metadata as plain Python values, tensors dequantized to float32.

Tensors come back in the HF/PyTorch layout ``[out_features, in_features]`` (GGUF lists the shape
innermost-first; the reader's arrays are already row-major ``[rows, cols]``). llama.cpp's converter
permutes the rows of ``attn_q`` / ``attn_k`` so its own RoPE kernel (interleaved pairs) applies; we
undo that so the weights use the half-split ("rotate_half") convention of HF Llama.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["GGUFModelFile", "read_gguf", "unpermute_qk"]


@dataclass(frozen=True)
class GGUFModelFile:
    """The contents of a GGUF file: ``metadata`` (key -> value) and ``tensors`` (name -> array)."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, np.ndarray]  # float32, HF row layout, q/k rows un-permuted


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.py: LlamaModel.permute``).

    llama.cpp stores, for each head, the rows of the two rotary halves interleaved
    (row 2i is half-0 dim i, row 2i+1 is half-1 dim i); HF keeps the halves contiguous.
    """
    rows = w.shape[0]
    if rows % (2 * n_head) != 0:
        raise ValueError(f"unpermute_qk: {rows} rows do not split into {n_head} heads of pairs")
    half = rows // n_head // 2
    # [n_head, half, 2, ...] (llama.cpp) -> [n_head, 2, half, ...] (HF)
    return np.ascontiguousarray(
        w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _field_value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def read_gguf(path: str | os.PathLike[str], *, load_tensors: bool = True) -> GGUFModelFile:
    """Read metadata and (unless ``load_tensors`` is false) all tensors of a GGUF file.

    Every tensor is dequantized to float32 with ``gguf.quants.dequantize``. For the ``llama``
    architecture the q/k projections are un-permuted (see :func:`unpermute_qk`).
    """
    import gguf  # heavy-ish import; kept local so `import engine` stays light

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = gguf.GGUFReader(path)
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # header bookkeeping (version, counts), not model metadata
        metadata[key] = _field_value(field)

    tensors: dict[str, np.ndarray] = {}
    if load_tensors:
        arch = metadata.get("general.architecture")
        n_head = metadata.get(f"{arch}.attention.head_count")
        n_kv = metadata.get(f"{arch}.attention.head_count_kv", n_head)
        for t in reader.tensors:
            a = gguf.quants.dequantize(t.data, t.tensor_type)
            a = np.asarray(a, dtype=np.float32)
            if not a.flags.writeable or not a.flags.c_contiguous:
                a = np.array(a, dtype=np.float32, order="C")  # own the data: no file-backed view
            # GGUF shape is innermost-first; the row-major array shape is its reverse.
            expect = tuple(int(s) for s in reversed(t.shape.tolist()))
            if a.shape != expect:
                a = a.reshape(expect)
            if arch == "llama" and n_head:
                if t.name.endswith("attn_q.weight"):
                    a = unpermute_qk(a, int(n_head))
                elif t.name.endswith("attn_k.weight"):
                    a = unpermute_qk(a, int(n_kv))
            tensors[t.name] = a
    return GGUFModelFile(path=path, metadata=metadata, tensors=tensors)
