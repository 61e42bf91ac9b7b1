"""The old import path of :mod:`tests.support.llama_helpers`, kept only because
bench/llama_cpp_cache.py still imports ``text_tokens`` from here (tests never do). Delete once it
imports ``tests.support.llama_helpers``."""

from tests.support.llama_helpers import text_tokens

__all__ = ["text_tokens"]
