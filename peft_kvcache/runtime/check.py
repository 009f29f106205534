"""At switch time: the quality bar a map must meet (`meets_quality`, reading its gate) and the per-request check
(`check_context`): the target recomputes the last W context tokens on top of the mapped prefix and, separately,
on top of only the sink (window-only); if the mapped prefix raises their teacher-forced next-token loss by more
than a margin, the context is flagged and the policy's fallback runs. Cost: two target passes over W tokens (plus
the sink); the first one is not wasted: its keys/values replace the mapped ones for those W tokens.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import CacheMismatchError, QualityError
from ..modeling._compat import output_cache
from ..modeling.capture import cache_states, forward, run_with_cache
from ..modeling.positions import positions_from_mask
from .mapped import MappedCache

logger = logging.getLogger(__name__)


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
            f"retention ({predicted!r}): measure it with peft_kvcache.calibration.gate.measure_quality(kv_map, source, target, "
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
    return MappedCache(own, next_positions=positions[:, -1] + 1)


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

    cache: MappedCache
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
    recomputed = cache.copy()
    recomputed.truncate(start)
    out = forward(target_model, input_ids[:, start:], recomputed, position_ids=positions[:, start:], logits_to_keep=0)
    mapped_loss = _token_nll(out.logits[:, :-1], labels)
    keep = torch.cat([torch.arange(min(sink, start)), torch.arange(start, length)])
    out_w = forward(target_model, input_ids[:, keep], None, position_ids=positions[:, keep], logits_to_keep=0)
    window_loss = _token_nll(out_w.logits[:, -policy.tokens:-1], labels)
    flagged = bool((mapped_loss > window_loss + policy.margin).any())
    report = dict(flagged=flagged, mapped_loss=mapped_loss.tolist(), window_loss=window_loss.tolist())
    next_positions = torch.full((input_ids.shape[0],), length)
    if not flagged:
        recomputed.next_positions = next_positions  # generate() must continue right after the context
        return CheckResult(recomputed, "mapped", **report)
    logger.warning("the mapped context raised the loss of its last %d tokens from %s (window only) to %s nats: "
                   "taking the %r fallback", policy.tokens, [round(v, 3) for v in report["window_loss"]],
                   [round(v, 3) for v in report["mapped_loss"]], policy.on_bad)
    if policy.on_bad == "raise":
        raise QualityError(f"the mapped context failed the per-request check: next-token loss of the last "
                           f"{policy.tokens} context tokens {report['mapped_loss']} with the mapped prefix vs "
                           f"{report['window_loss']} without it (margin {policy.margin})")
    if policy.on_bad == "prefill":
        return CheckResult(prefill_context(target_model, input_ids), "prefill", **report)
    # the sink and the checked tail, held as positions of the whole context (`hold_only`): generate() numbers the
    # prompt's new tokens after all of it
    kept = cache_states(output_cache(out_w))
    window = MappedCache(kept, kv_map=cache.kv_map)
    window.hold_only(keep, kept.pairs())
    window.next_positions = next_positions
    return CheckResult(window, "drop_middle", kept_positions=keep, next_positions=next_positions, **report)


__all__ = ["CheckResult", "ContextCheck", "check_context", "meets_quality", "prefill_context"]
