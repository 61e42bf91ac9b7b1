"""The remote tier: a Redis server or Redis Cluster shared by stores on many machines.

:mod:`~kvstore.tiers.remote.value` (the checksummed value format),
:mod:`~kvstore.tiers.remote.config`
(``RemoteConfig``), :mod:`~kvstore.tiers.remote.tier` (connections, pipelined calls, verification),
:mod:`~kvstore.tiers.remote.breaker` (per-node circuit breakers),
:mod:`~kvstore.tiers.remote.estimate`
(link estimates, fetch-only-when-it-pays); the store reaches it through
:mod:`~kvstore.pipelines.remote` (reads, and the write-through worker).
"""

from kvstore.tiers.remote.config import RemoteConfig
from kvstore.tiers.remote.tier import RemoteAuthError, RemoteSetupError, RemoteTier

__all__ = ["RemoteAuthError", "RemoteConfig", "RemoteSetupError", "RemoteTier"]
