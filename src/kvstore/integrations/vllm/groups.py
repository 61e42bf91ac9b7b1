"""A hybrid model's KV-cache groups, as vLLM's hybrid KV-cache manager hands them to a
connector that declares ``SupportsHMA``, and the boundary state the store keeps for them.

vLLM (0.32.0) splits a hybrid model's layers into KV-cache groups of one spec each, every group
with its own block table over one shared block pool:

* **full attention** (``FullAttentionSpec``): a block per ``block_size`` tokens, every token
  kept. The store's chunks hold these layers' pages, as for a plain model.
* **sliding window** (``SlidingWindowSpec``): a query at position ``p`` reads keys
  ``p - W + 1 .. p``; blocks wholly before the window of the next token are freed (the null
  block). After ``n`` tokens only blocks ``(n - W + 1) // B .. (n - 1) // B`` matter.
* **recurrent** (``MambaSpec``: Mamba2, gated delta nets, short convolutions): one page per
  layer holds the state after the request's last computed token, in the block at index
  ``(n - 1) // B`` of its table (``mamba_cache_mode="align"``, with vLLM's prefix cache) or
  its first block (``"none"``). Registered as raw bytes ``[num_blocks, 1, 1, page]``.

The **boundary state** after ``n`` tokens (:mod:`kvstore.view.boundaries`) is, in group order,
each sliding layer's pages of those window blocks, then each recurrent layer's page: vLLM's own
bytes, moved as they are (:func:`state_size` says how long it is for ``n``; the worker refuses
any other length). Served only to a vLLM of the same groups, windows, modes and page sizes:
all of it is in the layout's ``engine`` and ``layers`` (the fingerprint).

Refused at startup, with the reason: specs other than these three (MLA, chunked local
attention, cross attention, sinks, ...), no full-attention group (nothing to key the store by),
speculative Mamba blocks, and full-attention groups of different block sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.layout import LayerKind, StateTensor

_TORCH_DTYPES = {"torch.float32": "float32", "torch.float16": "float16",
                 "torch.bfloat16": "bfloat16", "torch.int8": "int8", "torch.uint8": "uint8",
                 "torch.int32": "int32", "torch.int64": "int64", "torch.float64": "float64"}


@dataclass(frozen=True, kw_only=True)
class Group:
    """One KV-cache group: its index in vLLM's list, ``kind`` (``"full"``, ``"sliding"``,
    ``"recurrent"``), its layers' names, block size, window, Mamba cache mode, and the bytes
    of one layer's page that the store moves (attention: the block; recurrent: the state,
    without vLLM's padding)."""

    index: int
    kind: str
    layers: tuple[str, ...]
    block_size: int
    page_bytes: int
    window: int = 0
    mode: str = ""
    state: tuple[StateTensor, ...] = ()

    def window_blocks(self, n: int) -> range:
        """Indices of the blocks a sliding group needs after ``n`` tokens."""
        return range(max(0, n - self.window + 1) // self.block_size,
                     (n - 1) // self.block_size + 1)

    def state_index(self, n: int) -> int:
        """Index in a recurrent group's table of the block holding the state after ``n``."""
        return (n - 1) // self.block_size if self.mode == "align" else 0

    @property
    def max_window_blocks(self) -> int:
        return -(-(self.window - 1) // self.block_size) + 1

    def describe(self) -> str:
        extra = f"w{self.window}" if self.kind == "sliding" else \
            f"{self.mode}" if self.kind == "recurrent" else ""
        return f"{self.kind}{extra}x{len(self.layers)}p{self.page_bytes}"


@dataclass(frozen=True)
class Groups:
    """Every KV-cache group of one vLLM configuration (:func:`of`)."""

    groups: tuple[Group, ...]

    @property
    def full(self) -> tuple[Group, ...]:
        return tuple(g for g in self.groups if g.kind == "full")

    @property
    def sliding(self) -> tuple[Group, ...]:
        return tuple(g for g in self.groups if g.kind == "sliding")

    @property
    def recurrent(self) -> tuple[Group, ...]:
        return tuple(g for g in self.groups if g.kind == "recurrent")

    @property
    def hybrid(self) -> bool:
        """Whether some group is sliding or recurrent (then boundaries carry state)."""
        return any(g.kind != "full" for g in self.groups)

    @property
    def block_size(self) -> int:
        """The full-attention groups' block size (the store's chunks are their blocks)."""
        return self.full[0].block_size

    def full_layers(self, index) -> list[str]:
        """The full-attention layers' names in model order (``index``: name -> layer)."""
        return sorted((n for g in self.full for n in g.layers), key=index)

    def group_of(self, name: str) -> Group:
        for g in self.groups:
            if name in g.layers:
                return g
        raise KeyError(name)

    def state_size(self, n: int) -> int:
        """Bytes of the boundary state after ``n`` tokens."""
        return sum(len(g.layers) * len(g.window_blocks(n)) * g.page_bytes
                   for g in self.sliding) + sum(len(g.layers) * g.page_bytes
                                                for g in self.recurrent)

    @property
    def max_state_size(self) -> int:
        return sum(len(g.layers) * g.max_window_blocks * g.page_bytes for g in self.sliding) \
            + sum(len(g.layers) * g.page_bytes for g in self.recurrent)

    def layer_kinds(self, index) -> tuple[LayerKind, ...]:
        """The layout's layer kinds in model order (``index``: name -> layer; a layer holding
        attention and a recurrent mixer, as Falcon-H1's, has an entry for each)."""
        kinds = []
        for name in sorted((n for g in self.groups for n in g.layers),
                           key=lambda n: (index(n), n)):
            g = self.group_of(name)
            if g.kind == "full":
                kinds.append(LayerKind())
            elif g.kind == "sliding":
                kinds.append(LayerKind(kind="sliding", window=g.window))
            else:
                kinds.append(LayerKind(kind="recurrent", state=g.state))
        return tuple(kinds)

    def describe(self) -> str:
        """What of the groups changes the stored bytes, for the layout's ``engine``."""
        return ",".join(g.describe() for g in self.groups)


def of(kv_cache_config) -> Groups:
    """The groups of vLLM's ``KVCacheConfig``; ValueError naming what the connector cannot
    serve exactly."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        base = dict(index=i, layers=tuple(g.layer_names), block_size=int(spec.block_size))
        if type(spec) is FullAttentionSpec:
            out.append(Group(kind="full", page_bytes=int(spec.page_size_bytes), **base))
        elif type(spec) is SlidingWindowSpec:
            if spec.extra_retained_tokens:
                raise ValueError("the KVStoreConnector does not serve speculative decoding "
                                 "with sliding windows (extra retained tokens)")
            out.append(Group(kind="sliding", page_bytes=int(spec.page_size_bytes),
                             window=int(spec.sliding_window), **base))
        elif type(spec) is MambaSpec:
            if spec.num_speculative_blocks:
                raise ValueError("the KVStoreConnector does not serve speculative decoding "
                                 "with recurrent layers (speculative Mamba blocks)")
            if spec.mamba_cache_mode not in ("none", "align"):
                raise ValueError(f"the KVStoreConnector serves mamba_cache_mode 'none' or "
                                 f"'align', got {spec.mamba_cache_mode!r}")
            state = tuple(StateTensor(name=f"s{j}", shape=tuple(shape),
                                      dtype=_dtype_name(dt))
                          for j, (shape, dt) in enumerate(zip(spec.shapes, spec.dtypes,
                                                              strict=True)))
            out.append(Group(kind="recurrent", page_bytes=int(spec.state_content_size_bytes),
                             mode=spec.mamba_cache_mode, state=state, **base))
        else:
            raise ValueError(f"the KVStoreConnector does not serve KV-cache group {i} "
                             f"({type(spec).__name__}): its state layout is not verified")
    groups = Groups(tuple(out))
    if not groups.full:
        raise ValueError("the KVStoreConnector needs a full-attention layer (it keys the "
                         "store); this model has none")
    if len({g.block_size for g in groups.full}) != 1:
        raise ValueError("the KVStoreConnector needs one block size for the full-attention "
                         "groups")
    return groups


def _dtype_name(dt) -> str:
    name = _TORCH_DTYPES.get(str(dt))
    if name is None:
        raise ValueError(f"the KVStoreConnector does not store a recurrent state of {dt}")
    return name
