"""Quality gate and per-request check: predict, before deployment, whether a map will work, and flag at
switch time the contexts where it does not.

Gate (`measure_quality`, offline, on held-out text): each sequence is split into a context and its last
``query_tokens`` tokens. The target runs the query tokens on top of its own prefill of the context; at
every layer a forward hook replays that layer's attention module on the very same input three times,
attending to (a) the target's own context keys/values, (b) the mapped ones (as `MappedCache.from_source`
builds them, sink included, no refresh) and (c) no context (the sink only). Per layer we record the cosine
between (a) and (b) and between (a) and (c).

Predicted retention mirrors normalized retention per layer: the share of the no-context cosine gap the
mapped cache closes, ``(cos_mapped - cos_none) / (1 - cos_none)``, averaged over layers (at most 1; below 0
where the map is worse than no context). Raw cosines sit near 1 whatever the map (attention outputs share a
large common part: the sink, the query token itself), so the gap to the no-context cosine, which the target
would get for free, is what separates maps. It is a heuristic, not fitted to measured retention.

Per-request check (`check_context`, at switch time, after `MappedCache.from_source`): the target recomputes the
last W context tokens on top of the mapped prefix and, separately, on top of only the sink (window-only); if
the mapped prefix raises their teacher-forced next-token loss by more than a margin, the context is flagged
and the policy's fallback runs. Cost: two target passes over W tokens (plus the sink); the first one is not
wasted: its keys/values replace the mapped ones for those W tokens.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers.cache_utils import DynamicCache

from ._compat import output_cache, replay_attention, truncate
from .cache import MappedCache
from .capture import CapturedKV, cache_states, forward, run_with_cache
from .config import DataRecord, GateRecord
from .errors import CacheMismatchError, EvaluationError, QualityError
from .models import decoder_layers
from .positions import positions_from_mask

logger = logging.getLogger(__name__)


# ----- the offline gate -----


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
def attention_cosines(target_model, own: CapturedKV, mapped: CapturedKV, query_ids: torch.Tensor,
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
                mask = lambda prefix: _prefix_mask(prefix, hidden.shape[1], hidden.dtype, hidden.device)  # noqa: E731
                own_k, own_v = own.keys[index], own.values[index]
                reference = replay_attention(module, args, kwargs, own_k, own_v, mask(own_k.shape[2]))
                m_k, m_v = mapped.keys[index], mapped.values[index]
                mapped_cos[index] = _cosine(replay_attention(module, args, kwargs, m_k, m_v, mask(m_k.shape[2])),
                                            reference)
                none = replay_attention(module, args, kwargs, own_k[:, :, :sink_tokens], own_v[:, :, :sink_tokens],
                                        mask(sink_tokens))
                none_cos[index] = _cosine(none, reference)
            finally:
                busy[0] = False
            return None
        return hook

    handles = [layer.self_attn.register_forward_hook(hook_for(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        forward(target_model, query_ids, own.to_cache(), position_ids=query_positions)
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
                    query_tokens: int = 16, data: DataRecord | None = None, write: bool = True,
                    progress: bool = True) -> GateRecord:
    """The quality gate on held-out ``sequences`` (1-D token ids, each longer than ``query_tokens`` plus the
    sink; ``data`` says which texts they are): per-layer attention-output cosines and the predicted retention
    (see the module docstring). With ``write=True`` the record goes into ``kv_map.config.quality.gate`` (saved
    with the map, shown on its card, read by `meets_quality`).

    Example:
        >>> gate = measure_quality(kv_map, source, target, heldout_ids, progress=False)  # doctest: +SKIP
        >>> gate.predicted_retention                                                     # doctest: +SKIP
    """
    sink = kv_map.config.sink_tokens
    usable = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    usable = [s for s in usable if s.numel() > query_tokens + sink]
    if not usable or query_tokens < 1:
        raise EvaluationError(f"the quality gate needs sequences longer than query_tokens + sink "
                              f"({query_tokens} + {sink}) tokens and query_tokens >= 1")
    kv_map.check_models(source_model, target_model)
    layers = kv_map.config.target_layout.num_layers
    mapped_sum, none_sum = [0.0] * layers, [0.0] * layers
    for ids in tqdm(usable, desc="quality gate", disable=not progress):
        context, queries = ids[None, :-query_tokens], ids[None, -query_tokens:]
        own = run_with_cache(target_model, context)
        mapped = MappedCache.from_source(source_model, kv_map, target_model, input_ids=context, refresh_tokens=0,
                                         verify_models=False)
        positions = torch.arange(context.shape[1], ids.numel())[None]
        m_cos, n_cos = attention_cosines(target_model, own, cache_states(mapped), queries, positions, sink)
        mapped_sum = [a + b for a, b in zip(mapped_sum, m_cos)]
        none_sum = [a + b for a, b in zip(none_sum, n_cos)]
    mapped_cos = [v / len(usable) for v in mapped_sum]
    none_cos = [v / len(usable) for v in none_sum]
    gate = GateRecord(predicted_retention=round(predicted_retention(mapped_cos, none_cos), 6),
                      attention_cosine_per_layer=[round(v, 6) for v in mapped_cos],
                      no_context_cosine_per_layer=[round(v, 6) for v in none_cos], sequences=len(usable),
                      query_tokens=query_tokens, data=data or DataRecord())
    if write:
        kv_map.config.quality.gate = gate
    return gate


def meets_quality(kv_map, min_quality: float) -> bool:
    """Whether the map's predicted retention (its quality gate) reaches ``min_quality``; a map without a finite
    prediction raises `QualityError` (never a silent pass: NaN compares false with everything).

    Example:
        >>> cache = (MappedCache.from_source(src, kv_map, tgt, input_ids=ctx) if meets_quality(kv_map, 0.9)
        ...          else prefill_context(tgt, ctx))                                      # doctest: +SKIP
    """
    if not isinstance(min_quality, (int, float)) or isinstance(min_quality, bool) or not math.isfinite(min_quality):
        raise QualityError(f"min_quality must be a finite number, got {min_quality!r}")
    predicted = kv_map.config.quality.predicted_retention
    if not isinstance(predicted, (int, float)) or not math.isfinite(predicted):
        raise QualityError(
            f"map {kv_map.config.source_name!r} -> {kv_map.config.target_name!r} records no finite predicted "
            f"retention ({predicted!r}): measure it with peft_kvcache.quality.measure_quality(kv_map, source, target, "
            "heldout_ids) and save the map")
    return predicted >= min_quality


@torch.no_grad()
def prefill_context(target_model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    position_offset: int = 0) -> MappedCache:
    """The target's own prefill of ``input_ids`` at the positions a mapped cache would take: the fallback when a
    map is refused (same continuation check as a mapped cache)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    positions = positions_from_mask(attention_mask.cpu()) + position_offset
    own = run_with_cache(target_model, input_ids, attention_mask, position_ids=positions)
    return MappedCache(list(zip(own.keys, own.values)), next_positions=positions[:, -1] + 1)


# ----- the per-request check -----


@dataclass(frozen=True)
class ContextCheck:
    """The per-request check: recompute the last ``tokens`` context tokens with and without the mapped prefix;
    flag the context when the mapped prefix costs more than ``margin`` nats of mean next-token loss, and then
    ``on_bad``: ``"prefill"`` (the target prefills the whole context), ``"drop_middle"`` (keep only the target's
    own sink + last tokens at their true positions) or ``"raise"`` (`QualityError`)."""

    tokens: int = 16
    margin: float = 0.25
    on_bad: str = "prefill"


@dataclass
class CheckResult:
    """What the check found and the cache to continue with (``action``: ``"mapped"``, ``"prefill"`` or
    ``"drop_middle"``; with ``"drop_middle"`` continue with explicit ``position_ids`` from ``next_positions``)."""

    cache: DynamicCache
    action: str
    flagged: bool
    mapped_loss: list[float]
    window_loss: list[float]
    kept_positions: torch.Tensor | None = None
    next_positions: torch.Tensor | None = field(default=None, repr=False)


def _token_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL per row: ``logits`` ``[batch, n, vocab]`` predicting ``labels`` ``[batch, n]``."""
    return F.cross_entropy(logits.float().transpose(1, 2), labels.to(logits.device), reduction="none").mean(1).cpu()


@torch.no_grad()
def check_context(cache: MappedCache, target_model, input_ids: torch.Tensor,
                  policy: ContextCheck = ContextCheck()) -> CheckResult:
    """Run the per-request check on a mapped cache of ``input_ids`` (``[batch, n]``, unpadded, no position
    offset) and return the cache to continue with. The mapped cache itself is left as it was.

    Example:
        >>> mapped = MappedCache.from_source(src, kv_map, tgt, input_ids=context)                   # doctest: +SKIP
        >>> result = check_context(mapped, tgt, context, ContextCheck(tokens=16, on_bad="prefill"))  # doctest: +SKIP
        >>> out = tgt.generate(input_ids=prompt, cache=result.cache)                                 # doctest: +SKIP
    """
    if policy.on_bad not in ("prefill", "drop_middle", "raise"):
        raise QualityError(f"on_bad must be 'prefill', 'drop_middle' or 'raise', got {policy.on_bad!r}")
    length, sink = input_ids.shape[1], cache.kv_map.config.sink_tokens if cache.kv_map is not None else 1
    if cache.get_seq_length() != length:
        raise CacheMismatchError(f"the cache holds {cache.get_seq_length()} tokens, input_ids {length}")
    if not 2 <= policy.tokens <= length - sink:
        raise CacheMismatchError(f"the check's tokens must be in 2..{length - sink} for a context of {length} tokens "
                                 f"with {sink} sink token(s), got {policy.tokens}")
    start, labels = length - policy.tokens, input_ids[:, length - policy.tokens + 1:]
    positions = torch.arange(length)[None].expand(input_ids.shape[0], -1)
    recomputed = cache_states(cache).to_cache()
    truncate(recomputed, start)
    out = forward(target_model, input_ids[:, start:], recomputed, position_ids=positions[:, start:], logits_to_keep=0)
    mapped_loss = _token_nll(out.logits[:, :-1], labels)
    keep = torch.cat([torch.arange(min(sink, start)), torch.arange(start, length)])
    out_w = forward(target_model, input_ids[:, keep], None, position_ids=positions[:, keep], logits_to_keep=0)
    window_loss = _token_nll(out_w.logits[:, -policy.tokens:-1], labels)
    flagged = bool((mapped_loss > window_loss + policy.margin).any())
    report = dict(flagged=flagged, mapped_loss=mapped_loss.tolist(), window_loss=window_loss.tolist())
    next_positions = torch.full((input_ids.shape[0],), length)
    if not flagged:
        mapped = MappedCache(cache_states(recomputed).pairs(), next_positions, cache.kv_map)
        return CheckResult(mapped, "mapped", **report)
    logger.warning("the mapped context raised the loss of its last %d tokens from %s (window only) to %s nats: "
                   "taking the %r fallback", policy.tokens, [round(v, 3) for v in report["window_loss"]],
                   [round(v, 3) for v in report["mapped_loss"]], policy.on_bad)
    if policy.on_bad == "raise":
        raise QualityError(f"the mapped context failed the per-request check: next-token loss of the last "
                           f"{policy.tokens} context tokens {report['mapped_loss']} with the mapped prefix vs "
                           f"{report['window_loss']} without it (margin {policy.margin})")
    if policy.on_bad == "prefill":
        return CheckResult(prefill_context(target_model, input_ids), "prefill", **report)
    window = cache_states(output_cache(out_w)).to_cache()
    return CheckResult(window, "drop_middle", kept_positions=keep, next_positions=next_positions, **report)


__all__ = ["ContextCheck", "CheckResult", "attention_cosines", "check_context", "measure_quality", "meets_quality",
           "predicted_retention", "prefill_context"]
