"""Shared by the llama.cpp integration tests and their worker processes: the real SmolLM2
GGUF, Llamas built one way, prompts as token ids, and a GGUF that differs in one weight."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

N_CTX = 2048
THREADS = 1  # llama-cpp-python's default here; robust when other work shares the cores


def gguf_path() -> str:
    from engine.model import default_gguf_path

    return default_gguf_path()


def make_llama(path: str | None = None, **kw):
    """A ``llama_cpp.Llama`` of the test GGUF: fixed seed, quiet, one thread, greedy by the
    callers (temperature 0)."""
    import llama_cpp

    kw.setdefault("n_ctx", N_CTX)
    kw.setdefault("seed", 0)
    kw.setdefault("verbose", False)
    kw.setdefault("n_threads", THREADS)
    kw.setdefault("n_threads_batch", THREADS)
    return llama_cpp.Llama(path or gguf_path(), **kw)


def text_tokens(llm, n: int, *, seed: int = 0, add_bos: bool = False) -> list[int]:
    """``n`` token ids of real English (numbered sentences, shuffled by ``seed``)."""
    rng = np.random.default_rng(seed)
    words = ["river", "garden", "lantern", "market", "winter", "harbor", "orchard", "bridge",
             "meadow", "village", "forest", "signal", "window", "engine", "letter", "mountain"]
    out: list[int] = []
    i = 0
    while len(out) < n:
        a, b = rng.choice(words, 2, replace=False)
        out += llm.tokenize(f" Note {i}: the {a} is near the {b}.".encode(),
                            add_bos=add_bos and not out)
        i += 1
    return out[:n]


def complete(llm, prompt: list[int], max_tokens: int = 16) -> tuple[str, list[int]]:
    """Greedy completion of token ids: (text, completion token ids)."""
    r = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, seed=0)
    text = r["choices"][0]["text"]
    return text, llm.tokenize(text.encode(), add_bos=False, special=True)


def perturbed_gguf(src: str, dst: Path, *, tensor: str = "blk.0.attn_norm.weight",
                   factor: float = 1.25) -> Path:
    """A copy of the GGUF ``src`` whose f32 tensor ``tensor`` is scaled by ``factor``: a real,
    loadable model whose KV differs from the original's from layer 0 on."""
    import gguf

    shutil.copyfile(src, dst)
    reader = gguf.GGUFReader(src)
    (t,) = [t for t in reader.tensors if t.name == tensor]
    assert t.tensor_type.name == "F32"
    scaled = (np.asarray(t.data, dtype=np.float32) * np.float32(factor)).astype("<f4")
    with open(dst, "r+b") as f:
        f.seek(t.data_offset)
        f.write(scaled.tobytes())
        f.flush()
        os.fsync(f.fileno())
    return dst
