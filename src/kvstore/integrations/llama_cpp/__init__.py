"""llama.cpp (through llama-cpp-python) on top of the store.

``llm.set_cache(KVStoreLlamaCache(DIR))`` gives a ``llama_cpp.Llama`` a persistent prompt
cache shared by every process that names ``DIR``; ``kvstore serve --model GGUF --store DIR``
runs llama-cpp-python's OpenAI-compatible server with it. Parts: :mod:`.state` (llama.cpp's
KV state, field by field), :mod:`.identity` (what computed a context's bytes, hence the store
layout), :mod:`.context` (a live Llama: who asks, what it holds, restoring into it),
:mod:`.cache` (:class:`KVStoreLlamaCache`), :mod:`.server` (``kvstore serve``), :mod:`.admin`
(its retention and admin routes), :mod:`.tenants` (its API keys, and the namespace each
request runs in), :mod:`.compat` (the private surface of llama-cpp-python still used, and the
versions tested).

Importing this package does not import ``llama_cpp``; the cache imports it when a Llama
first calls it.
"""

from kvstore.integrations.llama_cpp.cache import CacheCounters, KVStoreLlamaCache, RestoredPrefix
from kvstore.integrations.llama_cpp.identity import Unsupported
from kvstore.integrations.llama_cpp.state import StateError, StateFormat
from kvstore.integrations.surface import UnsupportedEngine

__all__ = ["CacheCounters", "KVStoreLlamaCache", "RestoredPrefix", "StateError", "StateFormat",
           "Unsupported", "UnsupportedEngine"]
