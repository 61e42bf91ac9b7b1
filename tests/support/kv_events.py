"""KV events for tests: a model a stream is replayed into, the brute-force oracle of which
blocks a store holds, and a real ZMQ subscriber (with replay) of vLLM's protocol.

The oracle recomputes vLLM's block hashes from scratch: for every chunk record it rebuilds the
whole token prefix (walking parent keys up to a namespace's chain seed) and hashes it from its
first block with ``hashlib.sha256(cbor2.dumps(..., canonical=True))``, exactly vLLM's
``sha256_cbor`` chained as ``hash_block_tokens`` chains it; it shares no code with
:mod:`kvstore.events`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable

import cbor2
import msgspec
import zmq

from kvstore.format.hashing import chain_seed

NONE_SEED = "vllm-none-hash"
STATE_OR_PAD = 2**32 - 2  # token ids from here on are no prompt's


def sha256_cbor(value) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def as_int(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


def prompt_hashes(tokens, block_size: int, namespace: str | None = None,
                  seed: str = NONE_SEED) -> list[bytes]:
    """vLLM's hashes of every whole block of ``tokens`` (``cache_salt=namespace``)."""
    parent = sha256_cbor(seed)
    out = []
    for i in range(0, len(tokens) // block_size * block_size, block_size):
        extra = (("cache_salt", namespace),) if namespace is not None and i == 0 else None
        parent = sha256_cbor((parent, tuple(int(t) for t in tokens[i:i + block_size]), extra))
        out.append(parent)
    return out


def chunk_prefixes(records, fingerprint: bytes, namespaces: Iterable[str | None]
                   ) -> dict[bytes, tuple[list[int], str | None, int]]:
    """For each chunk record: (the tokens of its whole prefix up to its end, its namespace,
    where it starts); chunks of a namespace not in ``namespaces`` are left out."""
    by_key = {r.key: r for r in records}
    seeds = {chain_seed(fingerprint, ns): ns for ns in namespaces}
    out = {}
    for rec in records:
        chain, k = [], rec.key
        while k in by_key:
            chain.append(by_key[k])
            k = by_key[k].parent
        if k not in seeds:
            continue
        toks = [int(t) for r in reversed(chain) for t in r.tokens]
        out[rec.key] = (toks, seeds[k], len(toks) - rec.n_tokens)
    return out


def held_blocks(records, keys, fingerprint: bytes, block_size: int,
                namespaces: Iterable[str | None] = (None,), seed: str = NONE_SEED) -> set[int]:
    """The vLLM block hashes (ints) of the whole blocks of the chunks ``keys`` (of
    ``records``): blocks of real tokens only (none from a PAD or STATE token on); ``seed``:
    vLLM's NONE_HASH seed (its default, or the engine's ``PYTHONHASHSEED``)."""
    prefixes = chunk_prefixes(records, fingerprint, namespaces)
    out: set[int] = set()
    for key in keys:
        if key not in prefixes:
            continue
        toks, ns, start = prefixes[key]
        real = next((i for i, t in enumerate(toks) if t >= STATE_OR_PAD), len(toks))
        hashes = prompt_hashes(toks[:real], block_size, ns, seed)
        out.update(as_int(h) for h in hashes[start // block_size:])
    return out


class MediaModel:
    """A subscriber's view: the blocks of each medium, from the events replayed into it.
    ``check`` verifies each ``BlockStored`` is self-consistent the way a router that hashes
    token ids (Dynamo) uses it: its hashes chain from its parent over its token ids."""

    def __init__(self, *, check_chain: bool = True) -> None:
        self.media: dict[str, set[int]] = {}
        self.check_chain = check_chain
        self.stored = self.removed = self.cleared = 0

    def apply(self, events) -> None:
        for ev in events:
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                self.media.clear()
                self.cleared += 1
            elif kind == "BlockStored":
                assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes), ev
                self.media.setdefault(ev.medium, set()).update(ev.block_hashes)
                self.stored += 1
            elif kind == "BlockRemoved":
                have = self.media.setdefault(ev.medium, set())
                missing = set(ev.block_hashes) - have
                assert not missing, f"{ev.medium}: removed blocks never stored: {missing}"
                have.difference_update(ev.block_hashes)
                self.removed += 1

    def blocks(self, medium: str) -> set[int]:
        return set(self.media.get(medium, ()))


def chain_ok(ev, parents: dict[int, bytes], seed: str = NONE_SEED) -> bool:
    """Whether ``ev``'s int hashes are the last 8 bytes of vLLM's hashes chained over its
    token ids from its parent (``parents``: int hash -> full digest of blocks seen so far;
    extended with ``ev``'s)."""
    if ev.parent_block_hash is None:
        parent = sha256_cbor(seed)
    elif ev.parent_block_hash in parents:
        parent = parents[ev.parent_block_hash]
    else:
        return True  # a parent this subscriber never saw (another tier's): not checkable
    B = ev.block_size
    for i, h in enumerate(ev.block_hashes):
        extra = None
        if ev.parent_block_hash is None and i == 0 and ev.extra_keys and ev.extra_keys[0]:
            extra = (("cache_salt", ev.extra_keys[0][0]),)
        parent = sha256_cbor((parent, tuple(ev.token_ids[i * B:(i + 1) * B]), extra))
        if as_int(parent) != h:
            return False
        parents[h] = parent
    return True


class Subscriber:
    """A real ZMQ SUB socket on ``endpoint`` (and a REQ on ``replay``), decoding with
    ``decoder`` (a msgspec decoder of vLLM's ``KVEventBatch``: kvstore's or vLLM's own)."""

    def __init__(self, endpoint: str, *, replay: str | None = None, topic: bytes = b"",
                 batch_type=None) -> None:
        if batch_type is None:
            from kvstore.events.records import KVEventBatch as batch_type
        self.decoder = msgspec.msgpack.Decoder(batch_type)
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.replay_endpoint = replay
        self.batches: list[tuple[int, object]] = []  # (seq, batch) in arrival order

    def poll(self, timeout_s: float) -> int:
        """Receive what arrives within ``timeout_s`` (stops early once quiet for 0.3 s after
        something came); returns how many batches came."""
        n = 0
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            wait = 300 if n else max(1, int((end - time.monotonic()) * 1000))
            if not self.sub.poll(wait):
                if n:
                    break
                continue
            _topic, seq, payload = self.sub.recv_multipart()
            self.batches.append((int.from_bytes(seq, "big"), self.decoder.decode(payload)))
            n += 1
        return n

    def wait_for(self, predicate, timeout_s: float = 30.0) -> None:
        """Receive until ``predicate()`` holds (AssertionError after ``timeout_s``)."""
        end = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < end, "the events expected did not arrive in time"
            self.poll(min(1.0, end - time.monotonic()))

    def replay(self, start: int, timeout_s: float = 10.0) -> list[tuple[int, object]]:
        """Ask the replay socket for every batch from ``start`` on (a DEALER: the ROUTER
        answers one request with many messages, which a REQ socket would refuse)."""
        req = self.ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.replay_endpoint)
        try:
            req.send_multipart((b"", start.to_bytes(8, "big")))
            out = []
            while True:
                assert req.poll(int(timeout_s * 1000)), "no answer from the replay socket"
                _empty, _topic, seq, payload = req.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    return out
                out.append((int.from_bytes(seq, "big"), self.decoder.decode(payload)))
        finally:
            req.close()

    def events(self):
        return [ev for _, b in self.batches for ev in b.events]

    def close(self) -> None:
        self.sub.close()
        self.ctx.term()
