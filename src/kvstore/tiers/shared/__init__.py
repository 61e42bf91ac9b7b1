"""What both shared tiers are made of (Redis, :mod:`kvstore.tiers.remote`; an S3-compatible
object store, :mod:`kvstore.tiers.objects`): tiers of verified chunk values by chain key that
stores on other machines share.

:mod:`~kvstore.tiers.shared.chunk_server` (``ChunkServer``, the calls both answer),
:mod:`~kvstore.tiers.shared.value` (the checksummed value format every reader checks),
:mod:`~kvstore.tiers.shared.marks` (a hybrid boundary's mark),
:mod:`~kvstore.tiers.shared.deadline` (each public call's deadline, each round trip's budget),
:mod:`~kvstore.tiers.shared.breaker` (circuit breakers),
:mod:`~kvstore.tiers.shared.estimate` (the link's latency and bandwidth; fetch only when it
pays), :mod:`~kvstore.tiers.shared.options` (the options both configs check alike). The store
reaches either through :mod:`kvstore.pipelines.shared` (reads, write-through, prefetch).
"""
