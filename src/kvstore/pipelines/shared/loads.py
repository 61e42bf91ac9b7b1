"""Layer-wise loads of a context that extends past the local tiers into a shared tier (Redis,
an object store): the part of :class:`kvstore.pipelines.shared.link.RemoteLink` behind
``Store.load_layers``. The local prefix is read at once; the shared tier's chunks by ranged
reads of growing groups of layers (1, 2, 4, ...:
:func:`~kvstore.pipelines.layer_load.layer_groups`), each chunk's layer verified and placed
where it goes as it arrives, into a CPU buffer or an engine's pages.

Thread-safety: as the link's (every method from any thread; the load's own loader thread
fetches the later layers by the deadline of the call that started it).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvstore.format import chunk_extent
from kvstore.pipelines.layer_load import LayerLoad, layer_groups
from kvstore.pipelines.pages import Pages
from kvstore.pipelines.shared.addressing import Chunk
from kvstore.tiers.exec_buffers import HbmTier
from kvstore.tiers.shared.deadline import call_deadline


def check_block_starts(rest: list[Chunk], block_tokens: int) -> None:
    """ValueError unless every remote chunk of a load into pages starts on a block boundary
    and fills whole blocks."""
    for ch in rest:
        if ch.start % block_tokens or len(ch.tokens) % block_tokens:
            raise ValueError(f"a load into pages of {block_tokens}-token blocks needs the "
                             f"store's chunks on block boundaries (a chunk of "
                             f"{len(ch.tokens)} tokens at {ch.start})")


class LayerLoads:
    """The layer-wise loads of :class:`~kvstore.pipelines.shared.link.RemoteLink` (a mixin: it uses
    the link's ``core``, ``tier``, ``found``, ``get``, ``_local``, ``_rest``, ``_items``,
    ``_kid``, ``local``, ``_count`` and ``_served_lossy``)."""

    def layer_load(self, toks: np.ndarray, namespace: str | None, *, start: int,
                   buffer_layers: int | None, out: tuple[torch.Tensor, torch.Tensor] | None,
                   device: torch.device, hbm: Callable[[torch.device], HbmTier],
                   pages: Pages | None = None) -> LayerLoad:
        """``Store.load_layers`` of tokens that extend past the local tiers into the remote
        one: into ``out``, ``pages`` or an execution buffer of ``hbm(device)`` on the CPU,
        layer by layer (:meth:`load_layers`); to a CUDA device through host memory at once.
        With ``start`` (positions [start, n) only) the chunks holding them are fetched at once
        and the tail handed out as an already loaded load."""
        lay = self.core.layout
        if start:
            k, v = self._tail_kv(toks, namespace, start)  # [L, H, n - start, D] each
            if pages is not None:
                kr, vr = chunk_extent.raw(k), chunk_extent.raw(v)
                for layer in range(lay.num_layers):
                    pages.scatter(layer, 0, kr[layer], vr[layer])
                return LayerLoad(None, None, lambda layer: None, buffer_layers=buffer_layers,
                                 on_done=lambda: None, num_layers=lay.num_layers).start()
            if out is not None:
                out[0].copy_(k)
                out[1].copy_(v)
                k, v = out
            else:
                k, v = k.to(device).contiguous(), v.to(device).contiguous()
            return LayerLoad(k, v, lambda layer: None, buffer_layers=buffer_layers,
                             on_done=lambda: None).start()
        if out is not None or pages is not None:
            return self.load_layers(toks, namespace, buffer_layers=buffer_layers, kv=out,
                                    pages=pages, on_close=None)
        if device.type != "cpu":  # through host memory, then to the device at once
            k, v = self.get(toks, namespace, None, None)
            k, v = k.to(device), v.to(device)
            return LayerLoad(k, v, lambda layer: None, buffer_layers=buffer_layers,
                             on_done=lambda: None).start()
        tier = hbm(device)
        nbytes = self.core.raw_bytes(len(toks))
        buf = tier.acquire(nbytes)
        kv = buf.view(lay.torch_dtype).view(2, *lay.kv_shape(len(toks)))
        return self.load_layers(toks, namespace, buffer_layers=buffer_layers,
                                kv=(kv[0], kv[1]), on_close=lambda _after: tier.release(buf),
                                on_abandon=lambda: tier.forget(nbytes))

    def _tail_kv(self, toks: np.ndarray, namespace: str | None, start: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV of positions [start, n) of ``toks`` [L, H, n - start, D]: only the shared
        tier's chunks that hold them are fetched (all of ``toks`` when the local prefix reaches
        past ``start``); KeyError (a miss)."""
        base, rest = self._rest(toks, namespace, self._local(toks, namespace))
        if base > start:
            k, v = self.get(toks, namespace, None, None)  # [L, H, n, D] each
            return k[:, :, start:], v[:, :, start:]
        lay, n = self.core.layout, len(toks)
        need = [ch for ch in rest if ch.start + len(ch.tokens) > start]
        items = self._items(need)
        with self.tier.deadline():
            got = self.tier.values_and_headers(items)
            if got and got[-1] is None and all(g is not None for g in got[:-1]):
                kid = self._kid(need[-1])  # the tail inside a longer stored chunk
                if kid is not None:
                    items[-1], got[-1] = kid, self.tier.values_and_headers([kid])[0]
        if any(g is None for g in got):
            self._count("misses")
            raise KeyError(f"{sum(g is None for g in got)} of the {len(need)} chunks holding "
                           f"tokens {start}..{n} are not usable in the remote tier: a miss")
        k, v = chunk_extent.empty_kv(lay, n - start, 2)
        kr, vr = chunk_extent.raw(k), chunk_extent.raw(v)
        L, H, D = lay.num_layers, lay.num_kv_heads, lay.head_dim
        for ch, (_, t), (ext, _) in zip(need, items, got, strict=True):  # type: ignore[misc]
            x = np.asarray(ext).view(chunk_extent.int_dtype(lay)).reshape(L, 2, H, len(t), D)
            a, b = max(start, ch.start), ch.start + len(ch.tokens)
            kr[:, :, a - start:b - start] = x[:, 0, :, a - ch.start:b - ch.start]
            vr[:, :, a - start:b - start] = x[:, 1, :, a - ch.start:b - ch.start]
        self._count("gets")
        self._count("served_tokens", n - start)
        return k, v

    def load_layers(self, toks: np.ndarray, namespace: str | None, *,
                    buffer_layers: int | None, kv: tuple[torch.Tensor, torch.Tensor] | None,
                    on_close: Callable[[torch.cuda.Event | None], None] | None,
                    on_abandon: Callable[[], None] | None = None,
                    pages: Pages | None = None) -> LayerLoad:
        """A layer-wise load of ``toks`` into ``kv`` (CPU [L, H, T, D]) or ``pages``: the local
        prefix at once, the remote chunks by ``GETRANGE`` in growing groups of layers
        (:func:`~kvstore.pipelines.layer_load.layer_groups`), each chunk's layer placed where
        it goes as it arrives."""
        local = self._local(toks, namespace)
        base, rest = self._rest(toks, namespace, local)
        # one deadline for the whole load: its loader thread fetches the layers by it
        with self.tier.deadline() as expires:
            items = self._items(rest)
            headers = [self.found.header(k) for k, _ in items]  # what the match read
            ask = [i for i, h in enumerate(headers) if h is None]
            for i, h in zip(ask, self.tier.headers([items[i] for i in ask]) if ask else [],
                            strict=True):
                headers[i] = h
            keys = [k for k, _ in items]
            if headers and headers[-1] is None and all(h is not None for h in headers[:-1]):
                kid = self._kid(rest[-1])  # the tail inside a longer stored chunk
                if kid is not None:
                    keys[-1] = kid[0]
                    headers[-1] = self.found.header(kid[0]) or self.tier.headers([kid])[0]
        if any(h is None for h in headers):
            self._count("misses")
            if on_close is not None:
                on_close(None)
            raise KeyError(f"{sum(h is None for h in headers)} of the {len(rest)} chunks "
                           f"after the local prefix are not usable in the remote tier: a miss")
        lay = self.core.layout
        try:
            if pages is not None:
                if base:  # the local prefix through a buffer
                    k_loc, v_loc = chunk_extent.empty_kv(lay, base, 2)
                    self.local.read_into(toks[:base], namespace, (k_loc, v_loc))
                    kl, vl = chunk_extent.raw(k_loc), chunk_extent.raw(v_loc)
                    for layer in range(lay.num_layers):
                        pages.scatter(layer, 0, kl[layer], vl[layer])
                check_block_starts(rest, pages.block_tokens)
            else:
                assert kv is not None
                if base:
                    self.local.read_into(toks[:base], namespace, kv)
        except BaseException:
            if on_close is not None:
                on_close(None)
            raise
        kr = vr = None
        if kv is not None:
            kr, vr = chunk_extent.raw(kv[0]), chunk_extent.raw(kv[1])
        items = list(zip(keys, headers, strict=True))

        groups = layer_groups(lay.num_layers)
        fetched: dict[int, list[np.ndarray | None]] = {}

        def load_layer(layer: int) -> None:
            if layer not in fetched:  # the first layer of its group: fetch the group
                fetched.clear()
                with call_deadline(expires=expires):
                    fetched.update(self.tier.layers(items, groups[layer]))
            parts = fetched.pop(layer)
            for ch, part in zip(rest, parts, strict=True):
                if part is None:
                    self._count("misses")
                    raise KeyError(f"layer {layer} of chunk {ch.key.hex()} did not arrive from "
                                   f"the remote tier (lost, refused, or past the load's "
                                   f"deadline): a miss")
                n, use = len(part) // (lay.layer_token_bytes), len(ch.tokens)
                x = part.view(chunk_extent.int_dtype(lay)).reshape(
                    2, lay.num_kv_heads, n, lay.head_dim)
                if pages is not None:
                    pages.scatter(layer, ch.start // pages.block_tokens, x[0, :, :use],
                                  x[1, :, :use])
                    continue
                np.copyto(kr[layer, :, ch.start:ch.start + use], x[0, :, :use])
                np.copyto(vr[layer, :, ch.start:ch.start + use], x[1, :, :use])

        def done() -> None:
            self._count("gets")
            self._count("served_tokens", len(toks) - base)
            self._served_lossy(local, base, rest, headers)  # type: ignore[arg-type]

        k_out, v_out = (None, None) if kv is None else kv
        load = LayerLoad(k_out, v_out, load_layer, buffer_layers=buffer_layers, on_done=done,
                         on_close=on_close, on_abandon=on_abandon, num_layers=lay.num_layers)
        return load.start()

