"""The private surface of llama-cpp-python that the cache still needs, in one place.

Everything else the integration uses is public: the ``Llama`` attributes and methods
(``ctx``, ``model``, ``metadata``, ``context_params``, ``input_ids``, ``n_tokens``,
``reset()``, ``save_state()``, ``set_cache()``, ...), llama.cpp's C API as llama-cpp-python
binds it (``llama_state_seq_*``, ``llama_memory_seq_rm``, ...) and, for ``kvstore serve``, the
server app's ``create_app`` and ``get_llama_proxy``. What remains, each with why nothing public
replaces it:

* **the calling Llama, from the caller's stack frames** (:func:`calling_llama`: ``sys._getframe``
  and ``frame.f_locals["self"]``). llama-cpp-python calls a cache as ``self.cache[prompt]`` and
  ``self.cache[tokens] = self.save_state()`` from inside ``Llama._create_completion`` and hands
  it no reference to the model, yet the cache must know which model asks (its GGUF, build and
  context settings decide what KV it may serve) and needs its context to restore into. One
  cache may serve several Llamas, so binding the cache to one Llama at construction would not
  do. The premise checked: ``Llama._create_completion`` exists and reads ``self.cache``.
* **``logits_all``** (:func:`logits_all`): llama-cpp-python keeps the effective value (a draft
  model forces it on) in the private ``Llama._logits_all`` only; llama.cpp's context
  parameters no longer carry it. It is read through ``Llama.__getstate__()`` (the Llama's
  pickling state: its constructor's arguments), public, not the private field; checked: the
  constructor takes ``logits_all`` and ``Llama`` defines ``__getstate__``.

:func:`check` (run when a cache is created with llama_cpp imported, when a Llama first calls
it, and when ``kvstore serve`` starts) verifies, by feature presence, that the installed
llama-cpp-python still has this surface and the C functions the integration calls: a missing
piece is a :class:`~kvstore.integrations.surface.UnsupportedEngine` naming the installed
version, :data:`TESTED_VERSIONS` and what is missing; an untested version that has it all runs,
with one warning.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
from types import FrameType
from typing import Any

from kvstore.integrations.surface import UnsupportedEngine, verify

log = logging.getLogger("kvstore.integrations.llama_cpp")

TESTED_VERSIONS = ("0.3.36",)  # llama-cpp-python releases the integration was tested with

CALLER_FRAMES = 4  # how far up the cache looks: a subclass or wrapper of the cache adds frames

# llama.cpp's C API as llama-cpp-python binds it: renamed across llama.cpp releases (the KV
# cache became "memory"), so checked too.
C_FUNCTIONS = ("llama_state_seq_set_data", "llama_state_seq_get_data_ext",
               "llama_state_seq_get_size_ext", "llama_get_memory", "llama_memory_seq_rm",
               "llama_model_n_layer", "llama_model_n_head", "llama_model_n_head_kv",
               "llama_model_n_embd", "llama_model_n_swa", "llama_model_is_recurrent",
               "llama_model_is_hybrid", "llama_model_rope_type", "llama_n_seq_max",
               "llama_print_system_info", "llama_init_from_model", "llama_batch_get_one",
               "llama_decode", "llama_free")
LLAMA_METHODS = ("reset", "save_state", "set_cache", "ctx", "model")

_lock = threading.Lock()
_checked = False


def installed_version() -> str:
    import llama_cpp

    return str(getattr(llama_cpp, "__version__", "unknown"))


def missing_surface() -> list[str]:
    """What of the surface the integration uses the installed llama-cpp-python lacks."""
    import llama_cpp

    missing = []
    if not hasattr(sys, "_getframe"):
        missing.append("sys._getframe (a Python without frame access: the cache cannot find "
                       "the Llama that calls it)")
    llama = getattr(llama_cpp, "Llama", None)
    if llama is None:
        return [*missing, "llama_cpp.Llama"]
    create = getattr(llama, "_create_completion", None)
    code = getattr(create, "__code__", None)
    if code is None or "cache" not in code.co_names:
        missing.append("Llama._create_completion calling self.cache (the cache finds its "
                       "Llama as the self of that call)")
    try:
        params = inspect.signature(llama.__init__).parameters
    except (TypeError, ValueError):
        params = {}
    if "logits_all" not in params or "__getstate__" not in vars(llama):
        missing.append("Llama(logits_all=...) reported by Llama.__getstate__()")
    missing += [f"Llama.{name}" for name in LLAMA_METHODS if not hasattr(llama, name)]
    missing += [f"llama_cpp.{name} (llama.cpp's C API)" for name in C_FUNCTIONS
                if not hasattr(llama_cpp, name)]
    return missing


def check(*, again: bool = False) -> None:
    """Verify the installed llama-cpp-python once per process (``again``: verify anew):
    :class:`UnsupportedEngine` if something the integration needs is missing."""
    global _checked
    with _lock:
        if _checked and not again:
            return
        verify("llama-cpp-python", installed_version(), TESTED_VERSIONS, missing_surface(),
               log)
        _checked = True


def calling_llama(depth: int = 1) -> Any | None:
    """The ``llama_cpp.Llama`` whose method is running ``depth`` frames above the caller of
    this function (1: the caller's caller), or in one of the ``CALLER_FRAMES - 1`` frames
    that called it; None if none is (a call from anywhere else: the cache then misses).
    Thread-safe (reads the calling thread's own frames)."""
    return llama_in(sys._getframe(depth + 1))


def llama_in(frame: FrameType | None) -> Any | None:
    """The ``llama_cpp.Llama`` that is the ``self`` of ``frame`` or of one of the
    ``CALLER_FRAMES - 1`` frames that called it, or None."""
    llama_cpp = sys.modules.get("llama_cpp")
    if llama_cpp is None:  # nothing imported llama_cpp, so no Llama exists
        return None
    for _ in range(CALLER_FRAMES):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, llama_cpp.Llama):
            return candidate
        frame = frame.f_back
    return None


def logits_all(llm: Any) -> bool:
    """Whether ``llm`` keeps logits for every token (``Llama(logits_all=True)``, or forced
    by a draft model)."""
    return bool(llm.__getstate__()["logits_all"])


__all__ = ["CALLER_FRAMES", "TESTED_VERSIONS", "UnsupportedEngine", "calling_llama", "check",
           "installed_version", "llama_in", "logits_all", "missing_surface"]
