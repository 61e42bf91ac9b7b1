"""The object tier: KV in an S3-compatible bucket, shared by every store of a fleet.

:mod:`~kvstore.tiers.objects.config` (``ObjectsConfig``, the ``s3://`` URL, credentials),
:mod:`~kvstore.tiers.objects.s3` (SigV4 requests bounded in time and bytes),
:mod:`~kvstore.tiers.objects.names` (where objects live under the prefix),
:mod:`~kvstore.tiers.objects.tier` (parallel ranged reads, conditional writes, verification),
:mod:`~kvstore.tiers.objects.lifecycle` (time-to-live renewed on use, a size cap). Values are
the Redis tier's checksummed format (:mod:`kvstore.tiers.shared.value`); the store reaches the
tier through :mod:`kvstore.pipelines.shared.link`, as it reaches Redis.
"""

from kvstore.tiers.objects.config import CredentialsMissing, ObjectsConfig
from kvstore.tiers.objects.lifecycle import SweepFailed, SweepReport, sweep_objects
from kvstore.tiers.objects.tier import ObjectsAuthError, ObjectsSetupError, ObjectTier

__all__ = ["CredentialsMissing", "ObjectTier", "ObjectsAuthError", "ObjectsConfig",
           "ObjectsSetupError", "SweepFailed", "SweepReport", "sweep_objects"]

