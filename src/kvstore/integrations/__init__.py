"""kvstore under inference engines: vLLM (:mod:`kvstore.integrations.vllm`) and llama.cpp
(:mod:`kvstore.integrations.llama_cpp`).

Each integration imports its engine only when it is imported itself; nothing else in
``kvstore`` imports an engine. Engines hold keys after rotary encoding, so the integrations
store them as the engine holds them (``KVLayout(keys="rotated", engine=...)``): reuse is
bit-exact at the same positions, and the engine's identity (version, packing, attention mode,
KV type) is part of the fingerprint. :mod:`kvstore.integrations.shared` lets the parts of one
process (vLLM's scheduler and worker in single-process mode) share one open store.

Engines are reached through their public APIs. What private surface of an engine an
integration still needs lives in that integration's ``compat`` module, which names the engine
versions it was tested with and checks at startup that the installed engine still has that
surface (:mod:`kvstore.integrations.surface`: :class:`~.surface.UnsupportedEngine` otherwise).
"""
