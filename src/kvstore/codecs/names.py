"""The codecs' names and ids: what a record stores (an id) and what a config names. No codec
code here, so the records' formats know the ids without importing torch or zstandard."""

from __future__ import annotations

from kvstore.errors import CorruptData

NAMES = ("none", "zstd", "int8", "fp8", "int4")  # index = the codec id stored in records
LOSSY = frozenset({"int8", "fp8", "int4"})


def check_name(name: object, what: str = "codec") -> str:
    """``name`` if it names a codec; ``TypeError``/``ValueError`` naming ``what`` otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a codec name (str), got {type(name).__name__}")
    if name not in NAMES:
        raise ValueError(f"{what} must be one of {list(NAMES)}, got {name!r}")
    return name


def codec_id(name: str) -> int:
    return NAMES.index(check_name(name))


def codec_name(cid: int) -> str:
    """The codec of a stored id; :class:`CorruptData` for an id no codec has."""
    if not 0 <= cid < len(NAMES):
        raise CorruptData(f"unknown codec id {cid}")
    return NAMES[cid]
