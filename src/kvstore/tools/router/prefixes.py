"""What the router remembers of the prompts it sent each server: the chained hashes of their
blocks (128 characters of text, or 32 token ids), the store's own addressing at the router's
scale. A new prompt's leading blocks found there are the part the server likely holds already
(its prefix cache, or the store it shares): the router counts only the rest as work. An
estimate: a server may have evicted what the router remembers, or hold what another router
sent. Bounded (least recently used blocks forgotten first). Not thread-safe: the router's
state holds it under its lock."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

TEXT_BLOCK = 128  # characters
IDS_BLOCK = 32  # token ids


def blocks(prompt: str | Sequence[int]) -> list[bytes]:
    """The chained hashes of ``prompt``'s whole blocks, in order."""
    if isinstance(prompt, str):
        size = TEXT_BLOCK
        parts = [prompt[i:i + size].encode("utf-8", "surrogatepass")
                 for i in range(0, len(prompt) - size + 1, size)]
    else:
        size = IDS_BLOCK
        parts = [b",".join(str(int(t)).encode() for t in prompt[i:i + size])
                 for i in range(0, len(prompt) - size + 1, size)]
    out, h = [], b"text" if isinstance(prompt, str) else b"ids"
    for p in parts:
        h = hashlib.blake2b(h + p, digest_size=16).digest()
        out.append(h)
    return out


class PrefixMemory:
    """Chained block hashes of the prompts sent to one server (at most ``capacity``)."""

    def __init__(self, capacity: int = 65536) -> None:
        if type(capacity) is not int or capacity <= 0:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def held(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` were remembered (and refreshes them)."""
        n = 0
        for h in hashes:
            if h not in self._seen:
                break
            self._seen.move_to_end(h)
            n += 1
        return n

    def remember(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def __len__(self) -> int:
        return len(self._seen)
