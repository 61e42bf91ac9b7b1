"""Shared fixtures for engine tests: the model (loaded once per session) and HF references."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def model():
    import engine

    return engine.load_model()


@pytest.fixture(scope="session")
def gguf_file() -> tuple[str, str]:
    from engine.model import default_gguf_path

    p = default_gguf_path()
    return os.path.dirname(p), os.path.basename(p)


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_file):
    import transformers

    d, name = gguf_file
    return transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)


@pytest.fixture(scope="session")
def hf_model(gguf_file):
    import torch
    import transformers

    d, name = gguf_file
    m = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    return m.eval()
