"""Every C extension of the package is built and loads: ``kvstore.index._kvindex`` (the index
kernels, opened by kvstore.index.native), ``kvstore._kvcopy`` (the gather copy,
kvstore.pipelines.gather) and ``kvstore._kvcodec`` (the codec decoders,
kvstore.codecs.native_decoders).

setup.py builds them ``optional=True``, so that an install without a C compiler still works on
the numpy fallbacks, and each module records why its library did not load in
``UNAVAILABLE_REASON``. The tests of each extension skip when it is missing, so without this file
a failed, stale or unloadable build would pass the suite having tested only the fallbacks. Here
it fails, with the module's reason, whether or not a compiler is present.

Opting out: ``KVSTORE_NATIVE=0`` (or ``false``, ``no``, ``off``), the switch the three modules
read at import to use their fallbacks, skips the check: the suite then tests the fallbacks
because it was asked to."""

import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvstore
from tests.support.paths import ROOT

MODULES = {  # extension -> the module that opens it
    "kvstore.index._kvindex": "kvstore.index.native",
    "kvstore._kvcopy": "kvstore.pipelines.gather",
    "kvstore._kvcodec": "kvstore.codecs.native_decoders",
}
OPTED_OUT = os.environ.get("KVSTORE_NATIVE", "1").strip() in ("0", "false", "no", "off")


@pytest.mark.skipif(OPTED_OUT, reason="KVSTORE_NATIVE=0: the numpy fallbacks were asked for")
@pytest.mark.parametrize("extension", sorted(MODULES))
def test_the_extension_is_built_and_loads(extension):
    module = importlib.import_module(MODULES[extension])
    assert module.AVAILABLE, f"{extension} did not load: {module.UNAVAILABLE_REASON}"


def test_a_package_without_its_extensions_fails_the_check(tmp_path):
    """The check above on a copy of the package whose extensions were not built (their files
    left out): it fails for each of the three, naming it and giving the module's reason."""
    src = tmp_path / "src"
    shutil.copytree(Path(kvstore.__file__).parent, src / "kvstore",
                    ignore=shutil.ignore_patterns("_kv*.so", "_kv*.pyd", "__pycache__"))
    assert not [p for p in (src / "kvstore").rglob("_kv*") if p.suffix in (".so", ".pyd")]
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_NATIVE"}
    env["PYTHONPATH"] = os.pathsep.join([str(src), str(ROOT)])
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         f"{__file__}::test_the_extension_is_built_and_loads"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "3 failed" in r.stdout, r.stdout
    for extension in MODULES:
        reason = re.search(rf"{re.escape(extension)} did not load: (.*)", r.stdout)
        assert reason and extension in reason.group(1), r.stdout  # "... was not built (...)"
