"""What vLLM's KV bytes are: the store's layout for one vLLM configuration.

The keys are stored as vLLM holds them (rotated, ``KVLayout(keys="rotated")``) in vLLM's KV
cache dtype, and each block's bytes as vLLM's CPU attention packs them (its pages, moved as
they are: :mod:`kvstore.pipelines.pages`), so reuse is bit-exact and needs no conversion. What
else makes the bytes is named in the layout's ``engine`` (vLLM's version, platform, attention
ISA, which decides the packing, the block size the packing is laid out in, and the compute
dtype) and ``model_id`` (a digest of the model's config and weight files): KV is only served
to a vLLM that would have computed and packed those same bytes. Both connector roles
(scheduler and worker processes) derive the same layout from the same configuration.
"""

from __future__ import annotations

import functools
import os

import torch
import xxhash

from kvstore.integrations.vllm import compat
from kvstore.integrations.vllm.groups import Groups
from kvstore.integrations.vllm.packing import check_packing
from kvstore.layout import KVLayout

# Files whose bytes decide the KV a model computes from token ids.
_MODEL_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CONFIG_FILES = ("config.json",)

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@functools.lru_cache(maxsize=8)
def _dir_digest(path: str, stamp: tuple[tuple[str, int, int], ...]) -> str:
    """xxh3-128 of a model directory's config and weight files (names, sizes and bytes).
    ``stamp`` (names, sizes, mtimes) keys the cache: a changed file is hashed again."""
    h = xxhash.xxh3_128()
    for name, size, _ in stamp:
        h.update(f"{name}\0{size}\0".encode())
        with open(os.path.join(path, name), "rb") as f:
            while block := f.read(16 << 20):
                h.update(block)
    return h.hexdigest()


def model_digest(model: str, revision: str | None = None) -> str:
    """The identity of ``model`` (vLLM's ``model_config.model``): for a local directory, a
    digest of its config and weight files; otherwise (a hub id) its name and revision."""
    if not os.path.isdir(model):
        return f"{model}@{revision or 'default'}"
    names = sorted(n for n in os.listdir(model)
                   if n.endswith(_MODEL_FILES) or n in _CONFIG_FILES)
    stamp = []
    for n in names:
        st = os.stat(os.path.join(model, n))
        stamp.append((n, st.st_size, st.st_mtime_ns))
    return "xxh3:" + _dir_digest(os.path.realpath(model), tuple(stamp))


def attention_isa(vllm_config) -> str:
    """The CPU attention ISA vLLM picks for this configuration (its block packing; vLLM
    exposes it publicly only on a built model's layers: :mod:`.compat`)."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    return compat.attention_isa(mc.dtype, cc.block_size, mc.get_head_size(), cc.cache_dtype)


def _settings(mc) -> str:
    """What else of vLLM's model configuration changes the KV a model computes from token
    ids, as the layout's ``engine`` names it (each only where it is not vLLM's default, so a
    default configuration keeps its fingerprint): the weights' quantization, the model
    implementation and class overrides, and ``hf_overrides`` (RoPE and other config
    overrides)."""
    out = ""
    if getattr(mc, "quantization", None):
        out += f" quantization={mc.quantization}"
    if str(getattr(mc, "model_impl", "auto")) not in ("auto", "ModelImpl.AUTO"):
        out += f" model_impl={mc.model_impl}"
    if getattr(mc, "model_class_overrides", None):
        out += f" model_class_overrides={mc.model_class_overrides!r}"
    if mc.hf_overrides:
        out += f" hf_overrides={mc.hf_overrides!r}"
    return out


def vllm_layout(vllm_config, *, model_id: str | None = None,
                groups: Groups | None = None) -> tuple[KVLayout, str]:
    """The store layout of ``vllm_config``'s KV cache and its packing. ValueError, naming the
    setting, for a configuration the connector does not serve (it would store wrong bytes).
    ``groups``: a hybrid model's KV-cache groups (:mod:`.groups`): the layout then holds the
    full-attention layers, every layer's kind and the bound of a boundary state."""
    import vllm
    from vllm.platforms import current_platform

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    if not current_platform.is_cpu():
        raise ValueError(f"the KVStoreConnector packs vLLM's CPU attention blocks; this vLLM "
                         f"runs on {current_platform.device_type!r}")
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise ValueError("the KVStoreConnector serves tensor_parallel_size=1 and "
                         "pipeline_parallel_size=1 only (each rank would hold a slice)")
    if cc.cache_dtype != "auto":
        raise ValueError(f"the KVStoreConnector stores unquantized KV; kv_cache_dtype is "
                         f"{cc.cache_dtype!r}")
    if mc.use_mla:
        raise ValueError("the KVStoreConnector stores per-head K and V; MLA models are not "
                         "served")
    dtype = _DTYPE_NAMES.get(mc.dtype)
    if dtype is None:
        raise ValueError(f"the KVStoreConnector stores float16, bfloat16 or float32 KV; the "
                         f"model dtype is {mc.dtype}")
    isa = check_packing(attention_isa(vllm_config), block_size=cc.block_size,
                        head_dim=mc.get_head_size(), dtype=mc.dtype)
    rope = getattr(mc.hf_config, "rope_theta", None) or \
        (getattr(mc.hf_config, "rope_parameters", None) or {}).get("rope_theta") or 10000.0
    engine = (f"vllm {vllm.__version__} cpu isa={isa} pages={cc.block_size} "
              f"dtype={dtype}") + _settings(mc)
    num_layers, kinds, state_bytes = mc.get_num_layers(pc), None, 0
    if groups is not None and groups.hybrid:
        from vllm.model_executor.models.utils import extract_layer_index

        H, D = mc.get_num_kv_heads(pc), mc.get_head_size()
        want = 2 * groups.block_size * H * D * torch.tensor([], dtype=mc.dtype).element_size()
        if any(g.page_bytes != want for g in groups.full):
            raise ValueError("the KVStoreConnector needs the full-attention layers' pages to "
                             "hold the model's kv-heads and head size")
        engine += f" hma={groups.describe()}"
        num_layers = len(groups.full_layers(extract_layer_index))
        kinds = groups.layer_kinds(extract_layer_index)
        state_bytes = groups.max_state_size
    layout = KVLayout(num_layers=num_layers, num_kv_heads=mc.get_num_kv_heads(pc),
                      head_dim=mc.get_head_size(), dtype=dtype, rope_theta=float(rope),
                      model_id=model_id or model_digest(mc.model, mc.revision),
                      keys="rotated", engine=engine, layers=kinds, state_bytes=state_bytes)
    return layout, isa
