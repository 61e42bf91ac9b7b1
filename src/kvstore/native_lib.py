"""Opening kvstore's C extensions with ctypes: one loader for the three of them.

The package build compiles ``native/kvcodec.c``, ``native/kvcopy.c`` and ``native/kvindex.c``
into the extension modules ``kvstore._kvcodec``, ``kvstore._kvcopy`` and
``kvstore.index._kvindex`` where a C compiler is present (setup.py; the build goes on without
one). :func:`load` finds one by its module name, opens it with ctypes, checks its ABI version and
declares the signatures of its functions; where any of that fails, or ``KVSTORE_NATIVE=0`` (also
``false``, ``no``, ``off``) is in the environment, it returns no library and the reason, and the
module that asked runs its numpy/Python fallback. Each of :mod:`kvstore.codecs.native_decoders`,
:mod:`kvstore.pipelines.gather` and :mod:`kvstore.index.native` calls it once, at import.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Mapping, Sequence
from typing import NamedTuple

#: a C function's ctypes signature: (return type, argument types)
Signature = tuple[object, Sequence[object]]


class Loaded(NamedTuple):
    """What :func:`load` found: the library (None where it is unavailable), the path of the
    extension's file (None where none was found) and why the library is unavailable (None where
    it is available)."""

    lib: ctypes.CDLL | None
    path: str | None
    reason: str | None


def disabled() -> bool:
    """``KVSTORE_NATIVE=0`` (or false/no/off) is set: every module runs its fallback."""
    return os.environ.get("KVSTORE_NATIVE", "1").strip() in ("0", "false", "no", "off")


def find(module: str) -> str | None:
    """The file of the built extension module ``module`` (e.g. ``kvstore._kvcopy``); None if it
    was not built."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    return spec.origin


def load(module: str, *, abi: tuple[str, int], functions: Mapping[str, Signature]) -> Loaded:
    """Open the extension ``module`` with ctypes: ``abi`` names its function that returns its
    ABI version (an int64) and the version this code was written for; ``functions`` maps each
    function used to its signature. Never raises for a library that is missing, stale or
    broken: it is then returned as unavailable, with the reason."""
    if disabled():
        return Loaded(None, None, "disabled by KVSTORE_NATIVE=0")
    path = find(module)
    if path is None:
        return Loaded(None, None, f"{module} was not built (no C compiler at install?)")
    symbol, want = abi
    try:
        lib = ctypes.CDLL(path)
        version = getattr(lib, symbol)
        version.restype = ctypes.c_int64
        version.argtypes = []
        got = version()
        if got != want:
            return Loaded(None, path, f"{path} is a stale build (ABI {got}, expected {want}): "
                                      f"reinstall the package")
        for name, (restype, argtypes) in functions.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = list(argtypes)
    except (OSError, AttributeError) as err:
        return Loaded(None, path, f"cannot load {path}: {err}")
    return Loaded(lib, path, None)

