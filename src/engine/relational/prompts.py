"""Prompt token ids, assembled from separately tokenized pieces.

A prompt is the chat template around one user message: the instruction line, one line per field
(``name: value``) and the function's answer-format line. Each line is tokenized once (a piece)
and the prompt's ids are the template's head, the pieces in the plan's order, and the template's
tail. Every line starts with a visible character and ends with one, then a newline: the
byte-level pre-tokenizer never joins a newline to the next line's first character, nor (with
no space before it) to the end of its own line, so the concatenation is the tokenization of
the whole text (``tests/engine/relational/test_relational.py`` checks it against
``model.chat_template``). Field order therefore never changes a field's tokens, a field's
tokens are shared exactly wherever its line is, and a new column order costs no tokenization.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from engine.relational.calls import FUNCTIONS, Call
from engine.relational.render import field_line
from engine.tokenizer import Tokenizer

ChatTemplate = Callable[[Sequence[Mapping[str, str]]], list[int]]


def message_text(call: Call, order: Sequence[int] | None = None) -> str:
    """The user message of ``call`` with its fields in ``order`` (default: argument order).
    The prompt is the chat template around it, plus the function's ``answer_prefix``."""
    idx = range(len(call.fields)) if order is None else order
    spec = FUNCTIONS[call.function]
    text = call.instruction + "\n"
    text += "".join(field_line(*call.fields[i]) for i in idx)
    if spec.answer_line is not None:
        text += spec.answer_line + "\n"
    return text


class PromptBuilder:
    """Interns prompt lines as token pieces and assembles prompts from them.

    Thread-safety: none (its piece cache is unsynchronized); one builder per query.
    """

    def __init__(self, tokenizer: Tokenizer, chat_template: ChatTemplate) -> None:
        self.tokenizer = tokenizer
        empty = chat_template([{"role": "user", "content": ""}])
        tail = [tokenizer.token_to_id("<|im_end|>"), *tokenizer.encode("\n", allow_special=False),
                tokenizer.token_to_id("<|im_start|>"),
                *tokenizer.encode("assistant\n", allow_special=False)]
        if empty[-len(tail):] != tail:
            raise ValueError("chat_template does not end a user turn with the ChatML "
                             "'<|im_end|>\\n<|im_start|>assistant\\n' tail")
        self._ids: dict[str, int] = {}
        self._fields: dict[tuple[str, str], int] = {}
        # piece id -> token ids (int32), and the same as big-endian bytes (which compare as
        # the token sequences do); pieces 0 and 1 are the template's head and tail.
        self.pieces: list[np.ndarray] = []
        self.keys: list[bytes] = []
        self._add(empty[: -len(tail)])
        self._add(tail)

    HEAD = 0
    TAIL = 1

    def _add(self, ids: Sequence[int]) -> int:
        arr = np.asarray(ids, dtype=np.int32)
        self.pieces.append(arr)
        self.keys.append(arr.astype(">u4").tobytes())
        return len(self.pieces) - 1

    def piece(self, line: str) -> int:
        """The piece id of one prompt line (tokenized on first use)."""
        pid = self._ids.get(line)
        if pid is None:
            pid = self._add(self.tokenizer.encode(line, allow_special=False))
            self._ids[line] = pid
        return pid

    def piece_lengths(self) -> np.ndarray:
        """Token length of every piece so far, by piece id."""
        return np.fromiter((len(p) for p in self.pieces), dtype=np.int64,
                           count=len(self.pieces))

    def field_pieces(self, call: Call) -> list[int]:
        """Piece ids of the call's fields, in argument order."""
        out = []
        for f in call.fields:
            pid = self._fields.get(f)
            if pid is None:
                pid = self._fields[f] = self.piece(field_line(*f))
            out.append(pid)
        return out

    def row(self, call: Call, field_pieces: Sequence[int], order: Sequence[int]
            ) -> tuple[int, ...]:
        """The prompt of ``call`` as piece ids: head, instruction, the fields
        (``field_pieces``, argument order) in ``order``, the answer-format line, tail, the
        start of the reply."""
        spec = FUNCTIONS[call.function]
        out = [self.HEAD, self.piece(call.instruction + "\n")]
        out += [field_pieces[i] for i in order]
        if spec.answer_line is not None:
            out.append(self.piece(spec.answer_line + "\n"))
        out.append(self.TAIL)
        if spec.answer_prefix is not None:
            out.append(self.piece(spec.answer_prefix))
        return tuple(out)

    def assemble(self, row: Sequence[int]) -> list[int]:
        """Token ids of a prompt given as piece ids."""
        return np.concatenate([self.pieces[p] for p in row]).tolist()
