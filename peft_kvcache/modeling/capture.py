"""Run models over token ids and read their KV caches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from ..errors import CacheMismatchError, UnsupportedPositionalSchemeError
from ._compat import output_cache, with_cache
from .layout import model_device
from .positions import positions_from_mask


@dataclass
class CapturedKV:
    """One model's cache over a batch: per layer ``[batch, kv_heads, seq, head_dim]``, keys post-RoPE."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def prefix(self, length: int) -> "CapturedKV":
        """The first ``length`` positions: a causal model's cache of that prefix of its input."""
        return CapturedKV([k[:, :, :length] for k in self.keys], [v[:, :, :length] for v in self.values])

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(keys, values), ...]`` per layer."""
        return list(zip(self.keys, self.values))

    @property
    def length(self) -> int:
        """Tokens held (0 for no layers)."""
        return self.keys[0].shape[2] if self.keys else 0


def cache_states(cache: Cache | Sequence) -> CapturedKV:
    """Per-layer keys and values of a transformers cache (or of ``((keys, values), ...)`` pairs); refuses
    layers that keep only a window of tokens and empty layers."""
    if isinstance(cache, CapturedKV):
        return cache
    if isinstance(cache, (tuple, list)):
        if not cache or not all(isinstance(pair, (tuple, list)) and len(pair) == 2 for pair in cache):
            raise CacheMismatchError("a source cache given as a sequence must hold (keys, values) pairs per layer")
        return CapturedKV([k for k, _ in cache], [v for _, v in cache])
    if not isinstance(cache, Cache):
        raise CacheMismatchError(f"expected a transformers Cache, got {type(cache).__name__}")
    if getattr(cache, "dropped_positions", 0):
        raise CacheMismatchError("the cache holds only some positions of its context (an index recipe): its KV is not "
                                 "the context's and cannot be mapped or stored; use a recipe that keeps the mapped "
                                 "middle (refresh@B/pP, hybrid@B)")
    keys, values = [], []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer) or getattr(layer, "is_sliding", False):
            raise UnsupportedPositionalSchemeError(
                f"source cache layer {i} is a sliding-window layer: it keeps only the last tokens, and mapping "
                "it gives wrong output; only full-attention caches can be mapped")
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.dim() != 4:
            raise CacheMismatchError(f"source cache layer {i} is empty")
        keys.append(layer.keys)
        values.append(layer.values)
    if not keys:
        raise CacheMismatchError("the source cache holds no layers")
    return CapturedKV(keys, values)


# ``logits_to_keep`` for passes that only fill a cache: an empty index keeps no position, so the vocabulary
# projection is skipped (on Qwen2.5-0.5B the 152k-token projection is over a quarter of the weights).
NO_LOGITS = torch.empty(0, dtype=torch.long)


def forward(model: torch.nn.Module, input_ids: torch.Tensor, cache: Cache | None = None, *,
            position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
            logits_to_keep: int | torch.Tensor = NO_LOGITS, **kwargs):
    """One forward pass with a cache, on the model's device, under the cache argument name the installed
    transformers takes (`_compat.cache_argument`). Returns the model's output."""
    device = model_device(model)
    return model(input_ids=input_ids.to(device),
                 position_ids=None if position_ids is None else position_ids.to(device),
                 attention_mask=None if attention_mask is None else attention_mask.to(device),
                 use_cache=True, logits_to_keep=logits_to_keep, **with_cache(model, cache), **kwargs)


@torch.no_grad()
def run_with_cache(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None) -> CapturedKV:
    """One forward pass (no logits) that returns the model's KV cache.

    Positions default to those of the attention mask (as generate() computes them), not ``arange``: a
    forward pass without position_ids would rotate left-padded rows' keys at the wrong positions.
    """
    if position_ids is None and attention_mask is not None:
        position_ids = positions_from_mask(attention_mask)
    out = forward(model, input_ids, None, position_ids=position_ids, attention_mask=attention_mask)
    return cache_states(output_cache(out))


def batches(sequences: Sequence[torch.Tensor], batch_size: int, pad_id: int = 0):
    """Left-padded ``(input_ids, attention_mask)`` batches of 1-D token id tensors, in order."""
    for start in range(0, len(sequences), batch_size):
        group = sequences[start : start + batch_size]
        length = max(len(s) for s in group)
        ids = torch.full((len(group), length), pad_id, dtype=torch.long)
        mask = torch.zeros((len(group), length), dtype=torch.long)
        for row, seq in enumerate(group):
            ids[row, length - len(seq):] = seq
            mask[row, length - len(seq):] = 1
        yield ids, mask
