"""vLLM's paged KV cache on the CPU backend, read and written a block at a time.

One tensor per layer, ``[num_blocks, kv_heads, block_size, 2 * head_dim]``; viewed as ``[num_blocks, kv_heads,
2 * block_size, head_dim]`` its first half along dim 2 holds the keys and the second the values, each packed as
the attention kernel chosen at run time (``layer.isa``) reads them:

- ``vec`` / ``vec16`` (fp32, or CPUs without AMX): keys transposed ``[head_dim][block_size]``, values
  ``[block_size][head_dim]``;
- ``amx`` (bf16 with AMX tiles): keys ``[block_size/16][head_dim/2][16][2]``, values
  ``[head_dim/16][block_size/2][16][2]``.

Reading is plain indexing; writing goes through vLLM's own op (``ops.cpu_attn_reshape_and_cache``), so the packing
written is always the one the kernel reads. Keys are stored post-RoPE, as in a transformers cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import CacheMismatchError

SUPPORTED_ISAS = ("vec", "vec16", "amx")


@dataclass(frozen=True)
class PagedLayout:
    """The packing of one engine's paged layers: kernel, block size, KV heads, head size and dtype."""

    isa: str
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, kv_layer: torch.Tensor, isa: str) -> "PagedLayout":
        """The layout of a registered layer tensor; `CacheMismatchError` for a kernel or shape not known here."""
        if isa not in SUPPORTED_ISAS:
            raise CacheMismatchError(f"the CPU attention kernel {isa!r} packs blocks in a layout this connector does "
                                     f"not know (known: {SUPPORTED_ISAS})")
        if kv_layer.dim() != 4 or kv_layer.shape[-1] % 2:
            raise CacheMismatchError(f"expected a paged layer [num_blocks, kv_heads, block_size, 2 * head_dim], got "
                                     f"{tuple(kv_layer.shape)}")
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
        index = torch.as_tensor(list(block_ids), dtype=torch.long)
        keys, values = (half[index].reshape(len(index), h, b * d) for half in self._halves(kv_layer))
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

        expected = (self.kv_heads, len(block_ids) * self.block_size, self.head_dim)
        if tuple(keys.shape) != expected or tuple(values.shape) != expected:
            raise CacheMismatchError(f"writing {len(block_ids)} block(s) takes keys and values of shape {expected}, "
                                     f"got {tuple(keys.shape)} and {tuple(values.shape)}")
        offsets = torch.arange(self.block_size, dtype=torch.long)
        slots = (torch.as_tensor(list(block_ids), dtype=torch.long)[:, None] * self.block_size + offsets).reshape(-1)
        key_cache, value_cache = self._halves(kv_layer)
        # the op takes [tokens, kv_heads, head_dim] in the cache's dtype
        ops.cpu_attn_reshape_and_cache(keys.transpose(0, 1).to(self.dtype).contiguous(),
                                       values.transpose(0, 1).to(self.dtype).contiguous(), key_cache, value_cache,
                                       slots, self.isa)
