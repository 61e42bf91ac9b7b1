"""The ``medium`` of each tier in KV events, and which tiers the store reports.

vLLM publishes ``"GPU"`` for its own KV cache and names its native offloading tiers ``"CPU"``
(host memory) and ``"STORAGE"`` (files); the store names its DRAM and disk tiers the same way,
and its shared tiers ``"REDIS"`` and ``"S3"`` (with ``locality="REMOTE"``: another machine's
store may hold them too). A router tells every one of them from ``"GPU"`` and from each other.
:class:`kvstore.events.config.EventsConfig` takes other names (e.g. Dynamo's ``CPU_TIER1`` /
``CPU_TIER2``). No dependency: importable without msgspec.
"""

from __future__ import annotations

MEDIUM_GPU = "GPU"  # vLLM's own KV cache (never published by the store)
MEDIUM_CPU = "CPU"  # vLLM's name for host memory; the store's DRAM tier (each process's own)
MEDIUM_STORAGE = "STORAGE"  # vLLM's name for its storage offloading tier; the store's disk
MEDIUM_REDIS = "REDIS"  # the store's remote tier (Redis / Redis Cluster), shared by machines
MEDIUM_S3 = "S3"  # the store's object tier (S3-compatible), shared by machines
TIERS = ("dram", "disk", "remote", "objects")
TIER_MEDIA = {"dram": MEDIUM_CPU, "disk": MEDIUM_STORAGE, "remote": MEDIUM_REDIS,
              "objects": MEDIUM_S3}  # the store's tiers -> the medium their events name
LOCAL, REMOTE = "LOCAL", "REMOTE"  # BlockStored/BlockRemoved.locality, relative to the publisher
SHARED_TIERS = ("remote", "objects")  # tiers other machines' stores write too


def locality(tier: str) -> str:
    """``LOCAL`` for this machine's tiers, ``REMOTE`` for the shared ones."""
    return REMOTE if tier in SHARED_TIERS else LOCAL
