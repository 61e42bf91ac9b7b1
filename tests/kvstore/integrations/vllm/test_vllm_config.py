"""The connector's settings and identity: every extra-config key checked by name, and the
layout derived from vLLM's own configuration (what makes the bytes is in the fingerprint)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file
from vllm.engine.arg_utils import EngineArgs

from engine.hf_export import hf_model_dir
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.identity import model_digest, vllm_layout


def test_extra_config_is_checked_by_name(tmp_path):
    cfg = ConnectorConfig.from_extra_config({"store_dir": str(tmp_path), "dram_bytes": 1 << 20,
                                             "codecs": {"remote": "zstd"}, "namespace": "t",
                                             "remote": "redis://127.0.0.1:1/0"})
    assert cfg.dram_bytes == 1 << 20 and cfg.codecs["remote"] == "zstd"
    opts = cfg.open_options(block_size=128)
    assert opts["chunk_tokens"] == 128  # a new store gets vLLM's block size
    slow = ConnectorConfig.from_extra_config({"store_dir": str(tmp_path), "remote_deadline_s": 9,
                                              "remote": "redis://127.0.0.1:1/0"})
    remote = slow.open_options(block_size=128)["remote"]
    assert remote.deadline_s == 9.0 and remote.urls == ("redis://127.0.0.1:1/0",)
    fleet = ConnectorConfig.from_extra_config(
        {"store_dir": str(tmp_path), "objects": "s3://kv-bucket/fleet?endpoint=http://h:1"})
    assert fleet.open_options(block_size=128)["objects"] == \
        "s3://kv-bucket/fleet?endpoint=http://h:1"
    for extra, word in [({"store_dir": "x", "objects": "http://nope"}, r"\['objects'\]"),
                        ({"store_dir": "x", "objects": 7}, r"\['objects'\]"),
                        ({"store_dir": "x", "objects": "s3://kv-bucket?colour=red"}, "colour"),
                        ({}, "store_dir"), ({"store_dir": ""}, "store_dir"),
                        ({"store_dir": "x", "dram_byte": 1}, "dram_byte"),
                        ({"store_dir": "x", "disk_bytes": -1}, "disk_bytes"),
                        ({"store_dir": "x", "codecs": {"ssd": "none"}}, "ssd"),
                        ({"store_dir": "x", "remote": "http://nope"}, "redis"),
                        ({"store_dir": "x", "buffer_layers": -2}, "buffer_layers"),
                        ({"store_dir": "x", "save": "yes"}, "save"),
                        ({"store_dir": "x", "namespace": 3}, "namespace"),
                        ({"store_dir": "x", "remote_deadline_s": 1}, "remote_deadline_s"),
                        ({"store_dir": "x", "remote": "redis://h:1", "remote_deadline_s": 0},
                         "remote_deadline_s")]:
        with pytest.raises((ValueError, TypeError), match=word):
            ConnectorConfig.from_extra_config(extra)
    with pytest.raises(TypeError, match="mapping"):
        ConnectorConfig.from_extra_config(None)
    home = ConnectorConfig.from_extra_config({"store_dir": "~/kv"})  # no literal "~" dir
    assert home.store_dir == os.path.join(os.path.expanduser("~"), "kv")


def _config(**kw):
    return EngineArgs(model=hf_model_dir(), dtype=kw.pop("dtype", "float32"), max_model_len=512,
                      enforce_eager=True, kv_cache_memory_bytes=64 << 20,
                      **kw).create_engine_config()


def test_layout_of_a_vllm_config():
    layout, isa = vllm_layout(_config())
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (30, 3, 64)
    assert layout.dtype == "float32" and layout.keys == "rotated"
    assert layout.engine == "vllm 0.32.0 cpu isa=vec pages=128 dtype=float32" and isa == "vec"
    assert layout.model_id.startswith("xxh3:") and layout.rope_theta == 100000.0
    bf16, isa16 = vllm_layout(_config(dtype="bfloat16"))
    assert bf16.fingerprint != layout.fingerprint
    assert isa16 == ("amx" if torch.cpu._is_amx_tile_supported() else "vec")
    assert vllm_layout(_config(), model_id="mine")[0].model_id == "mine"


def test_every_setting_that_changes_the_bytes_is_in_the_fingerprint():
    """bf16 against bf16 with fp8 weights, with vLLM's transformers model implementation, with
    a RoPE override (hf_overrides): four fingerprints (before, one: a store filled by one
    would have been served to the others). Only the configurations are built: fp8 does not
    run on this CPU build."""
    base = vllm_layout(_config(dtype="bfloat16"))[0]
    others = [vllm_layout(_config(dtype="bfloat16", **kw))[0] for kw in (
        {"quantization": "fp8"}, {"model_impl": "transformers"},
        {"hf_overrides": {"rope_theta": 50000.0}})]
    prints = {layout.fingerprint for layout in [base, *others]}
    assert len(prints) == 4
    assert "quantization=fp8" in others[0].engine and "model_impl=transformers" in \
        others[1].engine and "rope_theta" in others[2].engine
    assert base.engine == "vllm 0.32.0 cpu isa=" + base.engine.split("isa=")[1]  # unchanged


def test_quantized_kv_cache_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        vllm_layout(_config(dtype="bfloat16", kv_cache_dtype="fp8"))


def test_model_digest_follows_the_weight_bytes(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    save_file({"w": torch.zeros(4)}, tmp_path / "model.safetensors")
    (tmp_path / "README.md").write_text("not part of the model")
    first = model_digest(str(tmp_path))
    (tmp_path / "README.md").write_text("changed")
    assert model_digest(str(tmp_path)) == first
    save_file({"w": torch.ones(4)}, tmp_path / "model.safetensors")
    assert model_digest(str(tmp_path)) != first
    assert model_digest("org/model", "v1") == "org/model@v1"  # a hub id: name and revision
