"""A kvstore-backed HF transformers Cache: reuse stored KV with an unmodified HF model.

``create_session(store, layout, ids)`` finds the longest stored prefix of ``ids``, loads its KV
and returns ``(session, rest)``: ``session`` is a :class:`KVSession`, a subclass of HF's
``DynamicCache`` pre-filled with that prefix, and ``rest`` the ids still to run::

    session, rest = engine.create_session(store, model.layout, ids)
    out = hf_model(torch.tensor([rest]), past_key_values=session)   # positions follow the cache
    session.store()                                                 # persist ids' KV for reuse

The store keeps keys *without* rotary encoding; HF caches them *after* it. Loading applies RoPE at
positions 0..n-1 (:func:`kvstore.rope.apply_rope`) and casts to the HF model's dtype; storing
removes it at 0..T-1 and rounds to the layout dtype. Both are float32 arithmetic, so fp16 keys
loaded and stored again come back unchanged but for a few tiny entries (measured: 99.998% of
entries bit-identical over 2048 positions, the rest within 2e-6); tests/engine/test_hf_cache.py
states the measured bounds against HF and our own model.

With ``hf_model.generate`` pass the *full* ids (cached prefix + rest) as ``input_ids``: HF's
generate (transformers v5) drops the first ``session.get_seq_length()`` of them itself (it
slices ``input_ids[:, -(len - cached):]`` when the attention mask, implicit or given, spans all of
``input_ids``). Passing only ``rest`` works too if ``attention_mask`` covers prefix + rest.

Transformers v5 note: a v5 ``Cache`` is a list of per-layer objects (``DynamicLayer``) holding
``keys``/``values`` of shape [batch, kv_heads, T, head_dim]; sequence length, mask sizes and
positions are all derived from the layers, so a cache pre-filled through ``DynamicLayer.update``
is indistinguishable from one HF filled itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

import kvstore
from kvstore.format.hashing import as_tokens
from kvstore.layout import KVLayout
from kvstore.rope import apply_rope, remove_rope

__all__ = ["KVSession", "create_session"]


def _ids_list(ids: object, name: str = "ids") -> list[int]:
    """Validated token ids as a list of Python ints (ValueError if empty, TypeError if not ints)."""
    return [int(t) for t in as_tokens(ids, name=name).tolist()]


class KVSession(DynamicCache):
    """A ``DynamicCache`` whose context comes from, and goes back to, a kvstore ``Store``.

    Use it as ``past_key_values`` of an HF causal LM (a drop-in for ``DynamicCache``; batch size
    1). Keys held here are post-RoPE in the HF model's dtype, as HF expects.

    Attributes: ``ids`` (the token ids the session covers: the ids given at creation, replaced by
    the ids passed to a successful :meth:`store`), ``reused_tokens`` (length of the prefix loaded
    from the store), ``namespace``. The next position HF will use is ``get_seq_length()``.

    Thread-safety: not thread-safe, like ``DynamicCache`` — one thread (one HF forward or
    ``generate``) at a time. :meth:`store` only calls the thread-safe ``Store.put``, so sessions of
    the same store may be used from different threads.
    """

    def __init__(self, store: kvstore.Store, layout: KVLayout, ids: Sequence[int], *,
                 reused: int, keys: torch.Tensor | None, values: torch.Tensor | None,
                 namespace: str | None, dtype: torch.dtype, device: torch.device | str) -> None:
        """Internal: use :func:`create_session`. ``keys``/``values``: [L, H, reused, D] pre-RoPE
        (None when ``reused`` is 0)."""
        if reused:
            assert keys is not None and values is not None
            k = apply_rope(keys.to(device=device), 0, layout).to(dtype)  # [L, H, n, D] post-RoPE
            v = values.to(device=device, dtype=dtype)  # [L, H, n, D]
            # one (k, v) per layer, [1, H, n, D] each: DynamicCache fills one DynamicLayer per entry
            super().__init__([(k[i : i + 1], v[i : i + 1]) for i in range(layout.num_layers)])
        else:
            super().__init__()
            self.layers = [DynamicLayer() for _ in range(layout.num_layers)]
            self.layer_class_to_replicate = None
        self._kv_store = store
        self.layout = layout
        self.namespace = namespace
        self.reused_tokens = int(reused)
        self._ids = list(ids)
        self._prefix = self._ids[:reused]

    @property
    def ids(self) -> list[int]:
        """The token ids this session covers (a copy)."""
        return list(self._ids)

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached (keys post-RoPE, values), each [L, H, T, D] in the cache's dtype/device."""
        if len(self.layers) != self.layout.num_layers:
            raise ValueError(
                f"the cache has {len(self.layers)} layers but the layout has "
                f"{self.layout.num_layers}; was it used with another model?"
            )
        T = self.get_seq_length()
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            if layer.get_seq_length() != T:
                raise ValueError(f"cache layer {i} holds {layer.get_seq_length()} tokens, "
                                 f"layer 0 holds {T}")
            k, v = layer.keys, layer.values  # [B, H, T, D] each
            if k.shape[0] != 1:
                raise ValueError(f"only batch size 1 can be stored, the cache has {k.shape[0]}")
            want = (1, self.layout.num_kv_heads, T, self.layout.head_dim)
            if tuple(k.shape) != want or tuple(v.shape) != want:
                raise ValueError(f"cache layer {i}: expected keys/values {want}, got "
                                 f"{tuple(k.shape)} and {tuple(v.shape)}")
            ks.append(k[0])
            vs.append(v[0])
        return torch.stack(ks), torch.stack(vs)  # [L, H, T, D] each

    def store(self, ids: Sequence[int] | None = None) -> int:
        """Persist the cached context: ``store.put(ids, keys, values, namespace)``.

        Keys are un-rotated (RoPE removed at positions 0..T-1) and keys/values rounded to the
        layout dtype. ``ids`` defaults to the session's ``ids`` and must then cover exactly the
        cached tokens; after generation (the cache holds more tokens) pass the full ids, whose
        length must equal ``get_seq_length()`` and which must start with the reused prefix.
        Returns the number of tokens stored: 0 if the store's eviction policy refused them
        (admission, ``policy="reuse"``). Thread-safe with respect to the store.
        """
        T = self.get_seq_length()
        if T == 0:
            raise ValueError("the session is empty: run the model on it before store()")
        if ids is None:
            if len(self._ids) != T:
                raise ValueError(
                    f"the cache holds {T} tokens but the session knows {len(self._ids)} ids; "
                    f"pass ids= with the {T} ids the cache covers (e.g. prompt + generated "
                    f"tokens fed back)"
                )
            toks = self._ids
        else:
            toks = _ids_list(ids)
            if len(toks) != T:
                raise ValueError(f"ids has {len(toks)} tokens but the cache holds {T}; pass the "
                                 f"ids of exactly the cached tokens")
            if toks[: self.reused_tokens] != self._prefix:
                raise ValueError("ids do not start with the prefix this session loaded from the "
                                 "store")
        k, v = self._stacked()  # [L, H, T, D] each, post-RoPE keys
        dt = self.layout.torch_dtype
        keys = remove_rope(k.detach(), 0, self.layout).to(device="cpu", dtype=dt)  # [L, H, T, D]
        values = v.detach().to(device="cpu", dtype=dt)  # [L, H, T, D]
        stored = self._kv_store.put(toks, keys, values, namespace=self.namespace)
        self._ids = list(toks)
        return T if stored else 0

    def __repr__(self) -> str:
        return (f"KVSession(tokens={self.get_seq_length()}, reused={self.reused_tokens}, "
                f"ids={len(self._ids)}, namespace={self.namespace!r})")


def create_session(store: kvstore.Store, layout: KVLayout, ids: Sequence[int], *,
                   namespace: str | None = None, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> tuple[KVSession, list[int]]:
    """Start an HF cache for ``ids`` from the longest prefix ``store`` holds.

    Reuses n = min(store.match(ids), len(ids) - 1) tokens (at least one is left for the model to
    run) and returns ``(session, rest)`` with ``rest = ids[n:]`` as a list of ints. The session's
    keys are post-RoPE at positions 0..n-1 in ``dtype`` (the HF model's dtype) on ``device``.

    Raises :class:`kvstore.LayoutMismatch` if the store's layout is not ``layout``, ValueError for
    empty ``ids``, TypeError for non-integer ids. Thread-safe (the store is; the returned session
    is not, see :class:`KVSession`).
    """
    if not isinstance(layout, KVLayout):
        raise TypeError(f"layout must be a kvstore.KVLayout, got {type(layout).__name__}")
    if store.layout != layout:
        raise kvstore.LayoutMismatch(
            f"store layout {store.layout} does not match the given layout {layout}"
        )
    layout.require_plain("the HF Cache adapter (create_session)")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    toks = _ids_list(ids)
    n, keys, values = 0, None, None
    for _ in range(2):  # a second try if the prefix was evicted or found corrupt meanwhile
        store.wait_saved(toks, namespace=namespace)  # a pending asynchronous save may serve it
        n = min(store.match(toks, namespace=namespace), len(toks) - 1)
        if n <= 0:
            n = 0
            break
        try:
            keys, values = store.get(toks[:n], namespace=namespace,  # [L, H, n, D] pre-RoPE
                                     device=device)
            break
        except (KeyError, kvstore.CorruptData):
            n, keys, values = 0, None, None  # corrupt data is dropped by get: match shrinks
    session = KVSession(store, layout, toks, reused=n, keys=keys, values=values,
                        namespace=namespace, dtype=dtype, device=device)
    return session, toks[n:]
