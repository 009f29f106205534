"""vLLM's paged KV cache, read and written a whole block at a time, for every layout the engine declares.

vLLM 0.32 hands a connector one tensor per layer, the logical view ``[num_blocks, kv_heads, block_size, C]`` of the
engine's allocation (`vllm.v1.kv_cache_interface.create_kv_cache_views`), whose strides carry the physical layout the
engine resolved (`vllm.v1.kv_cache_layout.KVCacheLayout`: NHD ``LBNHC``, HND ``LBHNC``, ...). What ``C`` holds
depends on the attention backend:

- GPU backends (FlashAttention, FlashInfer, Triton), unquantized: each (block, head, token) holds its key then its
  value, ``C = 2 * head_dim`` (`LogicalLayout`). Reading and writing index the logical view, so every physical layout
  is handled by its strides; the layout the engine declares is checked against the tensor's strides, never guessed.
  A manager block split into kernel blocks (FlashInfer accepts 16, 32 or 64 tokens a block) is read as its kernel
  blocks in order.
- The CPU backend reinterprets each block's ``[kv_heads, block_size, 2 * head_dim]`` as ``[kv_heads, 2 * block_size,
  head_dim]``: keys in the first half, values in the second, each packed as the kernel chosen at run time
  (``layer.isa``) reads them (`CpuLayout`): ``vec`` / ``vec16`` keys transposed ``[head_dim][block_size]``, values
  ``[block_size][head_dim]``; ``amx`` keys ``[block_size/16][head_dim/2][16][2]``, values
  ``[head_dim/16][block_size/2][16][2]``. Writing goes through vLLM's own op, so the packing is always the kernel's.

Reads and writes stay on the cache's device (one index_select / index_copy_ of the block ids). Keys are stored
post-RoPE, as in a transformers cache. A quantized cache (fp8, scales in the content) is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import CacheMismatchError

CPU_ISAS = ("vec", "vec16", "amx")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(block_ids), dtype=torch.long, device=device)


@dataclass(frozen=True)
class CpuLayout:
    """The packing of the CPU backend's paged layers: kernel, block size, KV heads, head size and dtype."""

    isa: str
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, kv_layer: torch.Tensor, isa: str) -> "CpuLayout":
        """The layout of a registered layer tensor; `CacheMismatchError` for a kernel or shape not known here."""
        if isa not in CPU_ISAS:
            raise CacheMismatchError(f"the CPU attention kernel {isa!r} packs blocks in a layout this connector does "
                                     f"not know (known: {CPU_ISAS})")
        if kv_layer.dim() != 4 or kv_layer.shape[-1] % 2:
            raise CacheMismatchError(f"expected a paged layer [num_blocks, kv_heads, block_size, 2 * head_dim], got "
                                     f"{tuple(kv_layer.shape)}")
        if kv_layer.dtype not in FLOAT_DTYPES:
            raise CacheMismatchError(f"the cache stores {kv_layer.dtype} (a quantized KV cache), not the model's dtype")
        _, heads, block, width = kv_layer.shape
        layout = cls(isa, block, heads, width // 2, kv_layer.dtype)
        if isa == "amx" and (block % 16 or layout.head_dim % 16):
            raise CacheMismatchError(f"the amx packing needs block and head sizes divisible by 16, got {block} and "
                                     f"{layout.head_dim}")
        return layout

    def _halves(self, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value halves ``[num_blocks, kv_heads, block_size, head_dim]`` (views) the kernel reads."""
        blocks = kv_layer.shape[0]
        return kv_layer.view(blocks, self.kv_heads, 2 * self.block_size, self.head_dim).chunk(2, dim=2)

    def read(self, kv_layer: torch.Tensor, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``block_ids``, in order: two ``[kv_heads, len(block_ids) * block_size, head_dim]``
        tensors (copies)."""
        h, b, d = self.kv_heads, self.block_size, self.head_dim
        index = _index(block_ids, kv_layer.device)
        keys, values = (half.index_select(0, index).reshape(len(index), h, b * d) for half in self._halves(kv_layer))
        if self.isa == "amx":
            keys = keys.view(-1, h, b // 16, d // 2, 16, 2).permute(0, 1, 2, 4, 3, 5).reshape(-1, h, b, d)
            values = values.view(-1, h, d // 16, b // 2, 16, 2).permute(0, 1, 3, 5, 2, 4).reshape(-1, h, b, d)
        else:
            keys = keys.view(-1, h, d, b).transpose(2, 3)
            values = values.view(-1, h, b, d)
        # [blocks, heads, block_size, head_dim] -> [heads, blocks * block_size, head_dim]
        return tuple(t.permute(1, 0, 2, 3).reshape(h, -1, d).contiguous() for t in (keys, values))

    def write(self, kv_layer: torch.Tensor, block_ids: Sequence[int], keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Write ``keys`` / ``values`` ``[kv_heads, len(block_ids) * block_size, head_dim]`` into ``block_ids`` of the
        layer, whole blocks, through vLLM's own write op (it packs them for the kernel)."""
        from vllm import _custom_ops as ops

        _check_shapes(self, block_ids, keys, values)
        offsets = torch.arange(self.block_size, dtype=torch.long)
        slots = (_index(block_ids, torch.device("cpu"))[:, None] * self.block_size + offsets).reshape(-1)
        key_cache, value_cache = self._halves(kv_layer)
        # the op takes [tokens, kv_heads, head_dim] in the cache's dtype
        ops.cpu_attn_reshape_and_cache(keys.transpose(0, 1).to(self.dtype).contiguous(),
                                       values.transpose(0, 1).to(self.dtype).contiguous(), key_cache, value_cache,
                                       slots, self.isa)


@dataclass(frozen=True)
class LogicalLayout:
    """A GPU backend's layer: the logical ``[num_blocks * ratio, kv_heads, kernel_block, 2 * head_dim]`` view, key then
    value per (block, head, token), any physical layout (``name``: the `KVCacheLayout` the engine resolved; ``ratio``
    kernel blocks per manager block)."""

    name: str
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    ratio: int = 1

    @classmethod
    def of(cls, kv_layer: torch.Tensor, layout, head_dim: int, block_size: int, num_blocks: int) -> "LogicalLayout":
        """The layout of a registered layer tensor, checked against what the engine declares: ``layout`` (its resolved
        `KVCacheLayout`: the tensor's strides must follow ``layout.layer_view_order``), the model's ``head_dim``, the
        manager's ``block_size`` and ``num_blocks``. `CacheMismatchError` for anything else (a quantized cache, keys
        and values packed with scales, another content width)."""
        if kv_layer.dim() != 4:
            raise CacheMismatchError(f"expected a paged layer [num_blocks, kv_heads, block_size, content], got "
                                     f"{tuple(kv_layer.shape)}")
        if kv_layer.dtype not in FLOAT_DTYPES:
            raise CacheMismatchError(f"the cache stores {kv_layer.dtype} (a quantized KV cache), not the model's dtype")
        rows, heads, kernel_block, content = kv_layer.shape
        if content != 2 * head_dim:
            raise CacheMismatchError(f"a block's content is {content} wide, not a key and a value of {head_dim} "
                                     "(a cache that packs scales or splits heads)")
        if rows % num_blocks or kernel_block * (rows // num_blocks) != block_size:
            raise CacheMismatchError(f"the layer holds {rows} blocks of {kernel_block} tokens; the engine manages "
                                     f"{num_blocks} of {block_size}")
        order = [dim for dim in layout.layer_view_order if kv_layer.shape[dim] > 1]
        strides = [kv_layer.stride(dim) for dim in order]
        if strides != sorted(strides, reverse=True) or kv_layer.stride(3) != 1:
            raise CacheMismatchError(f"the layer's strides {tuple(kv_layer.stride())} do not follow the {layout.name} "
                                     "layout the engine declares")
        return cls(layout.name, block_size, heads, head_dim, kv_layer.dtype, rows // num_blocks)

    def _rows(self, block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
        """The kernel blocks of ``block_ids``, in token order."""
        ids = _index(block_ids, device)
        return (ids[:, None] * self.ratio + torch.arange(self.ratio, device=device)).reshape(-1)

    def read(self, kv_layer: torch.Tensor, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``block_ids``, in order: two ``[kv_heads, len(block_ids) * block_size, head_dim]``
        tensors, on the cache's device."""
        blocks = kv_layer.index_select(0, self._rows(block_ids, kv_layer.device))  # [rows, H, kb, 2D]
        tokens = blocks.permute(1, 0, 2, 3).reshape(self.kv_heads, -1, 2 * self.head_dim)
        return tokens[..., : self.head_dim].contiguous(), tokens[..., self.head_dim:].contiguous()

    def write(self, kv_layer: torch.Tensor, block_ids: Sequence[int], keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Write ``keys`` / ``values`` ``[kv_heads, len(block_ids) * block_size, head_dim]`` into ``block_ids`` of the
        layer, whole blocks, on the cache's device."""
        _check_shapes(self, block_ids, keys, values)
        rows = self._rows(block_ids, kv_layer.device)
        kernel_block = self.block_size // self.ratio
        content = torch.cat([keys, values], dim=-1).to(kv_layer.device, self.dtype, non_blocking=True)
        blocks = content.view(self.kv_heads, len(rows), kernel_block, 2 * self.head_dim).permute(1, 0, 2, 3)
        kv_layer.index_copy_(0, rows, blocks)


def _check_shapes(layout, block_ids: Sequence[int], keys: torch.Tensor, values: torch.Tensor) -> None:
    expected = (layout.kv_heads, len(block_ids) * layout.block_size, layout.head_dim)
    if tuple(keys.shape) != expected or tuple(values.shape) != expected:
        raise CacheMismatchError(f"writing {len(block_ids)} block(s) takes keys and values of shape {expected}, got "
                                 f"{tuple(keys.shape)} and {tuple(values.shape)}")


PagedLayout = CpuLayout | LogicalLayout


def unsupported_attention(kv_cache_config) -> str | None:
    """Why the connector cannot keep this engine's cache, or None: it reads and writes every layer's blocks as full
    attention in one group; a sliding window's blocks outside the window are vLLM's shared null block by the time a
    request ends (kept, they would be served as its KV; written, they would overwrite the null block), and other kinds
    (MLA, state spaces, hybrid groups) hold other contents. None without a config (nothing to check)."""
    if kv_cache_config is None:
        return None
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) == 1 and type(groups[0].kv_cache_spec) is FullAttentionSpec:
        return None
    kinds = sorted({type(group.kv_cache_spec).__name__ for group in groups})
    return (f"the engine's cache holds {', '.join(kinds)} in {len(groups)} group(s); the connector keeps full "
            "attention in one group only (a sliding window's blocks outside it are vLLM's shared null block)")
