"""What an engine must offer an integration, checked once at startup.

Each integration keeps the engine's private surface it still needs (names with a leading
underscore, stack-frame walks) in ONE module, its ``compat``
(:mod:`kvstore.integrations.vllm.compat`, :mod:`kvstore.integrations.llama_cpp.compat`), which
names the engine versions it was tested with and checks, by feature presence (an attribute
exists, a function takes the arguments given), that the installed engine still has that
surface. :func:`verify` turns what a check found into the outcome: a clear
:class:`UnsupportedEngine` naming the installed version, the tested ones and what is missing;
or, for an untested version whose surface is all present, one warning and a run.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Sequence


class UnsupportedEngine(RuntimeError):
    """The installed engine lacks what an integration needs (its message names the installed
    version, the versions the integration was tested with, and what is missing)."""


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def verify(engine: str, installed: str, tested: Sequence[str], missing: Sequence[str],
           log: logging.Logger) -> None:
    """Raise :class:`UnsupportedEngine` if ``missing`` names anything; else, if ``installed``
    is not among ``tested``, log one warning per process and engine version."""
    if missing:
        raise UnsupportedEngine(
            f"{engine} {installed} is installed, but kvstore's {engine} integration was tested "
            f"with {engine} {', '.join(tested)} and needs what this version lacks: "
            f"{'; '.join(missing)}. Install {engine}=={tested[-1]}, or a kvstore release that "
            f"supports {engine} {installed}.")
    if installed in tested:
        return
    with _warned_lock:
        if (engine, installed) in _warned:
            return
        _warned.add((engine, installed))
    log.warning("kvstore: %s %s is not a version the %s integration was tested with (%s); "
                "the private surface it uses is present, so it runs", engine, installed,
                engine, ", ".join(tested))


def takes(fn: Callable, *args: object) -> bool:
    """Whether ``fn`` accepts ``args`` positionally (its signature binds them)."""
    try:
        inspect.signature(fn).bind(*args)
    except (TypeError, ValueError):
        return False
    return True
