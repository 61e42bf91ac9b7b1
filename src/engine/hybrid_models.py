"""Hybrid models built here, with seeded random weights: what the tests and benchmarks run
sliding-window and recurrent layers on (no hybrid weights are available offline, and
exactness needs none).

Each model is a Hugging Face directory made from a ``transformers`` config (``torch`` seed 0,
SmolLM2's tokenizer and chat template), and, for llama.cpp, a GGUF converted from it by the
``convert_hf_to_gguf.py`` that the llama-cpp-python 0.3.36 sdist vendors (with its ``gguf-py``:
the ``gguf`` package on the index is older than the architectures). Two sizes:

* ``tiny``: hidden 128, 4-6 layers, for tests (seconds to build, milliseconds a token);
* ``small``: SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 kv-heads), so a prefill
  costs what a real small model's does, for benchmarks.

Random weights at transformers' default scale (``initializer_range`` 0.02) give near-uniform
next-token distributions whose winner the current token decides almost alone: a comparison of
greedy tokens would then test neither the KV of earlier tokens nor anything but the order of
float additions. The weights are drawn five times wider (``INIT_RANGE``): next-token
distributions are peakier (top logprob about -6.7 against -9 for a 49,152-token vocabulary,
margins between the two best logits about 0.15 against 0.04) and depend on the whole context
(changing the first half of a 200-token prompt changes 20-100% of the next 20 greedy tokens,
measured with transformers on every model here).

Everything goes under the model cache (``$KVSTORE_CACHE_DIR``, :func:`engine.hf_export.
cache_dir`), written to a temporary directory and renamed into place, so a reader never sees
half of one. ``python -m engine.hybrid_models [NAME ...] [--size small] [--gguf]`` builds them
(``make test`` builds what the tests need).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from engine.hf_export import DONE, cache_dir, hf_model_dir

SEED = 0
INIT_RANGE = 0.1  # the weights' standard deviation (transformers' default: 0.02)
LLAMA_CPP_VERSION = "0.3.36"  # the sdist whose converter makes the GGUFs
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")

_TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=8192)
_SMALL = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
              num_key_value_heads=3, max_position_embeddings=8192)


@dataclass(frozen=True, kw_only=True)
class Spec:
    """One hybrid architecture: its ``transformers`` config class and architecture name, its
    layer pattern (repeated to the size's layer count), and the config keys of each size."""

    config: str
    arch: str
    pattern: tuple[str, ...]  # layer types, repeated
    pattern_key: str | None = "layer_types"  # None: every layer is alike (no list to give)
    drop: tuple[str, ...] = ()  # size keys the config does not take
    common: dict = field(default_factory=dict)
    tiny: dict = field(default_factory=dict)
    small: dict = field(default_factory=dict)
    tiny_layers: int = 4
    small_layers: int = 30
    converter_args: tuple[str, ...] = ()
    # config.json values the GGUF converter names otherwise than transformers and vLLM do:
    # {key: {value as saved: value the converter wants}}, applied to a copy it converts
    converter_names: dict = field(default_factory=dict)

    def config_kwargs(self, size: str) -> dict:
        n = self.tiny_layers if size == "tiny" else self.small_layers
        base = {k: v for k, v in (_TINY if size == "tiny" else _SMALL).items()
                if k not in self.drop}
        base.update(self.common)
        base.update(self.tiny if size == "tiny" else self.small)
        base["num_hidden_layers"] = n
        if self.pattern_key is not None:
            base[self.pattern_key] = [self.pattern[i % len(self.pattern)] for i in range(n)]
        return base


SPECS: dict[str, Spec] = {
    # sliding-window attention beside full attention, 5:1 (llama.cpp gives every Gemma 3 GGUF
    # this pattern, whatever the config says)
    "gemma3": Spec(
        config="Gemma3TextConfig", arch="Gemma3ForCausalLM",
        pattern=("sliding_attention",) * 5 + ("full_attention",), tiny_layers=6,
        common=dict(head_dim=64, query_pre_attn_scalar=64, rope_local_base_freq=10000.0),
        tiny=dict(sliding_window=32), small=dict(sliding_window=512)),
    # gated delta nets (linear attention) beside full attention, 3:1; linear head dim 128
    # (vLLM's CPU kernel needs it, and bf16)
    "qwen3_next": Spec(
        config="Qwen3NextConfig", arch="Qwen3NextForCausalLM",
        pattern=("linear_attention",) * 3 + ("full_attention",),
        common=dict(head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                    linear_value_head_dim=128, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=64, shared_expert_intermediate_size=64),
        tiny=dict(linear_num_key_heads=1, linear_num_value_heads=2),
        small=dict(linear_num_key_heads=2, linear_num_value_heads=4),
        converter_args=("--no-mtp",)),
    # Mamba2 beside attention (the converter wants the types named mamba / attention)
    "granitemoehybrid": Spec(
        config="GraniteMoeHybridConfig", arch="GraniteMoeHybridForCausalLM",
        pattern=("linear_attention", "full_attention"),
        converter_names={"layer_types": {"linear_attention": "mamba",
                                         "full_attention": "attention"}},
        common=dict(num_local_experts=0, num_experts_per_tok=0, mamba_d_head=32,
                    mamba_d_state=16, mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=64,
                    position_embedding_type="rope", tie_word_embeddings=True),
        tiny=dict(shared_intermediate_size=256, mamba_n_heads=8),
        small=dict(shared_intermediate_size=1536, mamba_n_heads=36)),
    # short convolutions beside full attention
    "lfm2": Spec(
        config="Lfm2Config", arch="Lfm2ForCausalLM", pattern=("conv", "full_attention"),
        common=dict(block_auto_adjust_ff_dim=False, tie_word_embeddings=False),
        tiny=dict(conv_dim=128, block_dim=128), small=dict(conv_dim=576, block_dim=576)),
    # Mamba2 and attention in every layer, side by side
    "falcon_h1": Spec(
        config="FalconH1Config", arch="FalconH1ForCausalLM", pattern=("hybrid",),
        pattern_key=None,
        common=dict(head_dim=64, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16,
                    mamba_chunk_size=64),
        tiny=dict(mamba_d_ssm=256, mamba_n_heads=8),
        small=dict(mamba_d_ssm=1152, mamba_n_heads=36)),
    # recurrent only: no full-attention layer (the store serves none: a refusal to test)
    "mamba2": Spec(
        config="Mamba2Config", arch="Mamba2ForCausalLM", pattern=("mamba",),
        pattern_key=None, drop=("num_attention_heads", "num_key_value_heads",
                                "intermediate_size", "max_position_embeddings"),
        common=dict(head_dim=32, state_size=16, n_groups=1, expand=2, chunk_size=64,
                    use_mamba_kernels=False),
        tiny=dict(num_heads=8), small=dict(num_heads=36)),
}
SIZES = ("tiny", "small")


def _check(name: str, size: str) -> Spec:
    if name not in SPECS:
        raise ValueError(f"name must be one of {sorted(SPECS)}, got {name!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {list(SIZES)}, got {size!r}")
    return SPECS[name]


def _tag(name: str, size: str) -> str:
    """``name-size-digest``: the digest covers everything the build takes, so a changed spec
    builds a new model beside the old one instead of reusing it."""
    import hashlib

    spec = SPECS[name]
    key = repr((spec, spec.config_kwargs(size), SEED, INIT_RANGE, LLAMA_CPP_VERSION)).encode()
    return f"{name}-{size}-{hashlib.sha256(key).hexdigest()[:8]}"


def model_dir(name: str, size: str = "tiny", root: str | None = None) -> str:
    """The HF directory of hybrid ``name`` at ``size`` (built on first use)."""
    _check(name, size)
    out = os.path.join(root or cache_dir(), "hybrid", _tag(name, size))
    if not os.path.exists(os.path.join(out, DONE)):
        _build(name, size, out, root)
    return out


def gguf_path(name: str, size: str = "tiny", root: str | None = None) -> str:
    """The f32 GGUF of hybrid ``name`` at ``size`` (converted on first use)."""
    spec = _check(name, size)
    out = os.path.join(root or cache_dir(), "hybrid", _tag(name, size) + ".gguf")
    if os.path.exists(out):
        return out
    src = model_dir(name, size, root)
    script, gguf_py = converter(root)
    fd, tmp = tempfile.mkstemp(suffix=".gguf", dir=os.path.dirname(out))
    os.close(fd)
    env = {**os.environ, "PYTHONPATH": gguf_py, "OMP_NUM_THREADS": "1"}
    renamed = tempfile.mkdtemp(dir=os.path.dirname(out)) if spec.converter_names else None
    try:
        if renamed is not None:
            src = _renamed_copy(src, renamed, spec.converter_names)
        proc = subprocess.run([sys.executable, script, src, "--outfile", tmp, "--outtype", "f32",
                               *spec.converter_args], env=env, capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"converting {name}-{size} to GGUF failed:\n"
                               f"{proc.stderr[-3000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if renamed is not None:
            shutil.rmtree(renamed, ignore_errors=True)
    return out


def _renamed_copy(src: str, dst: str, names: dict) -> str:
    """``src`` linked file by file into ``dst`` with config.json's values renamed."""
    import json

    for f in os.listdir(src):
        if f != "config.json":
            os.symlink(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    for key, mapping in names.items():
        v = cfg[key]
        cfg[key] = [mapping.get(x, x) for x in v] if isinstance(v, list) else mapping.get(v, v)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def converter(root: str | None = None) -> tuple[str, str]:
    """(``convert_hf_to_gguf.py``, its ``gguf-py`` directory) from the llama-cpp-python sdist
    (extracted once into the cache; ``make llama-convert`` or on first use)."""
    base = os.path.join(root or cache_dir(), f"llama-convert-{LLAMA_CPP_VERSION}")
    script = os.path.join(base, "convert_hf_to_gguf.py")
    if not os.path.exists(os.path.join(base, DONE)):
        _extract_converter(base)
    return script, os.path.join(base, "gguf-py")


def _extract_converter(base: str) -> None:
    import tarfile

    parent = os.path.dirname(base)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent)
    try:
        sdist = os.environ.get("KVSTORE_LLAMA_SDIST")
        if not sdist:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--no-binary", ":all:", "-d", tmp,
                            f"llama-cpp-python=={LLAMA_CPP_VERSION}"], check=True, timeout=900)
            sdist = os.path.join(tmp, f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz")
        prefix = f"llama_cpp_python-{LLAMA_CPP_VERSION}/vendor/llama.cpp/"
        wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        out = os.path.join(tmp, "convert")
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(prefix) and m.name[len(prefix):].startswith(wanted)
                       and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(out, members=members, filter="data")
        open(os.path.join(out, DONE), "w").close()
        shutil.rmtree(base, ignore_errors=True)
        os.replace(out, base)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build(name: str, size: str, out: str, root: str | None) -> None:
    import torch
    import transformers

    spec = SPECS[name]
    kw = spec.config_kwargs(size)
    cfg = getattr(transformers, spec.config)(vocab_size=49152, bos_token_id=1, eos_token_id=2,
                                             pad_token_id=2, initializer_range=INIT_RANGE, **kw)
    cfg.architectures = [spec.arch]
    cfg.dtype = "float32"
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tok_dir = hf_model_dir(root)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        for f in TOKENIZER_FILES:
            if os.path.exists(os.path.join(tok_dir, f)):
                shutil.copy(os.path.join(tok_dir, f), tmp)
        open(os.path.join(tmp, DONE), "w").close()
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("names", nargs="*", help=f"models (default: all): {sorted(SPECS)}")
    p.add_argument("--size", choices=SIZES, default="tiny")
    p.add_argument("--gguf", action="store_true", help="also convert to GGUF for llama.cpp")
    args = p.parse_args(argv)
    for name in args.names or sorted(SPECS):
        print(model_dir(name, args.size))
        if args.gguf:
            print(gguf_path(name, args.size))


if __name__ == "__main__":
    main()
