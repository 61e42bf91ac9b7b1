"""The llama.cpp integration's compatibility module: the private surface of llama-cpp-python it
uses is checked when a cache starts (a piece taken away from the real module is refused,
naming the installed version, the tested ones and what is missing; an untested version that has
it all runs with one warning), and the tested versions are the installed one; the stack-frame
walk finds the Llama whose method calls the cache."""

from __future__ import annotations

import logging

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from kvstore.integrations.llama_cpp import KVStoreLlamaCache, compat  # noqa: E402
from kvstore.integrations.surface import UnsupportedEngine  # noqa: E402
from tests.support.llama_helpers import make_llama  # noqa: E402


@pytest.fixture(autouse=True)
def checked_again():
    yield
    compat.check(again=True)


LOGGER = "kvstore.integrations.llama_cpp"  # what the shared ``records`` fixture captures


def test_the_tested_versions_are_the_installed_llama_cpp_python():
    assert llama_cpp.__version__ in compat.TESTED_VERSIONS
    assert compat.installed_version() == llama_cpp.__version__
    assert compat.missing_surface() == []
    compat.check(again=True)


def _refused(match: str) -> str:
    with pytest.raises(UnsupportedEngine, match=match) as e:
        compat.check(again=True)
    msg = str(e.value)
    assert f"llama-cpp-python {llama_cpp.__version__} is installed" in msg
    assert all(v in msg for v in compat.TESTED_VERSIONS)
    return msg


def test_a_llama_that_does_not_call_its_cache_from_create_completion_is_refused(monkeypatch):
    monkeypatch.delattr(llama_cpp.Llama, "_create_completion")
    _refused("Llama._create_completion")


def test_a_llama_without_logits_all_in_its_pickling_state_is_refused(monkeypatch):
    monkeypatch.delattr(llama_cpp.Llama, "__getstate__")
    _refused("logits_all")


def test_a_renamed_c_function_is_refused(monkeypatch):
    monkeypatch.delattr(llama_cpp, "llama_memory_seq_rm")
    _refused("llama_cpp.llama_memory_seq_rm")


def test_a_python_without_frame_access_is_refused(monkeypatch):
    import sys

    monkeypatch.delattr(sys, "_getframe")
    _refused("sys._getframe")


def test_a_cache_refuses_to_start_on_a_llama_cpp_python_without_the_surface(tmp_path,
                                                                           monkeypatch):
    monkeypatch.delattr(llama_cpp.Llama, "_create_completion")
    monkeypatch.setattr(compat, "_checked", False)  # as in a process starting afresh
    with pytest.raises(UnsupportedEngine, match="_create_completion"):
        KVStoreLlamaCache(tmp_path / "s")


def test_an_untested_version_with_the_surface_runs_with_one_warning(monkeypatch, records):
    monkeypatch.setattr(llama_cpp, "__version__", "0.9.99")
    compat.check(again=True)
    compat.check(again=True)
    warned = [r for r in records if "0.9.99" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING


class _Probe:
    """Stands where llama-cpp-python's cache is called: reports the Llama it finds."""

    def __getitem__(self, key):
        return compat.calling_llama()


def test_the_calling_llama_is_the_self_of_the_calling_method():
    llm = make_llama()
    try:
        probe = _Probe()

        def completion(self):  # a Llama method calling its cache, as _create_completion does
            return probe[0]

        assert completion(llm) is llm
        assert probe[0] is None  # not called from a Llama
        assert compat.logits_all(llm) is False
    finally:
        llm.close()
