"""Quality gate and per-request check: predict, before deployment, whether a map will work, and flag at
switch time the contexts where it does not.

Gate (`measure_quality`, offline, on held-out text): each sequence is split into a context and its last
``query_tokens`` tokens. The target runs the query tokens on top of its own prefill of the context; at
every layer a forward hook re-runs that layer's attention module on the very same input three times,
attending to (a) the target's own context keys/values, (b) the mapped ones (as `MappedCache.from_source`
builds them, sink included) and (c) no context (the sink only). Per layer we record the cosine between
(a) and (b) (``attention_cosine_per_layer``) and between (a) and (c) (``no_context_cosine_per_layer``).

Predicted retention (``predicted_retention``) mirrors normalized retention per layer: the share of the
no-context cosine gap the mapped cache closes, ``(cos_mapped - cos_none) / (1 - cos_none)``, averaged over
layers (at most 1; below 0 where the map is worse than no context). Raw cosines sit near 1 whatever the map
(attention outputs share a large common part: the sink, the query token itself), so the gap to the
no-context cosine, which the target would get for free, is what separates maps. It is a heuristic, not fitted to
measured retention: `benchmarks/nonlinear.py` reports its correlation with measured retention.

Per-request check (`check_context`, at switch time, ``MappedCache.from_source(..., check_tokens=W)``): the
target recomputes the last W context tokens on top of the mapped prefix and, separately, on top of only the
sink (window-only); if the mapped prefix raises their teacher-forced next-token loss by more than a
margin, the context is flagged. Cost: two target passes over W tokens (plus the sink); the first one is
not wasted: its keys/values replace the mapped ones for those W tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers.cache_utils import DynamicCache

from .capture import NO_LOGITS, run_with_cache
from .errors import EvaluationError
from .models import decoder_layers

logger = logging.getLogger(__name__)


class _FixedPrefix:
    """What one attention call sees as its cache: fixed context keys/values, the call's own appended."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return (torch.cat([self.keys.to(key_states), key_states], dim=2),
                torch.cat([self.values.to(value_states), value_states], dim=2))


def _prefix_mask(prefix: int, queries: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask ``[1, 1, queries, prefix + queries]``: the whole prefix, causal among the queries."""
    mask = torch.zeros(queries, prefix + queries, dtype=dtype, device=device)
    causal = torch.ones(queries, queries, dtype=torch.bool, device=device).triu(1)
    mask[:, prefix:].masked_fill_(causal, torch.finfo(dtype).min)
    return mask[None, None]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over tokens of the cosine between attention outputs ``[batch, tokens, hidden]``."""
    return float(F.cosine_similarity(a.float().flatten(0, -2), b.float().flatten(0, -2), dim=-1).mean())


@torch.no_grad()
def attention_cosines(target_model, own: Sequence[tuple[torch.Tensor, torch.Tensor]],
                      mapped: Sequence[tuple[torch.Tensor, torch.Tensor]], query_ids: torch.Tensor,
                      query_positions: torch.Tensor, sink_tokens: int = 1) -> tuple[list[float], list[float]]:
    """Per target layer, cosine between the attention output over the target's own context KV and (1) over
    the mapped KV, (2) over the sink only; the queries ``query_ids`` ``[1, W]`` continue the context at
    ``query_positions`` ``[1, W]``. Every layer sees the target's own residual stream, so each cosine
    measures that layer's mapped keys/values alone. Needs the eager or sdpa attention implementation."""
    layers = decoder_layers(target_model)
    mapped_cos, none_cos = [0.0] * len(layers), [0.0] * len(layers)
    busy = [False]

    def hook_for(index: int):
        def hook(module, args, kwargs, output):
            if busy[0]:
                return None
            busy[0] = True
            try:
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                queries = hidden.shape[1]

                def attend(keys, values):
                    call = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "past_key_value")}
                    call["attention_mask"] = _prefix_mask(keys.shape[2], queries, hidden.dtype, hidden.device)
                    return module(*args, cache=_FixedPrefix(keys, values), **call)[0]

                (own_k, own_v), (map_k, map_v) = own[index], mapped[index]
                reference = attend(own_k, own_v)
                mapped_cos[index] = _cosine(attend(map_k, map_v), reference)
                none_cos[index] = _cosine(attend(own_k[:, :, :sink_tokens], own_v[:, :, :sink_tokens]), reference)
            finally:
                busy[0] = False
            return None
        return hook

    handles = [layer.self_attn.register_forward_hook(hook_for(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        device = next(target_model.parameters()).device
        target_model(input_ids=query_ids.to(device), position_ids=query_positions.to(device),
                     past_key_values=DynamicCache([(k, v) for k, v in own]), use_cache=True, logits_to_keep=NO_LOGITS)
    finally:
        for handle in handles:
            handle.remove()
    return mapped_cos, none_cos


def predicted_retention(mapped_cosines: Sequence[float], no_context_cosines: Sequence[float]) -> float:
    """Mean over layers of ``(cos_mapped - cos_none) / (1 - cos_none)``, each at most 1.

    Example:
        >>> predicted_retention([1.0, 0.9], [0.8, 0.8])
        0.75
    """
    shares = [min(1.0, (m - n) / max(1.0 - n, 1e-6)) for m, n in zip(mapped_cosines, no_context_cosines)]
    return sum(shares) / len(shares)


@torch.no_grad()
def measure_quality(kv_map, source_model, target_model, sequences: Sequence[torch.Tensor], *,
                    query_tokens: int = 16, max_sequences: int | None = None, write: bool = True,
                    progress: bool = True) -> dict:
    """The quality gate on held-out ``sequences`` (1-D token ids, each longer than ``query_tokens`` plus the
    sink): per-layer attention-output cosines and the predicted retention (see the module docstring).
    With ``write=True`` the figures go into ``kv_map.config.quality`` (saved with the map, shown on its card,
    read by ``MappedCache.from_source(..., min_quality=...)``).

    Example:
        >>> figures = measure_quality(kv_map, source, target, heldout_ids, progress=False)  # doctest: +SKIP
        >>> figures["predicted_retention"]                                                 # doctest: +SKIP
        0.61
    """
    from .cache import MappedCache

    sink = kv_map.config.sink_tokens
    usable = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    usable = [s for s in usable if s.numel() > query_tokens + sink][:max_sequences]
    if not usable or query_tokens < 1:
        raise EvaluationError(f"the quality gate needs sequences longer than query_tokens + sink "
                              f"({query_tokens} + {sink}) tokens and query_tokens >= 1")
    kv_map.check_models(source_model, target_model)
    layers = kv_map.config.target_layout.num_layers
    mapped_sum, none_sum = [0.0] * layers, [0.0] * layers
    for ids in tqdm(usable, desc="quality gate", disable=not progress):
        context, queries = ids[None, :-query_tokens], ids[None, -query_tokens:]
        own = run_with_cache(target_model, context)
        mapped = MappedCache.from_source(source_model, kv_map, target_model, input_ids=context, verify_models=False)
        mapped_kv = [(layer.keys, layer.values) for layer in mapped.layers]
        positions = torch.arange(context.shape[1], ids.numel())[None]
        m_cos, n_cos = attention_cosines(target_model, list(zip(own.keys, own.values)), mapped_kv, queries,
                                         positions, sink)
        mapped_sum = [a + b for a, b in zip(mapped_sum, m_cos)]
        none_sum = [a + b for a, b in zip(none_sum, n_cos)]
    mapped_cos = [v / len(usable) for v in mapped_sum]
    none_cos = [v / len(usable) for v in none_sum]
    figures = {
        "attention_cosine_per_layer": [round(v, 6) for v in mapped_cos],
        "no_context_cosine_per_layer": [round(v, 6) for v in none_cos],
        "attention_cosine_mean": round(sum(mapped_cos) / layers, 6),
        "predicted_retention": round(predicted_retention(mapped_cos, none_cos), 6),
        "quality_gate": {"sequences": len(usable), "query_tokens": query_tokens,
                         "formula": "mean over layers of (cos_mapped - cos_none) / (1 - cos_none)"},
    }
    if write:
        kv_map.config.quality.update(figures)
    return figures


def _token_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL per row: ``logits`` ``[batch, n, vocab]`` predicting ``labels`` ``[batch, n]``."""
    return F.cross_entropy(logits.float().transpose(1, 2), labels.to(logits.device), reduction="none").mean(1).cpu()


@torch.no_grad()
def check_context(target_model, mapped: Sequence[tuple[torch.Tensor, torch.Tensor]], input_ids: torch.Tensor,
                  positions: torch.Tensor, window: int, sink_tokens: int, margin: float):
    """The per-request check. Returns ``(report, recomputed, window_only)``: ``report`` has the per-row
    losses and ``flagged``; ``recomputed`` is the cache of the mapped prefix plus the target's own last
    ``window`` tokens computed on top of it; ``window_only`` the target's own cache of the sink and the last
    ``window`` tokens (at their true positions) with the kept column indices."""
    length = input_ids.shape[1]
    start = length - window
    device = next(target_model.parameters()).device
    ids, positions = input_ids.to(device), positions.to(device)
    labels = input_ids[:, start + 1:]

    recomputed = DynamicCache([(k[:, :, :start], v[:, :, :start]) for k, v in mapped])
    out = target_model(input_ids=ids[:, start:], position_ids=positions[:, start:], past_key_values=recomputed,
                       use_cache=True)
    mapped_loss = _token_nll(out.logits[:, :-1], labels)

    keep = torch.cat([torch.arange(min(sink_tokens, start)), torch.arange(start, length)])
    out_w = target_model(input_ids=ids[:, keep], position_ids=positions[:, keep], use_cache=True)
    window_loss = _token_nll(out_w.logits[:, -window:-1], labels)
    flagged = bool((mapped_loss > window_loss + margin).any())
    report = {"tokens": window, "mapped_loss": mapped_loss.tolist(), "window_loss": window_loss.tolist(),
              "margin": margin, "flagged": flagged}
    return report, recomputed, (out_w.past_key_values, keep)


__all__ = ["measure_quality", "attention_cosines", "predicted_retention", "check_context"]
