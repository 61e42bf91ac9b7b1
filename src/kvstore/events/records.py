"""KV events in vLLM's wire format: ``KVEventBatch`` of ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, msgpack-encoded by msgspec.

The structs are vLLM's own (``vllm/distributed/kv_events.py`` of vLLM 0.32), field for field
and option for option, defined here so that kvstore never imports vLLM: the batch is an
array-like struct ``[ts, events, data_parallel_rank]``; each event is a struct tagged by its
class name in a ``type`` field (``{"type": "BlockStored", "block_hashes": [...], ...}``),
defaults omitted. ``tests/kvstore/events/test_records.py`` checks that vLLM's decoder reads
what :func:`encode_batch` writes and that :func:`decode_batch` reads what vLLM's publisher
writes, byte for byte.

A publisher sends each batch as three ZMQ frames, ``(topic, seq, payload)``: ``seq`` is the
batch's sequence number as 8 big-endian bytes (:func:`seq_bytes`); a replay socket answers a
request of 8 big-endian bytes (the first sequence number wanted) with every buffered batch from
there, then :data:`END_SEQ` with an empty payload.

``medium`` names where the blocks are. vLLM publishes ``"GPU"`` for its own KV cache and
``"CPU"`` / ``"STORAGE"`` for its native offloading tiers; the store names its tiers with
:data:`~kvstore.events.media.TIER_MEDIA` (configurable:
:class:`kvstore.events.config.EventsConfig`). Block hashes
are ``bytes`` or, as vLLM sends them by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``),
the hash's last 8 bytes as a big-endian unsigned int (:func:`external_hash`).

Thread-safety: the records are plain values; encoders and decoders made by
:func:`batch_encoder` / :func:`batch_decoder` are used by one thread at a time.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvstore.events.media import (
    LOCAL,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_REDIS,
    MEDIUM_S3,
    MEDIUM_STORAGE,
    REMOTE,
    TIER_MEDIA,
)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last frame's sequence number

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events (tagged by class name)."""


class BlockStored(KVCacheEvent):
    """Consecutive blocks of ``block_size`` tokens each now held in ``medium``: their hashes
    (chained: ``block_hashes[0]`` follows ``parent_block_hash``, None for a prompt's first
    block), and their ``token_ids``, ``block_size * len(block_hashes)`` of them."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer held in ``medium``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Everything the publisher announced before is gone (a subscriber forgets it)."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


Event = BlockStored | BlockRemoved | AllBlocksCleared


def external_hash(digest: bytes, *, as_int: bool = True) -> ExternalBlockHash:
    """A block hash as events carry it: the digest's last 8 bytes as a big-endian unsigned
    int (vLLM's default) or the digest itself."""
    return int.from_bytes(digest[-8:], "big") if as_int else bytes(digest)


def seq_bytes(seq: int) -> bytes:
    """A batch's sequence number as it travels (8 bytes, big-endian)."""
    return seq.to_bytes(8, "big")


def batch_encoder() -> msgspec.msgpack.Encoder:
    """An encoder of :class:`KVEventBatch` (one per thread)."""
    return msgspec.msgpack.Encoder()


def batch_decoder() -> msgspec.msgpack.Decoder:
    """A decoder of :class:`KVEventBatch` payloads (one per thread): ``decode(payload)``
    raises ``msgspec.DecodeError`` / ``msgspec.ValidationError`` on anything else."""
    return msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of ``batch``."""
    return msgspec.msgpack.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """The batch a payload holds; ``msgspec.DecodeError`` / ``msgspec.ValidationError`` if it
    is not one (an untrusted payload is checked against the structs' types)."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "END_SEQ", "Event", "EventBatch",
           "ExternalBlockHash", "KVCacheEvent", "KVEventBatch", "LOCAL", "MEDIUM_CPU",
           "MEDIUM_GPU", "MEDIUM_REDIS", "MEDIUM_S3", "MEDIUM_STORAGE", "REMOTE", "TIER_MEDIA",
           "batch_decoder", "batch_encoder", "decode_batch", "encode_batch", "external_hash",
           "seq_bytes"]
