"""A hybrid model's KV-cache groups as vLLM declares them (its own spec classes, importable
without an engine): what the connector serves and refuses, which blocks a boundary's state
lives in, and the state's bytes moved out of and back into tensors laid out as vLLM registers
them (attention pages [blocks, heads, block, 2 x head dim]; recurrent pages as raw bytes with
padded strides)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvstore.errors import CorruptData  # noqa: E402
from kvstore.integrations.vllm import groups as kv_groups  # noqa: E402
from kvstore.integrations.vllm.hybrid import SKIP, StatePages, state_plan  # noqa: E402

B, H, D = 16, 1, 8


def config(*specs) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec) for names, spec in specs])


def full():
    return FullAttentionSpec(block_size=B, num_kv_heads=H, head_size=D, dtype=torch.float32)


def sliding(w=20):
    return SlidingWindowSpec(block_size=B, num_kv_heads=H, head_size=D, dtype=torch.float32,
                             sliding_window=w)


def mamba(mode="align", spec_blocks=0):
    return MambaSpec(block_size=B, shapes=((3, 4), (2, 2, 2)),
                     dtypes=(torch.float32, torch.float32), mamba_cache_mode=mode,
                     num_speculative_blocks=spec_blocks, page_size_padded=256)


def test_groups_state_where_each_kind_keeps_a_boundary():
    g = kv_groups.of(config((["model.layers.0.attn"], sliding()),
                            (["model.layers.1.attn"], full()),
                            (["model.layers.2.mixer", "model.layers.3.mixer"], mamba())))
    assert g.hybrid and [x.kind for x in g.groups] == ["sliding", "full", "recurrent"]
    sw, rec = g.sliding[0], g.recurrent[0]
    # after 40 tokens the next query reads 21..39: blocks 1 and 2 of 16 tokens
    assert list(sw.window_blocks(40)) == [1, 2] and list(sw.window_blocks(5)) == [0]
    assert rec.state_index(40) == 2 and rec.page_bytes == (12 + 8) * 4  # not the padding
    page = 2 * B * H * D * 4
    assert g.state_size(40) == 2 * page + 2 * 80 and g.max_state_size == 3 * page + 2 * 80
    kinds = g.layer_kinds(lambda n: int(n.split(".")[2]))
    assert [k.kind for k in kinds] == ["sliding", "full", "recurrent", "recurrent"]
    assert kinds[0].window == 20 and kinds[2].state[1].shape == (2, 2, 2)
    none = kv_groups.of(config((["a.0"], full()), (["a.1"], mamba("none"))))
    assert none.recurrent[0].state_index(40) == 0  # one block per request, whatever n
    assert not kv_groups.of(config((["a.0"], full()))).hybrid


@pytest.mark.parametrize(("specs", "reason"), [
    ([(["a.0"], mamba())], "needs a full-attention layer"),
    ([(["a.0"], full()), (["a.1"], mamba(spec_blocks=1))], "speculative decoding"),
    ([(["a.0"], MLAAttentionSpec(block_size=B, num_kv_heads=1, head_size=D,
                                 dtype=torch.float32))], "MLAAttentionSpec"),
])
def test_groups_the_connector_cannot_serve_exactly_are_refused(specs, reason):
    with pytest.raises(ValueError, match=reason):
        kv_groups.of(config(*specs))


def test_a_state_goes_back_into_other_blocks_byte_for_byte():
    g = kv_groups.of(config((["l.0"], sliding()), (["l.1"], full()), (["l.2"], mamba())))
    nb = 8
    attn = torch.randn(nb, H, B, 2 * D)  # a sliding layer's pages, as vLLM registers them
    raw = torch.randint(-128, 127, (nb, 256), dtype=torch.int8)  # padded recurrent pages
    rec = raw[:, :80].view(nb, 1, 1, 80)  # the registered view: content bytes, page stride
    pages = StatePages(g, {"l.0": attn, "l.2": rec})
    tables = ([3, 5, 6], [0, 1, 2], [7, 7, 4])  # per group: this request's block ids
    plan = state_plan(g, tables, 40)
    assert plan.sliding == ((5, 6),) and plan.recurrent == (4,)
    state = pages.gather(plan)
    assert len(state) == g.state_size(40)
    before_attn, before_raw = attn.clone(), raw.clone()
    target = state_plan(g, ([0, 1, 2], [0, 0, 0], [0, 0, 3]), 40)
    pages.scatter(target, state.tobytes())
    assert torch.equal(attn[1], before_attn[5]) and torch.equal(attn[2], before_attn[6])
    assert torch.equal(raw[3, :80], before_raw[4, :80])
    assert torch.equal(raw[3, 80:], before_raw[3, 80:])  # vLLM's padding left alone
    # a load that vLLM's own cache covers up to 32 tokens leaves block 1 alone
    keep = state_plan(g, ([0, 1, 2], [0, 0, 0], [0, 0, 3]), 40, keep_below=32)
    assert keep.sliding == ((SKIP, 2),)
    with pytest.raises(CorruptData, match="expected"):
        pages.scatter(target, state.tobytes()[:-1])
    assert np.array_equal(pages.gather(target), state)
