"""Error classes. Every failure of the store is a subclass of :class:`KVStoreError`."""


class KVStoreError(Exception):
    """Base class of every error the store raises (argument misuse raises ValueError/TypeError)."""


class LayoutMismatch(KVStoreError):
    """The store was created for another KVLayout (or chunk size) than the one given."""


class StoreLocked(KVStoreError):
    """The store cannot be opened in the mode asked: ``exclusive=True`` while another process
    has it open, any open while an exclusive opener has it, or a second open in one process."""


class CorruptData(KVStoreError):
    """Stored bytes failed their checksum, or a file is missing or truncated."""


class StoreTampered(CorruptData):
    """A file the store's live processes rely on was deleted, renamed or replaced under them
    (the catalog's lock file, a segment file): the store refuses to go on through it rather
    than lose data. Nothing committed was changed; close every process of the store (then the
    next opener, alone, rebuilds what is missing) or put the file back."""


class CapacityError(KVStoreError):
    """The data cannot fit the store's configured capacity."""


class PinRefused(CapacityError):
    """A pin (``Store.pin``) that cannot fit: the context, or the namespace's pins with it, or
    every namespace's pins with it, would take more of the disk tier than the store's caps
    allow (``pin_namespace_fraction``, ``pin_total_fraction``). Nothing was pinned; the
    message says which cap and by how much."""


class StoreClosed(KVStoreError):
    """The store was used after close()."""


class FormatError(KVStoreError):
    """The store directory has an unknown format version or unreadable metadata."""


class UnsafePath(KVStoreError):
    """A symlink, or something else that is not the store's own regular file or directory,
    sits where the store expects one of its files; the store refuses to use it (it never
    follows a link out of the store directory)."""


class RotatedKeys(KVStoreError, ValueError):
    """A feature that re-positions keys (truncation, RoPE at other positions, per-head indexes,
    the runtime's sessions) was asked of a layout whose keys are stored rotated, as an engine
    holds them (``KVLayout(keys="rotated")``)."""


class HybridLayers(KVStoreError, ValueError):
    """A feature that needs the KV of every token in every layer (truncation, re-positioning,
    per-head indexes, the runtime's sessions) was asked of a layout with sliding-window or
    recurrent layers (``KVLayout(layers=...)``), whose state exists only at stored
    boundaries."""


class StoreForked(KVStoreError):
    """A store opened in one process was used in a child it forked (``os.fork``, the default
    start method of ``multiprocessing`` on Linux): its threads, locks and catalog do not cross
    a fork. Open the store again in the child."""
