"""Byte-level BPE tokenizer built from GGUF ``tokenizer.ggml.*`` metadata with `tokenizers`.

Supports ``tokenizer.ggml.model == "gpt2"`` (GPT-2 style byte-level BPE) with the pre-tokenizers
``smollm`` (each digit on its own, then the GPT-2 byte-level regex, as llama.cpp's
``LLAMA_VOCAB_PRE_TYPE_SMOLLM``) and ``gpt2``/``default`` (the GPT-2 regex alone).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["Tokenizer"]

# llama.cpp token types (gguf.TokenType)
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 2, 3, 4


class Tokenizer:
    """encode(text) -> list[int]; decode(ids) -> str. Special tokens (e.g. ``<|im_start|>``)
    written in the text are parsed as special ids unless ``allow_special=False``."""

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int] | None = None,
        *,
        pre: str = "gpt2",
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as _HFTok

        if len(tokens) == 0:
            raise ValueError("tokens must be non-empty")
        if token_types is not None and len(token_types) != len(tokens):
            raise ValueError(
                f"token_types must have one entry per token ({len(tokens)}), got {len(token_types)}"
            )
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError("tokens contains duplicates")
        pairs: list[tuple[str, str]] = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep:
                raise ValueError(f"merges: malformed entry {m!r} (expected 'left right')")
            pairs.append((a, b))

        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre == "smollm":
            pre_tok = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        elif pre in ("gpt2", "default"):
            pre_tok = byte_level
        else:
            raise ValueError(f"pre: unsupported pre-tokenizer {pre!r} (supported: smollm, gpt2)")

        def build(parse_special: bool) -> Any:
            tk = _HFTok(models.BPE(vocab=dict(vocab), merges=list(pairs), fuse_unk=False))
            tk.pre_tokenizer = pre_tok
            tk.decoder = decoders.ByteLevel()
            special = [
                AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(token_types or ())
                if t in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
            ]
            tk.add_special_tokens(special)
            tk.encode_special_tokens = not parse_special
            return tk

        self._tok = build(parse_special=True)
        self._tok_plain = build(parse_special=False)
        self.vocab_size = len(tokens)
        self.special_ids = frozenset(
            i for i, t in enumerate(token_types or ()) if t in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
        )
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pre = pre

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model {model!r} is not supported (only 'gpt2')")
        return cls(
            metadata["tokenizer.ggml.tokens"],
            metadata["tokenizer.ggml.merges"],
            metadata.get("tokenizer.ggml.token_type"),
            pre=metadata.get("tokenizer.ggml.pre", "gpt2"),
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        )

    def token_to_id(self, token: str) -> int:
        """Id of a vocabulary entry (e.g. ``"<|im_end|>"``); KeyError if absent."""
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(token)
        return int(i)

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Token ids of ``text``. With ``allow_special=False`` special-token strings in the text
        are encoded as ordinary text (use for untrusted content inside a chat template)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        tk = self._tok if allow_special else self._tok_plain
        return list(tk.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"ids: token id {i} out of range [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def __len__(self) -> int:
        return self.vocab_size
