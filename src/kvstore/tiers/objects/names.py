"""Where the object tier's objects live under its prefix, and what a listing says of them.

* ``v/<chain key>``: a chunk's value (:mod:`kvstore.tiers.shared.value`: header, then every
  layer's payload, checksummed). The chain key is the chunk's chain hash, seeded by the
  layout's fingerprint and the namespace: every store of one model, anywhere, names the same
  KV the same way, and KV of another model is never under its name.
* ``u/<chain key>``: an empty marker, written when a store uses (fetches, or finds when writing)
  the value: its time is the value's last use (:mod:`kvstore.tiers.objects.lifecycle`).
* ``k/<parent key>/<head>-<n>-<chain key>``: an empty entry saying a chunk of ``n`` tokens
  whose first (up to 8) ids are ``head`` follows chunk ``parent``: a prompt whose chunk there
  is a prefix of it (or shares a prefix with it) finds it by listing its parent's entries that
  begin like its own tokens
  (:func:`kids_listing`; S3 has no sets).
* ``b/<parent key>/<offset>-<state tokens>-<chain key>``: an empty entry saying a hybrid
  layout's boundary state begins ``offset`` tokens into the chunk after ``parent``, carrying
  ``state tokens`` STATE positions, its context's chunk there being ``chain key``
  (:mod:`kvstore.tiers.shared.marks`): a prompt lists its chunks' entries to find its
  boundaries.

A listing is untrusted XML: it is read with a scanner of the few elements it needs (no entity
expansion, no DTD), and an entry whose name does not parse is skipped.
"""

from __future__ import annotations

import calendar
import html
import re
import time
from dataclasses import dataclass

import numpy as np

from kvstore.tiers.shared import marks
from kvstore.tiers.shared import value as rv

KID_PREFIX = 8  # a partial chunk is found by a prompt sharing its first 8 tokens
_HEX_KEY = 2 * rv.KEY_BYTES
_MARK = re.compile(rf"([0-9]{{1,8}})-([0-9]{{1,8}})-([0-9a-f]{{{_HEX_KEY}}})", re.ASCII)


def value_name(prefix: str, key: bytes) -> str:
    return f"{prefix}v/{key.hex()}"


def use_name(prefix: str, key: bytes) -> str:
    return f"{prefix}u/{key.hex()}"


def kids_dir(prefix: str, parent: bytes) -> str:
    return f"{prefix}k/{parent.hex()}/"


def kids_listing(prefix: str, parent: bytes, tokens: np.ndarray) -> str:
    """The listing prefix under which the partial chunks after ``parent`` that a chunk of
    ``tokens`` can extend into are: those sharing its first 8 tokens when it has 8 (a shorter
    partial chunk would save fewer than 8 tokens of prefill), else those sharing its first
    token (only partial chunks no longer than it can match). One listing page (1,000 entries)
    is read: a parent followed by many conversations (a shared system prompt) is narrowed to
    the ones that continue the same way."""
    n = KID_PREFIX if len(tokens) >= KID_PREFIX else 1
    return kids_dir(prefix, parent) + np.ascontiguousarray(tokens[:n], dtype="<u4").tobytes().hex()


def kid_name(prefix: str, parent: bytes, key: bytes, tokens: np.ndarray) -> str:
    head = np.ascontiguousarray(tokens[:KID_PREFIX], dtype="<u4").tobytes()
    return f"{kids_dir(prefix, parent)}{head.hex()}-{len(tokens)}-{key.hex()}"


def parse_kid(name: str, directory: str) -> tuple[np.ndarray, int, bytes] | None:
    """(head token ids, n_tokens, chain key) of a kids entry's name, None if it is not one."""
    if not name.startswith(directory):
        return None
    parts = name[len(directory):].split("-")
    if len(parts) != 3 or len(parts[2]) != _HEX_KEY or not parts[1].isdigit():
        return None
    try:
        head, key = bytes.fromhex(parts[0]), bytes.fromhex(parts[2])
    except ValueError:
        return None
    n = int(parts[1])
    if not head or len(head) % 4 or len(head) // 4 > min(KID_PREFIX, n) or n > rv.MAX_TOKENS:
        return None
    return np.frombuffer(head, dtype="<u4").copy(), n, key


def marks_dir(prefix: str, parent: bytes) -> str:
    return f"{prefix}b/{parent.hex()}/"


def mark_name(prefix: str, parent: bytes, mark: marks.Mark) -> str:
    return f"{marks_dir(prefix, parent)}{mark.offset}-{mark.state_tokens}-{mark.key.hex()}"


def parse_mark(name: str, directory: str) -> marks.Mark | None:
    """The boundary mark an entry's name under ``directory`` says; None if it is not one."""
    m = _MARK.fullmatch(name[len(directory):]) if name.startswith(directory) else None
    if m is None:
        return None
    return marks.checked(int(m.group(1)), int(m.group(2)), bytes.fromhex(m.group(3)))


def key_of(name: str, directory: str) -> bytes | None:
    """The chain key of ``v/``/``u/`` object ``name`` under ``directory``; None otherwise."""
    rest = name[len(directory):] if name.startswith(directory) else ""
    if len(rest) != _HEX_KEY:
        return None
    try:
        return bytes.fromhex(rest)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Listed:
    name: str
    size: int
    modified: float  # seconds since the epoch (the service's clock)


@dataclass(frozen=True, slots=True)
class Listing:
    objects: list[Listed]
    next_token: str | None  # a continuation token when the listing is truncated


_ELEMENT = re.compile(rb"<(Contents|IsTruncated|NextContinuationToken)>(.*?)</\1>", re.S)
_FIELD = re.compile(rb"<(Key|Size|LastModified)>(.*?)</\1>", re.S)


def parse_time(text: str) -> float | None:
    """An ISO 8601 time as S3 lists it (``2026-11-29T01:11:36.000Z``), None if it is not."""
    try:
        base = text.strip().rstrip("Z").split(".")[0]
        return float(calendar.timegm(time.strptime(base, "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


def http_date(text: str | None) -> float | None:
    """An HTTP ``Date`` header as seconds since the epoch, None if absent or malformed."""
    if not text:
        return None
    try:
        return float(calendar.timegm(time.strptime(text.strip(), "%a, %d %b %Y %H:%M:%S GMT")))
    except ValueError:
        return None


def parse_listing(body: bytes) -> Listing:
    """The objects of a ListObjectsV2 reply (entries that do not parse are skipped)."""
    objects: list[Listed] = []
    truncated, token = False, None
    for m in _ELEMENT.finditer(body):
        tag, inner = m.group(1), m.group(2)
        if tag == b"IsTruncated":
            truncated = inner.strip() == b"true"
        elif tag == b"NextContinuationToken":
            token = html.unescape(inner.decode("utf-8", "replace")).strip() or None
        else:
            f = {k.decode(): html.unescape(v.decode("utf-8", "replace"))
                 for k, v in _FIELD.findall(inner)}
            when = parse_time(f.get("LastModified", ""))
            size = f.get("Size", "")
            if "Key" in f and size.isdigit() and when is not None:
                objects.append(Listed(f["Key"], int(size), when))
    return Listing(objects, token if truncated else None)
