"""The remote tier: a Redis server or Redis Cluster shared by stores on many machines.

:mod:`~kvstore.remote.value` (the checksummed value format), :mod:`~kvstore.remote.config`
(``RemoteConfig``), :mod:`~kvstore.remote.tier` (connections, pipelined calls, verification),
:mod:`~kvstore.remote.breaker` (per-node circuit breakers), :mod:`~kvstore.remote.estimate`
(link estimates, fetch-only-when-it-pays), :mod:`~kvstore.remote.queue` (the write-through
worker), :mod:`~kvstore.remote.link` (what the store calls).
"""

from kvstore.remote.config import RemoteConfig
from kvstore.remote.tier import RemoteAuthError, RemoteSetupError, RemoteTier

__all__ = ["RemoteAuthError", "RemoteConfig", "RemoteSetupError", "RemoteTier"]
