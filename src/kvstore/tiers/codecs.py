"""Which codec each tier stores a chunk through, and what that implies: the one place that
decides it.

A store's ``codecs`` (:class:`kvstore.StoreConfig`) name one codec per tier:

- ``disk``: new chunks are written through it (a chunk it cannot take is kept raw, and every
  chunk records the codec it was written with, so a process with another config reads it
  right);
- ``dram``: ``none``, the DRAM tier keeps decoded copies; otherwise it keeps chunks as the disk
  stores them (coded, decoded when read), so it must be the disk codec, and one whose encoded
  size the layout fixes (DRAM slots are sized for it);
- ``remote``: values sent to the remote tier are encoded through it (a
  :class:`kvstore.RemoteConfig` may name it instead; the two must agree). A chunk stored here
  through a lossy codec goes through that codec unless the remote codec is lossy too.

``slot_codec`` (fixed at creation) sizes the disk slots for one fixed-size codec's chunks: the
disk codec must then be one whose chunks fit them, and a chunk it cannot take (non-finite
values) is stored raw only if its raw extent fits a slot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from kvstore.codecs.layer_codec import NAMES, LayerShape, check_name, encoded_size, is_lossy
from kvstore.tiers.disk import align_up

if TYPE_CHECKING:
    from kvstore.format.records import ChunkRecord
    from kvstore.layout import KVLayout

TIERS = ("dram", "disk", "remote")
# Codecs slots can be sized for (disk slots: ``slot_codec``; DRAM slots: ``codecs["dram"]``):
# those whose encoded size the layout fixes.
SLOT_CODECS = ("none", "int8", "fp8", "int4")


def check_codecs(v: object) -> MappingProxyType[str, str]:
    """A ``codecs`` argument: a mapping tier -> codec name; every tier it omits gets ``none``.
    Returns a read-only mapping of every tier."""
    if not isinstance(v, Mapping):
        raise TypeError(f"codecs must be a mapping of tier name to codec name, "
                        f"got {type(v).__name__}")
    out = dict.fromkeys(TIERS, "none")
    for tier, name in v.items():
        if tier not in TIERS:
            raise ValueError(f"codecs has an unknown tier {tier!r}; tiers are {list(TIERS)}")
        check_name(name, f"codecs[{tier!r}]")
        out[tier] = name
    dram = out["dram"]
    if dram != "none" and (dram not in SLOT_CODECS or dram != out["disk"]):
        raise ValueError(
            f"codecs['dram']={dram!r}: the DRAM tier caches chunks either decoded ('none') or "
            f"as the disk stores them, so a DRAM codec must be the disk codec and one of fixed "
            f"size ({list(SLOT_CODECS[1:])}); codecs['disk'] is {out['disk']!r}")
    return MappingProxyType(out)


def check_slot_codec(name: object) -> str:
    """``name`` if disk slots can be sized for it; ``ValueError`` otherwise."""
    if name not in SLOT_CODECS:
        raise ValueError(f"slot_codec must be one of {list(SLOT_CODECS)}, got {name!r}")
    return name  # type: ignore[return-value]


def coded_bytes(layout: KVLayout, codec: str, n_tokens: int) -> int:
    """Bytes of an extent of ``n_tokens`` stored through ``codec`` (a fixed-size codec)."""
    shape = LayerShape(layout.dtype, layout.num_kv_heads, n_tokens, layout.head_dim)
    size = encoded_size(codec, shape)
    assert size is not None, codec
    return layout.num_layers * size


def remote_value_codec(remote: str, stored: int) -> str:
    """The codec a local chunk stored through codec id ``stored`` is sent to the remote tier
    through, where the remote tier's codec is ``remote``. A chunk stored through a lossy codec
    is no recompute's KV: unless ``remote`` is lossy too it goes through its own codec, so that
    the value says it is lossy (re-encoding its decoded values stays within that codec's bound
    of them; a lossless remote codec would carry the lossy KV unmarked)."""
    local = NAMES[stored]
    return local if is_lossy(local) and not is_lossy(remote) else remote


@dataclass(frozen=True, slots=True)
class TierCodecs:
    """The codec of each tier (``disk``, ``dram``, ``remote``) and the one disk slots are sized
    for (``slot``), once :func:`check_codecs` and :func:`check_slot_codec` passed them (see
    :attr:`kvstore.StoreConfig.tier_codecs`); and the facts they imply."""

    disk: str = "none"
    dram: str = "none"
    remote: str = "none"
    slot: str = "none"

    @property
    def dram_coded(self) -> bool:
        """The DRAM tier keeps each chunk as the disk stores it (coded), not decoded."""
        return self.dram != "none"

    def coded_copy(self, stored: int) -> bool:
        """A DRAM copy of a chunk stored through codec id ``stored`` holds its coded (stored)
        bytes, to be decoded when read."""
        return self.dram != "none" and stored != 0

    @property
    def refuses_uncodable(self) -> bool:
        """Disk slots are sized for coded chunks and the disk codec is lossy: a chunk it cannot
        take (non-finite values) whose raw extent does not fit a slot cannot be stored."""
        return self.slot != "none" and is_lossy(self.disk)

    def staged_bytes(self, layout: KVLayout, n_tokens: int) -> int:
        """Bytes a DRAM copy of a new chunk of ``n_tokens`` takes when a put stages it: its raw
        extent, or with a DRAM codec (the disk codec, of fixed size) its encoded bytes."""
        return coded_bytes(layout, self.dram, n_tokens)

    def cached_bytes(self, layout: KVLayout, rec: ChunkRecord) -> int:
        """Bytes a DRAM copy of ``rec`` takes: its stored bytes where the DRAM tier keeps
        chunks as stored (a DRAM codec), else its raw extent."""
        if self.dram != "none":
            return rec.stored_bytes(rec.n_tokens * layout.layer_token_bytes)
        return rec.n_tokens * layout.token_bytes

    def dram_slot_bytes(self, layout: KVLayout, chunk_tokens: int) -> int:
        """Bytes of one DRAM slot: a full chunk's extent through the DRAM codec (the raw extent
        without one), page-aligned."""
        return align_up(coded_bytes(layout, self.dram, chunk_tokens))

    def disk_slot_bytes(self, layout: KVLayout, chunk_tokens: int) -> int:
        """Bytes of one disk slot: a full chunk's extent through ``slot``, page-aligned."""
        return align_up(coded_bytes(layout, self.slot, chunk_tokens))

    def check_disk_fits_slots(self, layout: KVLayout, chunk_tokens: int) -> None:
        """With disk slots sized for a codec, ``ValueError`` unless full chunks through the disk
        codec fit them."""
        if self.slot == "none":
            return
        if self.disk not in SLOT_CODECS or coded_bytes(layout, self.disk, chunk_tokens) \
                > self.disk_slot_bytes(layout, chunk_tokens):
            raise ValueError(
                f"codecs['disk']={self.disk!r} does not fit this store's disk slots, which are "
                f"sized for {self.slot!r} extents (slot_codec, fixed at creation): use "
                f"{self.slot!r} or a codec whose chunks are no larger")

    def remote_for(self, configured: str) -> str:
        """The remote tier's codec, where its :class:`kvstore.RemoteConfig` names
        ``configured``: the one of ``codecs["remote"]`` (or the configured one where that is
        ``none``); ``ValueError`` where both name one and they differ."""
        if self.remote == "none" or configured == self.remote:
            return configured
        if configured != "none":
            raise ValueError(f"codecs['remote']={self.remote!r} disagrees with the "
                             f"RemoteConfig's codec={configured!r}")
        return self.remote
