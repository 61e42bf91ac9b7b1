"""The remote tier: a Redis server or Redis Cluster shared by stores on many machines.

:mod:`~kvstore.tiers.remote.config` (``RemoteConfig``), :mod:`~kvstore.tiers.remote.tier`
(the cluster slot map, pipelined calls, verification), :mod:`~kvstore.tiers.remote.nodes` (one
node's client and breaker). What it shares with the object tier (the checksummed value format,
boundary marks, deadlines, breakers, link estimates) is :mod:`kvstore.tiers.shared`; the store
reaches it through :mod:`kvstore.pipelines.shared` (reads, and the write-through worker), as it
reaches the object tier.
"""

from kvstore.tiers.remote.config import RemoteConfig
from kvstore.tiers.remote.tier import RemoteAuthError, RemoteSetupError, RemoteTier

__all__ = ["RemoteAuthError", "RemoteConfig", "RemoteSetupError", "RemoteTier"]
