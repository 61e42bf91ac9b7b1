"""The connector's compatibility module and the user's settings: the private surface of vLLM
it uses is checked when a connector starts (a piece taken away from the real vLLM module is
refused, naming the installed version, the tested ones and what is missing; an untested
version that has it all runs with one warning), the tested versions are the installed one, and
``kv_load_failure_policy`` is filled only where the user left vLLM's default."""

from __future__ import annotations

import logging

import pytest
import torch
import vllm
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backends import cpu_attn

from engine.hf_export import hf_model_dir
from kvstore.integrations.surface import UnsupportedEngine
from kvstore.integrations.vllm import compat
from kvstore.integrations.vllm.connector import KVStoreConnector, load_failure_policy


@pytest.fixture(autouse=True)
def checked_again():
    """Each test sees the real vLLM checked anew when it ends (a failed check in a test leaves
    no state behind)."""
    yield
    compat.check(again=True)


LOGGER = "vllm.kvstore"  # what the shared ``records`` fixture captures


def test_the_tested_versions_are_the_installed_vllm():
    assert vllm.__version__ in compat.TESTED_VERSIONS
    assert compat.installed_version() == vllm.__version__
    assert compat.missing_surface() == []
    compat.check(again=True)


def test_a_vllm_without_the_attention_isa_function_is_refused_clearly(monkeypatch):
    monkeypatch.delattr(cpu_attn, "_get_attn_isa")
    with pytest.raises(UnsupportedEngine) as e:
        compat.check(again=True)
    msg = str(e.value)
    assert f"vllm {vllm.__version__} is installed" in msg
    assert all(v in msg for v in compat.TESTED_VERSIONS) and "_get_attn_isa" in msg


def test_an_attention_isa_function_of_another_signature_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda dtype, block_size: "vec")
    with pytest.raises(UnsupportedEngine, match=r"_get_attn_isa\(dtype, block_size, "
                                                r"head_size, kv_cache_dtype\)"):
        compat.check(again=True)


def test_a_vllm_whose_connector_base_lacks_a_hook_is_refused(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    monkeypatch.delattr(KVConnectorBase_V1, "bind_kv_cache_manager")
    with pytest.raises(UnsupportedEngine, match="bind_kv_cache_manager"):
        compat.check(again=True)


def test_an_untested_version_with_the_surface_runs_with_one_warning(monkeypatch, records):
    monkeypatch.setattr(vllm, "__version__", "0.99.9")
    compat.check(again=True)
    compat.check(again=True)
    warned = [r for r in records if "0.99.9" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "0.32.0" in warned[0].getMessage()


def _engine_config(tmp_path, **transfer):
    return EngineArgs(model=hf_model_dir(), dtype="float32", max_model_len=512,
                      enforce_eager=True, kv_cache_memory_bytes=64 << 20,
                      kv_transfer_config=KVTransferConfig(
                          kv_connector="KVStoreConnector",
                          kv_connector_module_path="kvstore.integrations.vllm",
                          kv_role="kv_both", **transfer)).create_engine_config()


def test_the_connector_refuses_to_start_on_a_vllm_without_the_surface(tmp_path, monkeypatch):
    config = _engine_config(tmp_path, kv_connector_extra_config={"store_dir": str(tmp_path)})
    monkeypatch.delattr(cpu_attn, "_get_attn_isa")
    monkeypatch.setattr(compat, "_checked", False)  # as in a process starting afresh
    with pytest.raises(UnsupportedEngine, match="_get_attn_isa"):
        KVStoreConnector(config, KVConnectorRole.SCHEDULER)


def test_the_failure_policy_is_filled_only_where_left_at_vllms_default(tmp_path, records):
    config = _engine_config(tmp_path, kv_connector_extra_config={"store_dir": str(tmp_path)})
    assert config.kv_transfer_config.kv_load_failure_policy == "fail"  # vLLM's default
    conn = KVStoreConnector(config, KVConnectorRole.SCHEDULER)
    try:
        assert config.kv_transfer_config.kv_load_failure_policy == "recompute"
    finally:
        conn.shutdown()
    assert any("kv_load_failure_policy='recompute'" in r.getMessage()
               and "default" in r.getMessage() for r in records)

    def transfer(**kw):
        return KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both", **kw)

    mine = transfer(kv_load_failure_policy="recompute")
    assert load_failure_policy(mine, None) == "recompute"  # the user's: kept, as it is
    strict = transfer()
    records.clear()
    assert load_failure_policy(strict, "fail") == "fail"  # asked for through the extra config
    assert strict.kv_load_failure_policy == "fail"
    (line,) = [r for r in records if "kv_load_failure_policy" in r.getMessage()]
    assert line.levelno == logging.WARNING and "fails its request" in line.getMessage()
    with pytest.raises(ValueError, match="kv_load_failure_policy.*'fail'.*'recompute'"):
        load_failure_policy(transfer(kv_load_failure_policy="recompute"), "fail")


def test_the_extra_config_failure_policy_is_checked(tmp_path):
    from kvstore.integrations.vllm.config import ConnectorConfig

    cfg = ConnectorConfig.from_extra_config({"store_dir": str(tmp_path),
                                             "kv_load_failure_policy": "fail"})
    assert cfg.kv_load_failure_policy == "fail"
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        ConnectorConfig.from_extra_config({"store_dir": str(tmp_path),
                                           "kv_load_failure_policy": "ignore"})


def test_the_attention_isa_is_vllms_own_choice():
    isa = compat.attention_isa(torch.float32, 128, 64, "auto")
    assert isa == cpu_attn._get_attn_isa(torch.float32, 128, 64, "auto")
