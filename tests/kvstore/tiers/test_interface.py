"""The one tier interface, :class:`kvstore.tiers.interface.ChunkTier`: what it takes to be a
tier (a name, a thread-safety, stats, an end), checked on real tiers (the DRAM tier's slab, a
store's segment files, a Redis tier built from its config); the conformance machine
(``test_tier_conformance.py``) checks every tier of open stores, the object tier's too."""

import numpy as np

from kvstore.eviction.policies import make_policy
from kvstore.format.directory import Dir
from kvstore.tiers.disk import SegmentFiles, SegmentGeometry
from kvstore.tiers.dram import DramTier
from kvstore.tiers.interface import ChunkTier
from kvstore.tiers.remote import RemoteConfig, RemoteTier
from tests.support.kvgen import SMALL


class NoEnd:
    tier_name = "dram"
    thread_safe = False

    def stats(self) -> dict[str, object]:
        return {}


def test_an_object_without_every_member_is_no_tier():
    assert not isinstance(NoEnd(), ChunkTier)
    assert not isinstance(object(), ChunkTier)


def test_the_dram_tier_reports_what_it_holds():
    dram = DramTier(capacity_bytes=4 * 4096, slot_bytes=4096, policy=make_policy("lru"))
    assert isinstance(dram, ChunkTier) and dram.tier_name == "dram" and not dram.thread_safe
    e = dram.insert(b"k" * 16, 1, 1000, 0)
    assert dram.stats()["chunks"] == 0  # pending: not servable yet
    dram.finish(e, ok=True)
    assert dram.stats() == {"chunks": 1, "bytes_used": 1000, "capacity_bytes": 4 * 4096,
                            "slots": 4, "evictions": 0, "pinned": False}
    dram.close()
    dram.close()  # idempotent


def test_the_disk_tier_reports_its_geometry(tmp_path):
    root = Dir.open_root(str(tmp_path), create=False)
    geo = SegmentGeometry.for_budget(slot_bytes=4096, disk_bytes=1 << 20, segment_bytes=1 << 18)
    files = SegmentFiles(root, geo, readonly=False)
    try:
        assert isinstance(files, ChunkTier) and files.tier_name == "disk" and files.thread_safe
        files.ensure_ready([0])
        files.write(0, [np.zeros(4096, np.uint8)])
        got = files.stats()
        assert got["slots"] == geo.total_slots and got["open_segments"] == 1
    finally:
        files.close()
        root.close()


def test_the_redis_tier_is_a_tier_before_it_connects():
    redis = RemoteTier(RemoteConfig(urls=("redis://127.0.0.1:1",)), SMALL)
    assert isinstance(redis, ChunkTier) and redis.tier_name == "remote" and redis.thread_safe
    assert redis.stats()["written_chunks"] == 0
    redis.close()
