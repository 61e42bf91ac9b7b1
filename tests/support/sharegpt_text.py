"""Real chat text for the engine tests: complete records read from the head of the ShareGPT
file, as chat messages."""

from __future__ import annotations

import json
import os
from pathlib import Path


def sharegpt_path() -> Path:
    """The dataset file (a project dependency: missing it is an install error, not a skip)."""
    from engine.sharegpt import dataset_path

    return Path(dataset_path())


def read_sharegpt_records(path: os.PathLike[str] | str, max_bytes: int = 2_000_000) -> list[dict]:
    """Complete records from the head of the ShareGPT JSON array (file may be cut mid-record).

    Reads at most ``max_bytes`` and decodes records one at a time; a record cut by the byte limit
    (or by the file's own truncation) is dropped.
    """
    with open(path, "rb") as f:
        text = f.read(max_bytes).decode("utf-8", errors="ignore")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    out: list[dict] = []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # truncated record at the end of what we read
        if isinstance(rec, dict) and isinstance(rec.get("conversations"), list):
            out.append(rec)
    return out


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
          "bard": "assistant", "bing": "assistant", "system": "system"}


def sharegpt_messages(record: dict) -> list[dict[str, str]]:
    """Chat messages (role/content) of one record; empty and unknown-role turns dropped."""
    msgs = []
    for turn in record["conversations"]:
        role = _ROLES.get(str(turn.get("from", "")).lower())
        value = turn.get("value")
        if role and isinstance(value, str) and value.strip():
            msgs.append({"role": role, "content": value})
    return msgs
