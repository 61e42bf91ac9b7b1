"""engine: the attention runtime on top of kvstore (model, tokenizer, generation).

Submodules are imported lazily so ``import engine`` stays cheap; ``engine.load_model`` and
``engine.Model`` pull in torch and the model code on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.generate import Conversation, Generator, SamplingConfig
    from engine.hf_cache import create_session
    from engine.model import Model, ModelConfig, load_model
    from engine.session import Session, open_session
    from engine.tokenizer import Tokenizer

__all__ = ["Conversation", "Generator", "Model", "ModelConfig", "SamplingConfig", "Session",
           "Tokenizer", "create_session", "load_model", "open_session"]

_LAZY = {
    "Model": "engine.model",
    "ModelConfig": "engine.model",
    "load_model": "engine.model",
    "Tokenizer": "engine.tokenizer",
    "Generator": "engine.generate",
    "Conversation": "engine.generate",
    "SamplingConfig": "engine.generate",
    "create_session": "engine.hf_cache",
    "Session": "engine.session",
    "open_session": "engine.session",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
