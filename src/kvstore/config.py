"""A store's sizes and policy: one typed, validated object.

``disk_bytes`` and ``chunk_tokens`` are shared by every process of a store (they fix where each
chunk's bytes live); the other sizes and the policy belong to each process (its DRAM tier, its
execution buffers, its write buffer, its eviction order), and may differ between processes.
So are ``codecs`` (which codec each tier stores new chunks through): every chunk records the
codec it was stored with, so a process with another config still reads it right. The caps on
pins (``pin_namespace_fraction``, ``pin_total_fraction``) are checked by the process that pins,
against every process's pins (the catalog holds them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from types import MappingProxyType

import numpy as np

from kvstore.eviction.policies import make_policy
from kvstore.format.records import MAX_SLOT
from kvstore.layout import KVLayout
from kvstore.tiers import codecs as tier_codecs
from kvstore.tiers.codecs import TIERS, TierCodecs, check_codecs
from kvstore.tiers.disk import SegmentGeometry

DEFAULT_DRAM_BYTES = 1 << 30  # 1 GiB
DEFAULT_DISK_BYTES = 16 << 30  # 16 GiB
DEFAULT_CHUNK_TOKENS = 256
DEFAULT_WRITE_BUFFER_BYTES = 256 << 20  # 256 MiB
DEFAULT_HBM_BYTES = 1 << 30  # 1 GiB
DEFAULT_PIN_NAMESPACE_FRACTION = 0.25  # of the disk tier's slots, per namespace
DEFAULT_PIN_TOTAL_FRACTION = 0.5  # of the disk tier's slots, every namespace together
FRACTIONS = ("pin_namespace_fraction", "pin_total_fraction")

SIZES = ("dram_bytes", "disk_bytes", "hbm_bytes", "write_buffer_bytes")


def check_size(name: str, v: object) -> int | None:
    """A byte-size argument: None (not given) or an int >= 0."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | np.integer):
        raise TypeError(f"{name} must be an int number of bytes, got {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return int(v)


def check_fraction(name: str, v: object) -> float:
    """A share of a capacity: a real number in (0, 1]."""
    if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
        raise TypeError(f"{name} must be a number in (0, 1], got {type(v).__name__}")
    if not (math.isfinite(v) and 0 < v <= 1):
        raise ValueError(f"{name} must be in (0, 1], got {v!r}")
    return float(v)


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Sizes and policy of a store; persisted at creation, replaceable on reopen."""

    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    dram_bytes: int = DEFAULT_DRAM_BYTES
    disk_bytes: int = DEFAULT_DISK_BYTES
    hbm_bytes: int = DEFAULT_HBM_BYTES
    write_buffer_bytes: int = DEFAULT_WRITE_BUFFER_BYTES
    policy: str = "scheduler"
    codecs: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType(dict.fromkeys(TIERS, "none")))
    # The codec disk slots are sized for: "none" (a raw chunk's extent) or a lossy codec with a
    # fixed encoded size, whose smaller slots hold more chunks and keep a context's coded
    # chunks contiguous (chunks that codec cannot take cannot be stored). Fixed at creation.
    slot_codec: str = "none"
    # Retention hints (Store.pin): the share of the disk tier's slots the pinned contexts of
    # one namespace may take, and that every namespace's pins together may take (each in
    # (0, 1]; a pin beyond either is refused with PinRefused).
    pin_namespace_fraction: float = DEFAULT_PIN_NAMESPACE_FRACTION
    pin_total_fraction: float = DEFAULT_PIN_TOTAL_FRACTION

    def __post_init__(self) -> None:
        for name in ("chunk_tokens", *SIZES):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | np.integer):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if name == "chunk_tokens" and v < 1:
                raise ValueError(f"chunk_tokens must be positive, got {v}")
            if v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
            object.__setattr__(self, name, int(v))
        for name in FRACTIONS:
            object.__setattr__(self, name, check_fraction(name, getattr(self, name)))
        make_policy(self.policy)
        object.__setattr__(self, "codecs", check_codecs(self.codecs))
        tier_codecs.check_slot_codec(self.slot_codec)

    def __hash__(self) -> int:
        return hash(tuple((f.name, getattr(self, f.name)) for f in fields(self)
                          if f.name != "codecs") + tuple(sorted(self.codecs.items())))

    @cached_property
    def tier_codecs(self) -> TierCodecs:
        """The codec of each tier and of the disk slots (:mod:`kvstore.tiers.codecs`)."""
        return TierCodecs(disk=self.codecs["disk"], dram=self.codecs["dram"],
                          remote=self.codecs["remote"], slot=self.slot_codec)

    @property
    def disk_codec(self) -> str:
        return self.codecs["disk"]

    @property
    def dram_coded(self) -> bool:
        """The DRAM tier keeps each chunk as the disk stores it (coded), not decoded."""
        return self.tier_codecs.dram_coded

    def slot_bytes(self, layout: KVLayout) -> int:
        """Bytes of one DRAM slot: a full chunk's extent through the DRAM codec (the raw
        extent without one), page-aligned."""
        return self.tier_codecs.dram_slot_bytes(layout, self.chunk_tokens)

    def disk_slot_bytes(self, layout: KVLayout) -> int:
        """Bytes of one disk slot: a full chunk's extent through ``slot_codec``, page-aligned."""
        return self.tier_codecs.disk_slot_bytes(layout, self.chunk_tokens)

    def segment_geometry(self, layout: KVLayout) -> SegmentGeometry:
        """Where each disk slot lies in the segment files: slots of :meth:`disk_slot_bytes`
        filling ``disk_bytes``."""
        return SegmentGeometry.for_budget(slot_bytes=self.disk_slot_bytes(layout),
                                          disk_bytes=self.disk_bytes)

    def check_budget(self, layout: KVLayout) -> None:
        """Refuse budgets the layout cannot use: a disk tier smaller than one chunk, or one
        with more slots than the catalog can address; and, with disk slots sized for a codec,
        a disk codec whose full chunks would not fit them; and a lossy codec for a layout
        with boundary states (their rows are an engine's bytes, not KV values)."""
        if layout.boundary_state:
            lossy = sorted(t for t in TIERS if tier_codecs.is_lossy(self.codecs[t]))
            if lossy:
                raise ValueError(
                    f"codecs[{lossy[0]!r}]={self.codecs[lossy[0]]!r} is lossy; a layout with "
                    f"sliding-window or recurrent layers stores their state as bytes that only "
                    f"lossless codecs ('none', 'zstd') keep")
        self.tier_codecs.check_disk_fits_slots(layout, self.chunk_tokens)
        slot = self.disk_slot_bytes(layout)
        if self.disk_bytes < slot:
            raise ValueError(
                f"disk_bytes={self.disk_bytes} is smaller than one chunk ({slot} bytes for "
                f"chunk_tokens={self.chunk_tokens}); the disk tier must hold at least one chunk")
        if self.disk_bytes // slot > MAX_SLOT:
            raise ValueError(f"disk_bytes={self.disk_bytes} holds more than {MAX_SLOT} slots of "
                             f"{slot} bytes; use larger chunk_tokens or a smaller budget")

    def to_dict(self) -> dict[str, object]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if all(v == "none" for v in self.codecs.values()):
            del d["codecs"]  # a store that uses no codec keeps its metadata as before
        else:
            d["codecs"] = dict(self.codecs)
        if self.slot_codec == "none":
            del d["slot_codec"]  # raw slots: metadata as before
        for name, default in (("pin_namespace_fraction", DEFAULT_PIN_NAMESPACE_FRACTION),
                              ("pin_total_fraction", DEFAULT_PIN_TOTAL_FRACTION)):
            if d[name] == default:
                del d[name]  # the default caps: metadata as before
        return d

    def pin_cap_slots(self, total_slots: int) -> tuple[int, int]:
        """(slots one namespace's pins may take, slots every namespace's pins may take) of a
        disk tier of ``total_slots``."""
        return (math.floor(self.pin_namespace_fraction * total_slots),
                math.floor(self.pin_total_fraction * total_slots))

    @classmethod
    def from_dict(cls, d: object) -> StoreConfig:
        if not isinstance(d, dict):
            raise TypeError(f"store config must be a mapping, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        extra = set(d) - known
        if extra:
            raise ValueError(f"unknown store config fields: {sorted(extra)}")
        return cls(**d)
