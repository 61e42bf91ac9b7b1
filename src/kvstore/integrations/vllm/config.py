"""The connector's settings: ``kv_connector_extra_config`` checked into one typed object.

vLLM hands the connector a plain dict (``KVTransferConfig.kv_connector_extra_config``). Every
key is checked here, by name, before anything is opened; an unknown key is an error (a typo
would otherwise silently leave a default in place).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvstore.codecs.layer_codec import is_lossy
from kvstore.config import check_codecs, check_size
from kvstore.eviction.policies import make_policy
from kvstore.integrations.vllm.roles import DEFAULT_DEADLINE_S
from kvstore.tiers.objects.config import ObjectsConfig
from kvstore.tiers.remote.config import RemoteConfig

SIZE_KEYS = ("dram_bytes", "disk_bytes", "hbm_bytes", "write_buffer_bytes")
LOAD_FAILURE_POLICIES = ("recompute", "fail")  # vLLM's KVTransferConfig.kv_load_failure_policy
DEFAULT_BOUNDARY_GRACE_S = 60.0  # a replaced hybrid boundary, kept for a branch of its turn
BOUNDARY_GRACE_DISK_SHARE = 256  # ... within this share of the disk tier (default bytes)


@dataclass(frozen=True, kw_only=True)
class ConnectorConfig:
    """What ``kv_connector_extra_config`` may hold (only ``store_dir`` is required).

    * ``store_dir``: the store directory (created on first use); every vLLM instance, process
      and role that names it shares it.
    * ``dram_bytes``, ``disk_bytes``, ``hbm_bytes``, ``write_buffer_bytes``, ``policy``,
      ``codecs``: as :func:`kvstore.open` takes them (omitted: the stored or default values).
    * ``chunk_tokens``: the store's chunk size when the connector creates it, a multiple of
      vLLM's block size (default: the block size; an existing store keeps its own, which
      must be such a multiple too).
    * ``remote``: a Redis URL (or a list of Redis Cluster node URLs): the tier shared by
      machines.
    * ``remote_deadline_s``: the shared tiers' deadline per call (``RemoteConfig.deadline_s``,
      ``ObjectsConfig.deadline_s``; default 2 s for Redis, 5 s for the object tier): a
      layer-wise load of a long prompt must arrive within it, or what has not arrived is
      recomputed. Also a consumer's wait for a producer's KV when the request names none
      (``kv_role``, :mod:`~kvstore.integrations.vllm.roles`; default 2 s).
    * ``objects``: an ``s3://BUCKET/PREFIX?endpoint=...`` URL: the object tier every machine
      shares (:class:`kvstore.ObjectsConfig`; credentials from the ``AWS_*`` environment of
      the vLLM processes, or the URL's ``profile=``).
    * ``namespace``: KV is served only within its namespace (a request's ``cache_salt`` is
      mixed in too).
    * ``model_id``: the model's identity in the fingerprint (default: a digest of the model
      directory's config and weight files).
    * ``buffer_layers``: the layer-wise load's read buffer (default: no bound).
    * ``save``: whether to save new blocks (default True; False only reads the store).
    * ``kv_load_failure_policy``: ``"recompute"`` or ``"fail"``, vLLM's own setting of that
      name, for a user who wants ``"fail"`` kept: vLLM's ``KVTransferConfig`` cannot tell an
      explicit ``"fail"`` from its default, which the connector replaces with ``"recompute"``
      (:func:`~kvstore.integrations.vllm.connector.load_failure_policy`).
    * ``lossy_ok``: accept KV through a lossy codec (default False: a lossy codec in
      ``codecs`` is refused, and chunks another process stored lossily are not served, since
      KV that is not the KV vLLM computes changes answers). With True, the connector logs it
      at startup and every request's ``kv_transfer_params["kvstore"]["lossy_tokens"]`` says
      how many of the tokens it loaded came from lossy chunks.
    * ``boundary_grace_s``, ``boundary_grace_bytes`` (hybrid models): how long (default
      :data:`DEFAULT_BOUNDARY_GRACE_S` seconds) and how many bytes of state (default the disk
      tier's 1/:data:`BOUNDARY_GRACE_DISK_SHARE`) a boundary that a request's own boundary
      replaced is kept, so that another branch of that turn still finds it
      (:mod:`~kvstore.integrations.vllm.boundaries`); 0 deletes it as soon as its replacement
      is durable and no live request needs it.
    """

    store_dir: str
    dram_bytes: int | None = None
    disk_bytes: int | None = None
    hbm_bytes: int | None = None
    write_buffer_bytes: int | None = None
    policy: str | None = None
    codecs: Mapping[str, str] | None = None
    chunk_tokens: int | None = None
    remote: str | tuple[str, ...] | None = None
    remote_deadline_s: float | None = None
    objects: str | None = None
    namespace: str | None = None
    model_id: str | None = None
    buffer_layers: int | None = None
    save: bool = True
    lossy_ok: bool = False
    kv_load_failure_policy: str | None = None
    boundary_grace_s: float = DEFAULT_BOUNDARY_GRACE_S
    boundary_grace_bytes: int | None = None
    extra: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object] | None) -> ConnectorConfig:
        """Check every key of ``kv_connector_extra_config`` (ValueError/TypeError naming it)."""
        if not isinstance(extra, Mapping):
            raise TypeError("kv_connector_extra_config must be a mapping with at least "
                            f"'store_dir', got {type(extra).__name__}")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config has unknown keys {unknown}; the "
                             f"KVStoreConnector takes {sorted(known)}")
        store_dir = extra.get("store_dir")
        if not isinstance(store_dir, str | os.PathLike) or not os.fspath(store_dir):
            raise ValueError("kv_connector_extra_config['store_dir'] must name the store "
                             f"directory, got {store_dir!r}")
        kw: dict[str, object] = {"store_dir": os.path.expanduser(os.fspath(store_dir))}
        for name in SIZE_KEYS:
            kw[name] = check_size(f"kv_connector_extra_config[{name!r}]", extra.get(name))
        if (policy := extra.get("policy")) is not None:
            if not isinstance(policy, str):
                raise TypeError(f"kv_connector_extra_config['policy'] must be a str, "
                                f"got {policy!r}")
            make_policy(policy)
            kw["policy"] = policy
        if (codecs := extra.get("codecs")) is not None:
            kw["codecs"] = check_codecs(codecs)
        kw["chunk_tokens"] = _positive(extra, "chunk_tokens")
        kw["buffer_layers"] = _positive(extra, "buffer_layers", minimum=0)
        if (remote := extra.get("remote")) is not None:
            if isinstance(remote, list | tuple):
                remote = tuple(remote)
            RemoteConfig.of(remote)  # checks the URL(s) without connecting
            kw["remote"] = remote
        if (objects := extra.get("objects")) is not None:
            if not isinstance(objects, str):
                raise TypeError(f"kv_connector_extra_config['objects'] must be an s3:// URL "
                                f"string, got {type(objects).__name__}")
            try:
                ObjectsConfig.of(objects)  # checks the URL without connecting
            except ValueError as e:
                raise ValueError(f"kv_connector_extra_config['objects']: {e}") from None
            kw["objects"] = objects
        if (deadline := extra.get("remote_deadline_s")) is not None:
            if kw.get("remote") is None and kw.get("objects") is None:
                raise ValueError("kv_connector_extra_config['remote_deadline_s'] needs "
                                 "'remote' or 'objects'")
            if isinstance(deadline, bool) or not isinstance(deadline, int | float) \
                    or not 0 < deadline < float("inf"):
                raise ValueError(f"kv_connector_extra_config['remote_deadline_s'] must be a "
                                 f"positive number of seconds, got {deadline!r}")
            kw["remote_deadline_s"] = float(deadline)
        for name in ("namespace", "model_id"):
            v = extra.get(name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"kv_connector_extra_config[{name!r}] must be a non-empty "
                                 f"str, got {v!r}")
            kw[name] = v
        for name, default in (("save", True), ("lossy_ok", False)):
            v = extra.get(name, default)
            if not isinstance(v, bool):
                raise TypeError(f"kv_connector_extra_config[{name!r}] must be a bool, got "
                                f"{v!r}")
            kw[name] = v
        policy = extra.get("kv_load_failure_policy")
        if policy is not None and policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_connector_extra_config['kv_load_failure_policy'] must be one "
                             f"of {list(LOAD_FAILURE_POLICIES)}, got {policy!r}")
        kw["kv_load_failure_policy"] = policy
        kw.update(_grace(extra))
        lossy = sorted(t for t, c in (kw.get("codecs") or {}).items() if is_lossy(c))
        if lossy and not kw["lossy_ok"]:
            raise ValueError(
                f"kv_connector_extra_config['codecs'] names the lossy codec "
                f"{kw['codecs'][lossy[0]]!r} for {lossy[0]!r}: KV served through it is not the "
                f"KV vLLM computes, and answers change; set 'lossy_ok': true to accept that")
        return cls(**kw, extra=MappingProxyType(dict(extra)))

    @property
    def wait_deadline_s(self) -> float:
        """A consumer's wait for a producer's KV when a request names no ``deadline_s``."""
        return self.remote_deadline_s if self.remote_deadline_s is not None \
            else DEFAULT_DEADLINE_S

    def open_options(self, *, block_size: int, fill: bool = True) -> dict[str, object]:
        """Keyword arguments of :func:`kvstore.open` (without the layout). ``fill=False`` (a
        ``kv_consumer``): what the shared tiers serve is not stored locally (their
        ``fill="none"``: nothing is written into the directory)."""
        opts: dict[str, object] = {name: getattr(self, name) for name in SIZE_KEYS
                                   if getattr(self, name) is not None}
        if self.policy is not None:
            opts["policy"] = self.policy
        if self.codecs is not None:
            opts["codecs"] = self.codecs
        shared: dict[str, object] = {} if fill else {"fill": "none"}
        if self.remote_deadline_s is not None:
            shared["deadline_s"] = self.remote_deadline_s
        if self.remote is not None and shared:
            opts["remote"] = RemoteConfig(urls=self.remote, **shared)
        elif self.remote is not None:
            opts["remote"] = list(self.remote) if isinstance(self.remote, tuple) \
                else self.remote
        if self.objects is not None and shared:
            opts["objects"] = ObjectsConfig(url=self.objects, **shared)
        elif self.objects is not None:
            opts["objects"] = self.objects
        if self.chunk_tokens is not None and self.chunk_tokens % block_size:
            raise ValueError(f"kv_connector_extra_config['chunk_tokens'] must be a multiple of "
                             f"vLLM's block size {block_size}, got {self.chunk_tokens}")
        if not os.path.isdir(os.path.join(self.store_dir, "catalog")):
            opts["chunk_tokens"] = self.chunk_tokens or block_size  # only a new store takes it
        return opts


def _grace(extra: Mapping[str, object]) -> dict[str, object]:
    """``boundary_grace_s`` (a finite number >= 0) and ``boundary_grace_bytes`` (an int >= 0),
    checked."""
    out: dict[str, object] = {}
    secs = extra.get("boundary_grace_s")
    if secs is not None:
        if isinstance(secs, bool) or not isinstance(secs, int | float) \
                or not 0 <= secs < float("inf"):
            raise ValueError(f"kv_connector_extra_config['boundary_grace_s'] must be a number "
                             f"of seconds >= 0, got {secs!r}")
        out["boundary_grace_s"] = float(secs)
    out["boundary_grace_bytes"] = _positive(extra, "boundary_grace_bytes", minimum=0)
    return out


def _positive(extra: Mapping[str, object], name: str, minimum: int = 1) -> int | None:
    v = extra.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"kv_connector_extra_config[{name!r}] must be an int >= {minimum}, "
                         f"got {v!r}")
    return v
