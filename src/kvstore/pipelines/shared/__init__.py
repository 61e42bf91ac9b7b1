"""What a store does with its shared tiers (Redis, an object store; :mod:`kvstore.tiers.shared`):
:mod:`~kvstore.pipelines.shared.tiers` (``SharedTier``, the protocol the store iterates, and
``SharedTiers``), :mod:`~kvstore.pipelines.shared.link` (``RemoteLink``: a tier of chunk values
as a ``SharedTier``: match, get, fills, write-through, prefetch, stats),
:mod:`~kvstore.pipelines.shared.loads` (layer-wise loads),
:mod:`~kvstore.pipelines.shared.found` (what a match found, for the load that follows),
:mod:`~kvstore.pipelines.shared.boundaries` (a hybrid layout's boundary states).
"""
