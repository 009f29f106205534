"""The GPU backends' paged layouts (`peft_kvcache.vllm.layout.LogicalLayout`), on a pure-torch model of vLLM's paged
cache built with the installed vLLM's own descriptors (`KVCacheLayout`, `create_kv_cache_views`): every layout it
declares round-trips through the codec (blocks out of order, NaN in every slot nobody wrote), and each backend's
own way of reading its cache (FlashAttention and Triton, FlashInfer) sees, in a paged attention over those blocks,
exactly the dense attention over the keys and values written. A layout the tensor does not follow is refused."""

from __future__ import annotations

import pytest
import torch

from peft_kvcache.errors import CacheMismatchError
from peft_kvcache.vllm.layout import LogicalLayout

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

HEADS, HEAD_DIM, BLOCK, BLOCKS, LAYERS = 2, 16, 16, 7, 3


def paged_cache(layout: KVCacheLayout, dtype=torch.float32, kernel_block: int | None = None) -> list[torch.Tensor]:
    """One logical ``[blocks, heads, block, 2 * head_dim]`` view per layer of one allocation laid out as vLLM lays it
    out for ``layout`` (kernel blocks of ``kernel_block`` tokens when given), every byte NaN."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=dtype)
    strides = compute_layout_strides(spec, BLOCKS, LAYERS, layout)  # the manager's blocks; views split them
    size = LAYERS * BLOCKS * spec.page_size_bytes
    raw = torch.full((size // dtype.itemsize,), float("nan"), dtype=dtype).view(torch.int8)
    tensor = KVCacheTensor(size=size, layers=[f"model.layers.{i}.attn" for i in range(LAYERS)],
                           layer_stride=strides[0], block_stride=strides[1])
    return create_kv_cache_views(raw, spec, BLOCKS, layout, tensor, kernel_block)


def backend_halves(kv_layer: torch.Tensor, backend: str, layout: KVCacheLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[rows, block, heads, head_dim]`` as the backend reads them from its layer (vLLM 0.32:
    flash_attn.py and triton_attn.py transpose the logical view; flashinfer.py permutes it to the physical order)."""
    if backend == "flashinfer":
        physical = kv_layer.permute(*layout.layer_view_order)  # [B, N, H, C] (NHD) or [B, H, N, C] (HND)
        keys, values = physical.split(HEAD_DIM, dim=-1)
        if layout.layer_view_order.index(1) < layout.layer_view_order.index(2):  # heads before tokens
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        return keys, values
    return kv_layer.transpose(1, 2).split(HEAD_DIM, dim=-1)


def paged_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: list[int],
                    length: int) -> torch.Tensor:
    """Attention of ``query`` ``[heads, head_dim]`` over the first ``length`` tokens of the blocks in ``table``."""
    k = keys[table].reshape(-1, HEADS, HEAD_DIM)[:length]
    v = values[table].reshape(-1, HEADS, HEAD_DIM)[:length]
    weights = torch.softmax(torch.einsum("hd,thd->ht", query, k) * HEAD_DIM ** -0.5, dim=-1)
    return torch.einsum("ht,thd->hd", weights, v)


LAYOUTS = [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLNHC, KVCacheLayout.BLHNC, KVCacheLayout.LHBNC]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_layout_round_trips_and_leaves_other_blocks_alone(layout, dtype):
    layers = paged_cache(layout, dtype)
    codec = LogicalLayout.of(layers[0], layout, HEAD_DIM, BLOCK, BLOCKS)
    blocks = (5, 1, 3)  # out of order: a request's blocks are anywhere in the pool
    generator = torch.Generator().manual_seed(0)
    written = [[torch.randn(HEADS, len(blocks) * BLOCK, HEAD_DIM, generator=generator).to(dtype) for _ in range(2)]
               for _ in layers]
    for layer, (keys, values) in zip(layers, written):
        codec.write(layer, blocks, keys, values)
    for layer, (keys, values) in zip(layers, written):
        read_keys, read_values = codec.read(layer, blocks)
        assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
        assert torch.equal(codec.read(layer, (3,))[0], keys[:, 2 * BLOCK:])
        untouched = [b for b in range(BLOCKS) if b not in blocks]
        assert torch.isnan(layer[untouched].float()).all() and not torch.isnan(layer[list(blocks)].float()).any()


@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC], ids=["NHD", "HND"])
@pytest.mark.parametrize("backend", ["flash_attn", "triton", "flashinfer"])
def test_each_backend_attends_over_the_written_blocks_exactly_as_over_dense_keys(layout, backend):
    layer = paged_cache(layout)[1]
    codec = LogicalLayout.of(layer, layout, HEAD_DIM, BLOCK, BLOCKS)
    table, length = [4, 0, 6], 2 * BLOCK + 5
    generator = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(HEADS, len(table) * BLOCK, HEAD_DIM, generator=generator) for _ in range(2))
    codec.write(layer, table, keys, values)
    key_cache, value_cache = backend_halves(layer, backend, layout)
    query = torch.randn(HEADS, HEAD_DIM, generator=generator)
    dense = torch.softmax(torch.einsum("hd,htd->ht", query, keys[:, :length]) * HEAD_DIM ** -0.5, dim=-1)
    expected = torch.einsum("ht,htd->hd", dense, values[:, :length])
    torch.testing.assert_close(paged_attention(query, key_cache, value_cache, table, length), expected)


def test_a_manager_block_split_into_kernel_blocks_is_read_as_its_kernel_blocks_in_order():
    """FlashInfer takes blocks of 16, 32 or 64 tokens: a manager block of 16 is then two kernel blocks of 8."""
    layout = KVCacheLayout.LBNHC
    layer = paged_cache(layout, kernel_block=BLOCK // 2)[0]
    assert layer.shape[0] == 2 * BLOCKS
    codec = LogicalLayout.of(layer, layout, HEAD_DIM, BLOCK, BLOCKS)
    keys, values = torch.randn(HEADS, 2 * BLOCK, HEAD_DIM), torch.randn(HEADS, 2 * BLOCK, HEAD_DIM)
    codec.write(layer, (6, 2), keys, values)
    assert all(torch.equal(a, b) for a, b in zip(codec.read(layer, (6, 2)), (keys, values)))
    key_cache, _ = backend_halves(layer, "flash_attn", layout)  # kernel blocks 12, 13 hold manager block 6
    assert torch.equal(key_cache[[12, 13]].reshape(-1, HEADS, HEAD_DIM).transpose(0, 1), keys[:, :BLOCK])


def test_a_layout_the_tensor_does_not_follow_or_a_packed_cache_is_refused():
    nhd = paged_cache(KVCacheLayout.LBNHC)[0]
    with pytest.raises(CacheMismatchError, match="LBHNC layout the engine declares"):
        LogicalLayout.of(nhd, KVCacheLayout.LBHNC, HEAD_DIM, BLOCK, BLOCKS)
    with pytest.raises(CacheMismatchError, match="not a key and a value"):
        LogicalLayout.of(nhd, KVCacheLayout.LBNHC, HEAD_DIM * 2, BLOCK, BLOCKS)
    with pytest.raises(CacheMismatchError, match="quantized"):
        LogicalLayout.of(nhd.view(torch.uint8), KVCacheLayout.LBNHC, HEAD_DIM, BLOCK, BLOCKS)
