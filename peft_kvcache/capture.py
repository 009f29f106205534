"""Run models over token ids, read their KV caches and stream position-free features into statistics."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicSlidingWindowLayer

from .apply import layer_features, position_free_keys
from .errors import CacheMismatchError, UnsupportedPositionalSchemeError
from .fit import SufficientStatistics
from .positions import RotarySpec, positions_from_mask


@dataclass
class CapturedKV:
    """One model's cache over a batch: per layer ``[batch, kv_heads, seq, head_dim]``, keys post-RoPE."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def prefix(self, length: int) -> "CapturedKV":
        """The first ``length`` positions: a causal model's cache of that prefix of its input."""
        return CapturedKV([k[:, :, :length] for k in self.keys], [v[:, :, :length] for v in self.values])

    def to_cache(self) -> DynamicCache:
        """A transformers `DynamicCache` holding these tensors (a model extends it in place)."""
        return DynamicCache(list(zip(self.keys, self.values)))


def cache_states(cache: Cache) -> CapturedKV:
    """Per-layer keys and values of a transformers cache; refuses layers that keep only a window."""
    if isinstance(cache, (tuple, list)):  # legacy ((k, v), ...) caches
        return CapturedKV([k for k, _ in cache], [v for _, v in cache])
    if not isinstance(cache, Cache):
        raise CacheMismatchError(f"expected a transformers Cache, got {type(cache).__name__}")
    keys, values = [], []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer) or getattr(layer, "is_sliding", False):
            raise UnsupportedPositionalSchemeError(
                f"source cache layer {i} is a sliding-window layer: it keeps only the last tokens, and mapping "
                "it gives wrong output; only full-attention caches can be mapped"
            )
        if not getattr(layer, "is_initialized", True) or layer.keys is None:
            raise CacheMismatchError(f"source cache layer {i} is empty")
        keys.append(layer.keys)
        values.append(layer.values)
    return CapturedKV(keys, values)


# ``logits_to_keep`` for passes that only fill a cache: an empty index keeps no position, so the vocabulary
# projection is skipped (on Qwen2.5-0.5B, whose 152k-token projection is 136M of its 494M weights).
NO_LOGITS = torch.empty(0, dtype=torch.long)


@torch.no_grad()
def run_with_cache(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None) -> CapturedKV:
    """One forward pass (no logits) that returns the model's KV cache.

    Positions default to those of the attention mask (as generate() computes them), not ``arange``: a
    forward pass without position_ids would rotate left-padded rows' keys at the wrong positions.
    """
    device = next(model.parameters()).device
    if position_ids is None and attention_mask is not None:
        position_ids = positions_from_mask(attention_mask)
    out = model(
        input_ids=input_ids.to(device),
        attention_mask=None if attention_mask is None else attention_mask.to(device),
        position_ids=None if position_ids is None else position_ids.to(device),
        use_cache=True,
        logits_to_keep=NO_LOGITS,
    )
    cache = getattr(out, "cache", None)
    return cache_states(cache if cache is not None else out.past_key_values)


def stacked_features(captured: CapturedKV, spec: RotarySpec, positions: torch.Tensor,
                     rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of all layers side by side for the selected token ``rows`` (bool ``[batch, seq]``):
    two ``[n, num_layers * kv_heads * head_dim]`` float32 matrices, keys without RoPE."""
    keys = torch.cat([layer_features(position_free_keys(k, spec, positions.to(k.device)))[rows.to(k.device)]
                      .cpu() for k in captured.keys], dim=-1)
    values = torch.cat([layer_features(v.float())[rows.to(v.device)].cpu() for v in captured.values], dim=-1)
    return keys, values


def fitted_rows(attention_mask: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """Tokens that enter the statistics: real (unpadded) tokens past the sink, which the target always
    computes itself and which would otherwise dominate the fit with its huge-norm keys."""
    return attention_mask.bool() & (positions_from_mask(attention_mask) >= sink_tokens)


# A target is run through a callable so that PEFT adapters can be switched before each run.
TargetRun = Callable[[torch.Tensor, torch.Tensor], CapturedKV]


def accumulate(
    stats: dict[str, SufficientStatistics],
    source: CapturedKV,
    source_spec: RotarySpec,
    targets: dict[str, tuple[CapturedKV, RotarySpec]],
    attention_mask: torch.Tensor,
    sink_tokens: int,
) -> None:
    """Add one batch to ``stats['keys']`` and ``stats['values']`` (one entry per target name)."""
    positions = positions_from_mask(attention_mask)
    rows = fitted_rows(attention_mask, sink_tokens)
    if not rows.any():
        return
    x_keys, x_values = stacked_features(source, source_spec, positions, rows)
    y_keys, y_values = {}, {}
    for name, (captured, spec) in targets.items():
        y_keys[name], y_values[name] = stacked_features(captured, spec, positions, rows)
    stats["keys"].update(x_keys, y_keys)
    stats["values"].update(x_values, y_values)


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
