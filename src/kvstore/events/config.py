"""``EventsConfig``: how a store publishes its KV events itself (``kvstore.open(...,
events=EventsConfig(...))``, ``kvstore serve --kv-events ENDPOINT``). Checked when built: a bad
value is a ``ValueError`` / ``TypeError`` naming the field. No dependency: importable without
msgspec or pyzmq.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvstore.events.hashing import DEFAULT_SEED
from kvstore.events.media import MEDIUM_GPU, TIER_MEDIA, TIERS

ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


def _check_endpoint(name: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value.startswith(ENDPOINT_SCHEMES):
        raise ValueError(f"{name} must be a ZMQ endpoint starting with one of "
                         f"{list(ENDPOINT_SCHEMES)} (e.g. 'tcp://*:5557'), got {value!r}")


@dataclass(frozen=True, kw_only=True)
class EventsConfig:
    """The store's own publisher of KV events (vLLM's ``--kv-events-config``, field for field
    where vLLM has one).

    * ``endpoint``: the PUB socket, bound when it holds ``*`` or ``::`` or is ``ipc://`` /
      ``inproc://``, else connected (vLLM's rule: ``tcp://*:5557`` binds, ``tcp://host:5557``
      connects to a subscriber that binds).
    * ``replay_endpoint``: the ROUTER socket (bound) that answers a request of 8 big-endian
      bytes, a sequence number, with the buffered batches from there on; None: no replay.
    * ``topic``: the first frame of every message (a subscriber filters on it).
    * ``buffer_steps``: batches kept for replay; ``hwm``: the PUB socket's high-water mark
      (messages a slow subscriber may lag before ZMQ drops them for it).
    * ``max_queue_size``: tier changes waiting for the publisher thread; beyond it they are
      dropped and counted (``stats()["events"]["dropped_changes"]``) and the DRAM and disk
      tiers are announced anew from what they hold (never a put that waits).
    * ``block_size``: tokens per block of the events (vLLM's block size of the engines a
      router sends to; must divide the store's ``chunk_tokens``).
    * ``hash_seed``: vLLM's NONE_HASH seed (its default, or the engines' ``PYTHONHASHSEED``);
      ``int_hashes``: hashes as ints (vLLM's default) or 32-byte strings.
    * ``media``: the medium each tier's events name (default
      :data:`~kvstore.events.media.TIER_MEDIA`); distinct, never ``"GPU"``.
    * ``sync_interval_s``: how soon the publisher learns what other processes of the store
      committed when this process is idle (its own changes go out at once).
    """

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    block_size: int = 16
    hash_seed: str = DEFAULT_SEED
    int_hashes: bool = True
    media: Mapping[str, str] = field(default_factory=lambda: MappingProxyType(dict(TIER_MEDIA)))
    sync_interval_s: float = 1.0

    def __post_init__(self) -> None:
        _check_endpoint("endpoint", self.endpoint, optional=False)
        _check_endpoint("replay_endpoint", self.replay_endpoint, optional=True)
        if self.replay_endpoint is not None and self.replay_endpoint == self.endpoint:
            raise ValueError("replay_endpoint must differ from endpoint")
        if not isinstance(self.topic, str):
            raise TypeError(f"topic must be a str, got {type(self.topic).__name__}")
        for name in ("buffer_steps", "hwm", "max_queue_size", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.hash_seed, str):
            raise TypeError(f"hash_seed must be a str, got {type(self.hash_seed).__name__}")
        if not isinstance(self.int_hashes, bool):
            raise TypeError(f"int_hashes must be a bool, got {self.int_hashes!r}")
        s = self.sync_interval_s
        if isinstance(s, bool) or not isinstance(s, int | float) or not 0 < s <= 3600:
            raise ValueError(f"sync_interval_s must be a number of seconds in (0, 3600], "
                             f"got {s!r}")
        object.__setattr__(self, "media", MappingProxyType(check_media(self.media)))

    def check_store(self, chunk_tokens: int) -> None:
        """ValueError unless ``block_size`` divides the store's ``chunk_tokens``."""
        if chunk_tokens % self.block_size:
            raise ValueError(f"events.block_size={self.block_size} must divide the store's "
                             f"chunk_tokens={chunk_tokens}")

    @classmethod
    def of(cls, value: EventsConfig | str) -> EventsConfig:
        """An EventsConfig, or one publishing on the endpoint ``value``."""
        if isinstance(value, EventsConfig):
            return value
        if isinstance(value, str):
            return cls(endpoint=value)
        raise TypeError(f"events must be a kvstore.EventsConfig or a ZMQ endpoint str, got "
                        f"{type(value).__name__}")


def check_media(media: object) -> dict[str, str]:
    """Every tier's medium (defaults for those not given): ValueError naming ``media``."""
    if not isinstance(media, Mapping):
        raise TypeError(f"media must be a mapping of tier -> medium, got "
                        f"{type(media).__name__}")
    unknown = sorted(set(media) - set(TIERS))
    if unknown:
        raise ValueError(f"media names unknown tiers {unknown}; the tiers are {list(TIERS)}")
    out = {**TIER_MEDIA, **media}
    for tier, medium in out.items():
        if not isinstance(medium, str) or not medium or medium.upper() == MEDIUM_GPU:
            raise ValueError(f"media[{tier!r}] must be a non-empty str other than "
                             f"{MEDIUM_GPU!r} (vLLM's own), got {medium!r}")
    if len(set(out.values())) != len(out):
        raise ValueError(f"media must name each tier differently, got {out}")
    return out
