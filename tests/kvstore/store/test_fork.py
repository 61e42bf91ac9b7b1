"""A store opened before ``fork()`` (Linux's default ``multiprocessing`` start method): the
child's copy refuses every call with an error that names the remedy, at once (before, a put
in the child waited for ever for a helper thread the fork did not copy, and left its slot
reservation behind), and the child may open the store again and use it as any process."""

from __future__ import annotations

import multiprocessing as mp

import kvstore
from kvstore.tools.verify import verify_store
from tests.support.kvgen import SMALL, causal_kv, put_causal


def _child(path: str, store: kvstore.Store, out) -> None:
    k, v = causal_kv(SMALL, [7, 8, 9])
    errors = []
    for call in (lambda: store.put([7, 8, 9], k, v), lambda: store.match([1, 2]),
                 lambda: store.get([1, 2]), lambda: store.flush()):
        try:
            call()
        except kvstore.StoreForked as e:
            errors.append(str(e))
    with kvstore.open(path) as again:  # its own, while the parent's copy is "open" here
        put_causal(again, [7, 8, 9])
        out.send((errors, again.match([1, 2, 3, 4]), again.match([7, 8, 9])))
    store.close()  # the parent's copy: marked closed, nothing of the parent's touched


def test_a_store_used_in_a_forked_child_refuses_at_once_and_opens_again(tmp_path):
    path = str(tmp_path / "s")
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=64 * 4096) as store:
        put_causal(store, [1, 2, 3, 4])
        parent, child = mp.get_context("fork").Pipe()
        p = mp.get_context("fork").Process(target=_child, args=(path, store, child))
        p.start()
        assert parent.poll(60), "the child hangs"
        errors, own, new = parent.recv()
        p.join(30)
        assert p.exitcode == 0
        assert len(errors) == 4 and "open it again here" in errors[0] and path in errors[0]
        assert (own, new) == (4, 3)
        # the parent's store still works, sees the child's put, and holds no reservation
        assert store.match([7, 8, 9]) == 3 and store.get([1, 2])[0].shape[2] == 2
        put_causal(store, [5, 6])
        report = verify_store(store)
        assert report["ok"], report
        with store._core.catalog.read() as txn:
            assert txn.reservations() == []
