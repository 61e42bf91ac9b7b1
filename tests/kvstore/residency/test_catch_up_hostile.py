"""A chunk record another process commits is untrusted input too: catching up with the
catalog must not mirror one that claims more tokens than a chunk holds or a slot beyond the
disk budget (a full reload's recovery plan drops them; the incremental catch-up now does the
same), so no read or DRAM copy is ever sized from it."""

import subprocess
import sys
import textwrap

import numpy as np

from tests.support.kvgen import put_causal

FORGE = textwrap.dedent("""
    import sys, numpy as np
    from kvstore.format.catalog import Catalog
    from kvstore.format.directory import Dir
    from kvstore.format.records import ChunkRecord
    root = Dir.open_root(sys.argv[1], create=False)
    cat = Catalog(root, readonly=False, walk=False, joining=False)
    n, slot = int(sys.argv[2]), int(sys.argv[3])
    with cat.write() as txn:
        txn.put_chunk(ChunkRecord(bytes([7]) * 16, bytes(16), n, slot, txn.next_gen,
                                  np.zeros(2, dtype=np.uint64),
                                  np.arange(n, dtype=np.uint32)))
    cat.close()
""")


def test_a_forged_chunk_record_is_not_mirrored(open_small, tmp_path):
    s = open_small("s")
    t = list(range(10))
    put_causal(s, t)
    for n, slot in ((4 * 1000, 5), (4, 10 ** 6)):  # too many tokens; a slot past the budget
        r = subprocess.run([sys.executable, "-c", FORGE, str(tmp_path / "s"), str(n), str(slot)],
                           capture_output=True, text=True, env=None, timeout=120)
        assert r.returncode == 0, r.stderr
        assert s.match(t) == len(t)  # catches up; the forged record is not mirrored
        assert bytes([7]) * 16 not in s._core.tree.chunks
    k, v = s.get(t)
    assert k.shape[2] == len(t) and np.isfinite(k.float().numpy()).all()
