"""The options both shared tiers' configs take alike (:class:`kvstore.tiers.remote.config.
RemoteConfig`, :class:`kvstore.tiers.objects.config.ObjectsConfig`), and their one check."""

from __future__ import annotations

import math

from kvstore.tiers.shared.value import CODEC_IDS

FILL_MODES = ("disk", "none")


def check_link_options(cfg: object, *, seconds: tuple[str, ...], counts: tuple[str, ...]
                       ) -> None:
    """The checks a shared tier's config shares (Redis's, the object store's): ``seconds``
    positive and finite, ``counts`` ints >= 1, ``fill``, ``write_through`` and ``codec``."""
    for name in seconds:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                or v <= 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
    for name in counts:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    fill, write_through, codec = (getattr(cfg, n) for n in ("fill", "write_through", "codec"))
    if fill not in FILL_MODES:
        raise ValueError(f"fill must be one of {FILL_MODES}, got {fill!r}")
    if not isinstance(write_through, bool):
        raise TypeError(f"write_through must be a bool, got {type(write_through)}")
    if codec not in CODEC_IDS:
        raise ValueError(f"codec must be one of {sorted(CODEC_IDS)}, got {codec!r}")
