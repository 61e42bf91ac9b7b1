"""kvstore: an embedded storage engine for LLM key/value caches."""

from kvstore.errors import (
    CapacityError,
    CorruptData,
    FormatError,
    HybridLayers,
    KVStoreError,
    LayoutMismatch,
    PinRefused,
    RotatedKeys,
    StoreClosed,
    StoreForked,
    StoreLocked,
    StoreTampered,
    UnsafePath,
)
from kvstore.layout import KVLayout, LayerKind, StateTensor

__all__ = [
    "KVLayout",
    "LayerKind",
    "StateTensor",
    "KVStoreError",
    "LayoutMismatch",
    "StoreLocked",
    "StoreTampered",
    "CorruptData",
    "CapacityError",
    "PinRefused",
    "StoreClosed",
    "StoreForked",
    "FormatError",
    "UnsafePath",
    "RotatedKeys",
    "HybridLayers",
]

from kvstore.config import StoreConfig  # noqa: E402
from kvstore.events.config import EventsConfig  # noqa: E402
from kvstore.eviction.jobs import Job  # noqa: E402
from kvstore.format.disk_throttle import ReadThrottle  # noqa: E402
from kvstore.format.records import PinRecord  # noqa: E402
from kvstore.pipelines.layer_load import LayerLoad  # noqa: E402
from kvstore.pipelines.pages import Pages  # noqa: E402
from kvstore.pipelines.saving import SaveHandle  # noqa: E402
from kvstore.residency.retention import ContextInfo  # noqa: E402
from kvstore.store.facade import Store  # noqa: E402
from kvstore.store.opening import open_store  # noqa: E402
from kvstore.tiers.objects import (  # noqa: E402
    ObjectsAuthError,
    ObjectsConfig,
    ObjectsSetupError,
    sweep_objects,
)
from kvstore.tiers.remote import RemoteAuthError, RemoteConfig, RemoteSetupError  # noqa: E402

open = open_store  # noqa: A001  (kvstore.open(path, ...) mirrors lmdb.open / sqlite3.connect)

__all__ += ["ObjectsAuthError", "ObjectsConfig", "ObjectsSetupError", "sweep_objects",
            "RemoteAuthError", "RemoteConfig", "RemoteSetupError", "EventsConfig", "Job",
            "LayerLoad", "Pages", "ReadThrottle", "SaveHandle", "Store", "PinRecord", "ContextInfo",
            "StoreConfig", "open", "open_store"]
