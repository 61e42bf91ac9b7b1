"""The LLM functions SQL can call, and one call of them (the unit the planner dedups).

``llm(instruction, field, ...)`` answers in free text (VARCHAR). ``llm_bool`` and ``llm_score``
constrain the answer: their user message ends with an answer-format line, and only the first
generated token is read, so they cost one prefill and no decode step:

- ``llm_bool``: ``yes``/``true`` -> TRUE, ``no``/``false`` -> FALSE (the first word, any case);
  any other answer -> NULL (counted as unparsed in the query's stats).
- ``llm_score``: the prompt also starts the assistant's reply with ``Rating: ``, so the
  one token read is the score; its digits as a number (DOUBLE); anything else -> NULL.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from engine.relational.render import one_line

_WORD = re.compile(r"[A-Za-z]+")
_NUMBER = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)")


@dataclass(frozen=True, kw_only=True)
class FunctionSpec:
    """One SQL-callable LLM function: its name, result type and answer constraint."""

    name: str
    sql_type: str  # DuckDB result type
    answer_line: str | None  # appended after the fields (keeps the shared prefix intact)
    answer_prefix: str | None  # the start of the assistant's reply, given in the prompt
    max_new_tokens: int | None  # None: the query's configured length for free text

    def parse(self, text: str) -> str | bool | float | None:
        """The SQL value of a generated answer (``None`` = NULL: the answer did not parse)."""
        if self.sql_type == "VARCHAR":
            return text
        if self.sql_type == "BOOLEAN":
            m = _WORD.search(text)
            word = m.group(0).lower() if m else ""
            if word in ("yes", "true"):
                return True
            if word in ("no", "false"):
                return False
            return None
        m = _NUMBER.match(text)
        return float(m.group(1)) if m else None


FUNCTIONS: dict[str, FunctionSpec] = {
    "llm": FunctionSpec(name="llm", sql_type="VARCHAR", answer_line=None, answer_prefix=None,
                        max_new_tokens=None),
    "llm_bool": FunctionSpec(name="llm_bool", sql_type="BOOLEAN",
                             answer_line="Answer yes or no.", answer_prefix=None,
                             max_new_tokens=1),
    "llm_score": FunctionSpec(name="llm_score", sql_type="DOUBLE",
                              answer_line="Rate it from 1 (lowest) to 5 (highest).",
                              answer_prefix="Rating: ", max_new_tokens=1),
}


@dataclass(frozen=True)
class Call:
    """One row's LLM call, rendered: equal calls have equal prompts under every plan (the
    planner orders fields by their values, never by the row they came from), so a Call is the
    dedup key and the key of the answer cache."""

    function: str
    instruction: str
    fields: tuple[tuple[str, str], ...]  # (name, rendered value), in argument order

    def __post_init__(self) -> None:  # calls are dict keys by the thousand: hash once
        object.__setattr__(self, "_hash", hash((self.function, self.instruction, self.fields)))
        object.__setattr__(self, "_family",
                           (self.function, self.instruction, tuple(n for n, _ in self.fields)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    @property
    def family(self) -> tuple[str, str, tuple[str, ...]]:
        """Calls that may share a prefix: same function, instruction and field names."""
        return self._family  # type: ignore[attr-defined]


def make_call(function: str, instruction: object, fields: tuple[tuple[str, str], ...]) -> Call:
    """A normalized call: the instruction and the field names become one line each, without
    surrounding whitespace (so every prompt line starts with a visible character and the
    piecewise tokenization equals the whole text's). An instruction with no visible character
    is an error."""
    if function not in FUNCTIONS:
        raise ValueError(f"function must be one of {sorted(FUNCTIONS)}, got {function!r}")
    if not isinstance(instruction, str):
        raise TypeError(f"{function}: the instruction (first argument) must be text, got "
                        f"{type(instruction).__name__}")
    text = one_line(instruction).strip()
    if not text:
        raise ValueError(f"{function}: the instruction (first argument) is empty")
    return Call(function, text, tuple((one_line(n).strip(), v) for n, v in fields))


def calls_of(function: str, instructions: Sequence[object],
             columns: Sequence[tuple[str, Sequence[str]]]) -> list[Call | None]:
    """The calls of a batch of rows: ``instructions[i]`` and the rendered field values
    ``columns[j] = (name, values)`` of row i (``None`` where the instruction is NULL: no
    call, the answer is NULL). Normalized as :func:`make_call` does."""
    if function not in FUNCTIONS:
        raise ValueError(f"function must be one of {sorted(FUNCTIONS)}, got {function!r}")
    names = [one_line(n).strip() for n, _ in columns]
    values = [v for _, v in columns]
    seen: dict[str, str] = {}
    out: list[Call | None] = []
    for i, instr in enumerate(instructions):
        if instr is None:
            out.append(None)
            continue
        text = seen.get(instr) if isinstance(instr, str) else None
        if text is None:
            text = make_call(function, instr, ()).instruction
            seen[instr] = text
        out.append(Call(function, text, tuple(zip(names, (v[i] for v in values),
                                                  strict=True))))
    return out
