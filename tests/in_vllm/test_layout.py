"""The paged CPU layout (`peft_kvcache.vllm.layout`): what vLLM's own write op packs, the codec reads back exactly, for
both kernels' packings; and vLLM's attention kernel, reading a cache the codec wrote, attends to exactly those keys
and values."""

from __future__ import annotations

import pytest
import torch

from peft_kvcache.errors import CacheMismatchError
from peft_kvcache._cpu import cpu_flags
from peft_kvcache.vllm.layout import CpuLayout

pytest.importorskip("vllm")

# vLLM's write op packs the AMX layout only where the CPU has AMX ('Unsupported CPU attention configuration' elsewhere)
_NEEDS_AMX = pytest.mark.skipif("amx_bf16" not in cpu_flags(), reason="vLLM's AMX packing needs a CPU with AMX")


def _layer(blocks: int, heads: int, block: int, head_dim: int, dtype) -> torch.Tensor:
    return torch.full((blocks, heads, block, 2 * head_dim), float("nan")).to(dtype)  # stale data must not leak


@pytest.mark.parametrize("isa, dtype, head_dim, block", [("vec", torch.float32, 64, 128), ("vec", torch.bfloat16, 64, 128),
                                                          ("vec16", torch.float32, 80, 128),
                                                          pytest.param("amx", torch.bfloat16, 64, 128, marks=_NEEDS_AMX),
                                                          pytest.param("amx", torch.bfloat16, 128, 32, marks=_NEEDS_AMX)])
def test_what_vllms_op_writes_the_codec_reads_back_exactly(isa, dtype, head_dim, block):
    torch.manual_seed(0)
    layer = _layer(6, 3, block, head_dim, dtype)
    layout = CpuLayout.of(layer, isa)
    blocks = (4, 1, 3)  # out of order: a request's blocks are anywhere in the pool
    keys, values = (torch.randn(3, len(blocks) * block, head_dim).to(dtype) for _ in range(2))
    layout.write(layer, blocks, keys, values)
    read_keys, read_values = layout.read(layer, blocks)
    assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
    assert torch.equal(layout.read(layer, (3,))[0], keys[:, 2 * block:])
    assert torch.isnan(layer[0].float()).all() and torch.isnan(layer[5].float()).all()  # other blocks untouched


def test_vllms_attention_kernel_reads_what_the_codec_wrote():
    from vllm import _custom_ops as ops

    torch.manual_seed(1)
    heads, query_heads, head_dim, block, length = 3, 9, 64, 128, 200
    layer = _layer(4, heads, block, head_dim, torch.float32)
    layout = CpuLayout.of(layer, "vec")
    blocks = (2, 0)
    keys, values = torch.randn(heads, 2 * block, head_dim), torch.randn(heads, 2 * block, head_dim)
    layout.write(layer, blocks, keys, values)
    query = torch.randn(1, query_heads, head_dim)
    key_cache, value_cache = layer.view(4, heads, 2 * block, head_dim).chunk(2, dim=2)
    seq_lens = torch.tensor([length], dtype=torch.int32)
    start = torch.tensor([0, 1], dtype=torch.int32)
    table = torch.tensor([list(blocks)], dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(1, query_heads, heads, head_dim, seq_lens, torch.float32, start,
                                                   False, -1, "vec", False)
    out = torch.empty(1, query_heads, head_dim)
    ops.cpu_attention_with_kv_cache(query, key_cache, value_cache, out, start, seq_lens, head_dim ** -0.5, False, None,
                                    -1, table, 0.0, metadata, None)
    k, v = keys[:, :length].repeat_interleave(3, 0), values[:, :length].repeat_interleave(3, 0)
    weights = torch.softmax(query[0, :, None] @ k.transpose(1, 2) * head_dim ** -0.5, dim=-1)
    torch.testing.assert_close(out[0], (weights @ v)[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("isa, shape, match", [("neon", (2, 3, 128, 128), "neon"), ("vec", (2, 3, 128), r"\[num_blocks"),
                                               ("amx", (2, 3, 24, 128), "divisible by 16")])
def test_unknown_kernels_and_shapes_are_refused(isa, shape, match):
    with pytest.raises(CacheMismatchError, match=match):
        CpuLayout.of(torch.zeros(shape), isa)
