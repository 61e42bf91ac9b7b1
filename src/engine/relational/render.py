"""How a field value becomes prompt text: one deterministic rule per type.

A prompt is the instruction, then one line ``name: value`` per field (in the plan's order), then
the function's answer-format line. The rules, so the same value always renders the same text:

- NULL -> ``NULL``; an empty string stays empty (the line is ``name:``), so the two differ.
  Whitespace at the end of a value is dropped (a line never ends in a space: see
  :mod:`engine.relational.prompts`).
- text: as is, except control characters (newline, tab, ...) each become one space, so every
  field is one line.
- bool -> ``true``/``false``; int -> decimal digits; float -> the integer digits when it is
  integral (``90.0`` -> ``90``), else Python's shortest round-trip form (``7.2``); NaN and
  infinities -> ``NaN``, ``inf``, ``-inf``; Decimal -> its exact digits (``1.25``).
- date, time, timestamp -> ISO 8601; interval -> Python's ``str`` of the timedelta;
  bytes -> ``0x`` + hex; list -> ``[a, b]``; struct or map -> ``{k: v, ...}`` (values by
  these same rules); anything else -> ``str(value)``.
- A value whose text is longer than ``RenderConfig.max_value_chars`` characters is cut to its
  first ``max_value_chars`` characters followed by ``…`` (one character, U+2026).
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import dataclass
from decimal import Decimal

NULL_TEXT = "NULL"
TRUNCATION_MARK = "\u2026"

_CONTROL = {i: " " for i in range(32)} | {127: " "}


@dataclass(frozen=True, kw_only=True)
class RenderConfig:
    """How values are rendered into prompts."""

    max_value_chars: int = 1000  # longer values are cut to this many characters + "…"

    def __post_init__(self) -> None:
        v = self.max_value_chars
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"max_value_chars must be a positive int, got {v!r}")


def one_line(text: str) -> str:
    """``text`` with every control character (newline, tab, ...) replaced by a space."""
    return text.translate(_CONTROL)


def _float_text(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x.is_integer() and abs(x) < 1e16:
        return str(int(x))
    return repr(x)


def value_text(value: object) -> str:
    """The untruncated text of one value (see the module docstring for the rules)."""
    if value is None:
        return NULL_TEXT
    if isinstance(value, str):
        return one_line(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float_text(value)
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, _dt.datetime | _dt.date | _dt.time):
        return value.isoformat()
    if isinstance(value, _dt.timedelta):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return "0x" + bytes(value).hex()
    if isinstance(value, dict):
        return "{" + ", ".join(f"{one_line(str(k))}: {value_text(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        # Arrow maps arrive as lists of (key, value) pairs; lists as lists.
        if value and all(isinstance(p, tuple) and len(p) == 2 for p in value):
            return "{" + ", ".join(f"{value_text(k)}: {value_text(v)}" for k, v in value) + "}"
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    return one_line(str(value))


def render_value(value: object, config: RenderConfig) -> str:
    """The text of ``value`` in a prompt, truncated by ``config``'s rule."""
    text = value_text(value)
    if len(text) > config.max_value_chars:
        return text[: config.max_value_chars] + TRUNCATION_MARK
    return text


def field_line(name: str, text: str) -> str:
    """One field of a prompt: ``name: value`` without trailing whitespace, and a newline
    (``name`` and ``text`` are one line already: see :func:`engine.relational.calls.make_call`
    and :func:`render_value`). An empty value gives ``name:``."""
    return f"{name}: {text}".rstrip() + "\n"
