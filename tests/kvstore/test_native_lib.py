"""The one loader of the C extensions (kvstore.native_lib): each reason a library is unavailable
is said, and nothing raises."""

import pytest

from kvstore import native_lib
from kvstore.pipelines import gather

needs_copy = pytest.mark.skipif(not gather.AVAILABLE, reason=gather.UNAVAILABLE_REASON or "")


def test_a_module_that_was_not_built_is_unavailable_with_the_reason():
    got = native_lib.load("kvstore._no_such_extension", abi=("v", 1), functions={})
    assert got == (None, None, "kvstore._no_such_extension was not built (no C compiler at "
                               "install?)")


def test_the_environment_variable_disables_every_library(monkeypatch):
    monkeypatch.setenv("KVSTORE_NATIVE", "off")
    got = native_lib.load("kvstore._kvcopy", abi=("kvcopy_abi_version", 2), functions={})
    assert got == (None, None, "disabled by KVSTORE_NATIVE=0")


@needs_copy
def test_a_stale_or_broken_build_is_unavailable_with_its_path(monkeypatch):
    monkeypatch.delenv("KVSTORE_NATIVE", raising=False)
    abi = gather._ABI_VERSION
    stale = native_lib.load("kvstore._kvcopy", abi=("kvcopy_abi_version", 999), functions={})
    assert stale.lib is None and stale.path == native_lib.find("kvstore._kvcopy")
    assert stale.reason == (f"{stale.path} is a stale build (ABI {abi}, expected 999): "
                            f"reinstall the package")
    broken = native_lib.load("kvstore._kvcopy", abi=("kvcopy_abi_version", abi),
                             functions={"no_such_function": (None, [])})
    assert broken.lib is None and broken.reason.startswith(f"cannot load {broken.path}: ")
    ok = native_lib.load("kvstore._kvcopy", abi=("kvcopy_abi_version", abi), functions={})
    assert ok.lib is not None and ok.reason is None
