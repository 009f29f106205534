"""Run models over token ids and read their KV caches."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from ..errors import CacheMismatchError, IncompatibleModelsError, UnsupportedPositionalSchemeError
from ._compat import eager_attention, output_cache, with_cache
from .layout import decoder_layers, model_device
from .positions import positions_from_mask


@dataclass
class CapturedKV:
    """One model's cache over a batch: per layer ``[batch, kv_heads, seq, head_dim]``, keys post-RoPE; ``received``
    (``run_with_cache(..., received_attention=True)``): ``[batch, seq]``, the attention each token received."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    received: torch.Tensor | None = None

    def prefix(self, length: int) -> "CapturedKV":
        """The first ``length`` positions: a causal model's cache of that prefix of its input (without ``received``:
        a prefix's tokens receive attention from fewer queries)."""
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
                   position_ids: torch.Tensor | None = None, received_attention: bool = False) -> CapturedKV:
    """One forward pass (no logits) that returns the model's KV cache.

    Positions default to those of the attention mask (as generate() computes them), not ``arange``: a
    forward pass without position_ids would rotate left-padded rows' keys at the wrong positions.
    ``received_attention`` also measures the attention each token receives (`ReceivedAttention`; the pass runs
    eager attention).
    """
    if position_ids is None and attention_mask is not None:
        position_ids = positions_from_mask(attention_mask)
    if not received_attention:
        out = forward(model, input_ids, None, position_ids=position_ids, attention_mask=attention_mask)
        return cache_states(output_cache(out))
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    with ReceivedAttention(model, mask).recording() as received:
        out = forward(model, input_ids, None, position_ids=position_ids, attention_mask=attention_mask)
    captured = cache_states(output_cache(out))
    return CapturedKV(captured.keys, captured.values, received.per_token())


class ReceivedAttention:
    """While `recording`, the attention every token receives in ``model``'s forward passes over a batch with
    ``attention_mask`` ``[batch, seq]`` (left-padded): per layer and head, each query's weight on the token times the
    number of tokens that query sees (1 wherever attention is uniform), averaged over the queries that see it, the
    heads and the layers. Eager attention runs meanwhile (the weights are read from each attention module's output
    and reduced at once, never all kept)."""

    def __init__(self, model: torch.nn.Module, attention_mask: torch.Tensor):
        self.model = model
        self.modules = [getattr(layer, "self_attn", None) for layer in decoder_layers(model)]
        if any(m is None for m in self.modules):
            raise IncompatibleModelsError(f"{type(model).__name__}'s decoder layers have no self_attn module to read "
                                          "attention weights from")
        valid = attention_mask.bool().cpu()
        self.seen = positions_from_mask(attention_mask.cpu()).float().add(1) * valid  # keys each query sees
        self.queries = (valid.sum(1, keepdim=True) - self.seen + 1) * valid  # queries that see each token
        self.total, self.layers = torch.zeros(valid.shape), 0

    @contextmanager
    def recording(self) -> Iterator["ReceivedAttention"]:
        """Record the passes of the block (eager attention meanwhile: `_compat.eager_attention`)."""
        with eager_attention(self.model):
            hooks = [m.register_forward_hook(self._add) for m in self.modules]
            try:
                yield self
            finally:
                for hook in hooks:
                    hook.remove()

    def _add(self, module, args, output) -> None:
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None  # [batch, heads, queries, keys]
        if not isinstance(weights, torch.Tensor):
            raise IncompatibleModelsError(f"{type(module).__name__} returned no attention weights in eager mode")
        received = torch.einsum("bhqk,bq->bk", weights.detach().float(), self.seen.to(weights.device))
        self.total += received.cpu() / weights.shape[1]
        self.layers += 1

    def per_token(self) -> torch.Tensor:
        """``[batch, seq]`` relative attention received (0 at padding)."""
        if self.layers != len(self.modules):
            raise IncompatibleModelsError(f"attention weights came from {self.layers} of {len(self.modules)} layers")
        return self.total / self.layers / self.queries.clamp(min=1)


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
