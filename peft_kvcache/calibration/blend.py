"""How far a same-shape map should move the source cache, checked by what the target does with it.

For a same-shape pair (base -> LoRA adapter) the source cache is already a usable cache for the target, and
the ridge map corrects it by the part of the adapter's change it can predict from the source KV. The ridge
picks that correction by KV error on the calibration text; what matters is the target's output. So, per
kind, the correction can be scaled by ``alpha`` in ``[0, 1]``::

    W_alpha = I + alpha (W - I),   b_alpha = alpha b        (I: copy the same source layer)

``alpha = 0`` reuses the source cache as is (naive reuse, with the target's own sink), ``alpha = 1`` is the
ridge map. `choose_blend` scores a small grid on held-out text (values first, then keys) by the target's
next-token KL against its own prefill (or its loss on the real next tokens), folds the best ``alpha`` into
the map's weights (the mapping path is unchanged) and records every score in ``config.blend``, which the
model card shows. A map that over-corrects (little or unlike calibration data) falls back toward naive
reuse per kind.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import CalibrationError
from ..maps.adapter_maps import AdapterMaps
from ..maps.config import KINDS, BlendRecord
from ..maps.kvmap import KVMap
from ..modeling.adapters import adapter_active
from ..modeling.capture import CapturedKV, run_with_cache
from ..runtime.mapped import MappedCache
from .retention import cached_logits, full_logits, token_kl

DEFAULT_BLEND_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)


def blend_toward_source(kv_map: KVMap, keys: float, values: float) -> KVMap:
    """A new map whose correction of the source cache is scaled by ``keys`` / ``values`` (see the module
    docstring); ``(1, 1)`` returns an equal map, ``(0, 0)`` one that copies the source cache.

    Example:
        >>> halfway = blend_toward_source(kv_map, keys=1.0, values=0.5)  # doctest: +SKIP
    """
    config = kv_map.config
    if config.pair_kind != "same_shape":
        raise CalibrationError(f"blending toward the source cache needs a same-shape pair; map "
                               f"{config.source_name!r} -> {config.target_name!r} is {config.pair_kind}")
    if config.nonlinear is not None and (config.mlp_layers("keys") or config.mlp_layers("values")):
        raise CalibrationError("blending toward the source cache is defined for linear maps; this map has "
                               "nonlinear heads (blend first, then fit_nonlinear_heads)")
    alphas = {"keys": keys, "values": values}
    for kind, alpha in alphas.items():
        if not 0.0 <= alpha <= 1.0:
            raise CalibrationError(f"the {kind} blend must be in [0, 1], got {alpha}")
    width = config.source_layout.layer_width
    tensors = dict(kv_map.tensors)
    for kind in KINDS:
        for t in range(config.target_layout.num_layers):
            sources = kv_map.source_inputs(kind, t)
            if (kind, t) not in sources:
                raise CalibrationError(f"{kind} of target layer {t} are not mapped from source layer {t}'s {kind}, so "
                                       f"there is no source cache to blend toward (inputs {sources})")
            weight = tensors[f"{kind}.{t}.weight"]
            copy_same_layer = torch.zeros_like(weight)
            row = sources.index((kind, t)) * width
            copy_same_layer[row: row + width] = torch.eye(width, dtype=weight.dtype)
            tensors[f"{kind}.{t}.weight"] = copy_same_layer + alphas[kind] * (weight - copy_same_layer)
            tensors[f"{kind}.{t}.bias"] = alphas[kind] * tensors[f"{kind}.{t}.bias"]
    return KVMap(copy.deepcopy(config), tensors)


HeldOutExample = tuple[torch.Tensor, CapturedKV, torch.Tensor]  # token ids, source cache of the context, full logits


def held_out_examples(target_model: torch.nn.Module, sequences: Sequence[torch.Tensor],
                      source_cache: Callable[[torch.Tensor], CapturedKV], continuation: int, sink_tokens: int,
                      progress: bool = True, what: str = "blend") -> list[HeldOutExample]:
    """Per held-out sequence long enough to score (more than ``continuation + sink + 1`` tokens): its ids, the source
    cache of its context and the target's own prefill logits over its last ``continuation`` tokens."""
    usable = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    usable = [s for s in usable if s.numel() > continuation + sink_tokens + 1]
    if not usable or continuation < 1:
        raise CalibrationError(f"choosing a {what} needs held-out sequences longer than continuation + sink + 1 "
                               f"({continuation} + {sink_tokens} + 1) tokens and continuation >= 1")
    examples = []
    for ids in tqdm(usable, desc=f"{what}: reference passes", disable=not progress):
        context = ids.numel() - continuation
        examples.append((ids, source_cache(ids[None, : context - 1]), full_logits(target_model, ids, context)))
    return examples


@torch.no_grad()
def example_scores(kv_map: KVMap, target_model, examples: Sequence[HeldOutExample],
                   continuation: int) -> dict[str, list[float]]:
    """Per example: mean next-token KL(target prefill || mapped) and mean NLL of the real next tokens with the mapped
    cache (no refresh: the map alone)."""
    scores = {"kl": [], "nll": []}
    for ids, source, full in examples:
        context = ids.numel() - continuation
        cache = MappedCache.from_source(list(zip(source.keys, source.values)), kv_map, target_model,
                                        input_ids=ids[None, : context - 1], refresh_tokens=0, verify_models=False)
        logits = cached_logits(target_model, cache, ids, context, 1)
        scores["kl"].append(float(token_kl(full, logits).mean()))
        scores["nll"].append(float(F.cross_entropy(logits, ids[context:])))
    return scores


def _scores(kv_map: KVMap, target_model, examples: Sequence[HeldOutExample], continuation: int) -> dict[str, float]:
    return {name: sum(values) / len(values)
            for name, values in example_scores(kv_map, target_model, examples, continuation).items()}


def choose_blend(
    kv_map: KVMap,
    target_model: torch.nn.Module,
    sequences: Sequence[torch.Tensor],
    source_cache: Callable[[torch.Tensor], CapturedKV],
    *,
    continuation: int = 32,
    grid: Sequence[float] = DEFAULT_BLEND_GRID,
    criterion: str = "kl",
    progress: bool = True,
) -> KVMap:
    """The map blended toward the source cache by the ``(keys, values)`` scales from ``grid`` that score best
    over the last ``continuation`` tokens of held-out ``sequences`` (1-D token ids, not used to fit the map).

    Args:
        source_cache: ``ids [1, n] -> CapturedKV`` of the source model, e.g.
            ``lambda ids: run_with_cache(base, ids)``; for a `PeftModel` compute it with the adapter disabled.
        continuation: scored tokens per sequence (the rest is context).
        criterion: ``"kl"``: KL(target prefill || mapped), closeness to what the target does with its own
            prefill; or ``"nll"``: the target's loss on the real next tokens. Both are recorded. Prefer KL for
            adapters: on text off the adapter's task the base's cache can score *better* than the adapter's own
            prefill (an adapter can be worse than its base there), and NLL then rewards undoing the adapter.

    Cost: one target prefill and one source pass per sequence, then ``2 * len(grid) - 1`` mapped passes.

    Example:
        >>> blended = choose_blend(kv_map, target, heldout_ids, lambda ids: run_with_cache(source, ids))  # doctest: +SKIP
        >>> blended.config.blend.values                                                        # doctest: +SKIP
        0.5
    """
    if criterion not in ("nll", "kl"):
        raise CalibrationError(f"criterion must be 'nll' or 'kl', got {criterion!r}")
    grid = sorted(set(float(a) for a in grid) | {1.0})
    examples = held_out_examples(target_model, sequences, source_cache, continuation, kv_map.config.sink_tokens,
                                 progress, "blend")

    scores: dict[tuple[float, float], dict[str, float]] = {}

    def score(keys: float, values: float) -> float:
        if (keys, values) not in scores:
            scores[keys, values] = _scores(blend_toward_source(kv_map, keys, values), target_model, examples,
                                           continuation)
        return scores[keys, values][criterion]

    with tqdm(total=2 * len(grid), desc="blend: grid", disable=not progress) as bar:
        def best(score_of: Callable[[float], float]) -> float:
            by_alpha = {}
            for alpha in grid:
                by_alpha[alpha] = score_of(alpha)
                bar.update()
            return min(grid, key=lambda a: (by_alpha[a], -a))  # on a tie, the larger correction

        best_values = best(lambda a: score(1.0, a))
        best_keys = best(lambda a: score(a, best_values))
    blended = blend_toward_source(kv_map, best_keys, best_values)
    blended.config.blend = BlendRecord(
        keys=best_keys, values=best_values, criterion=criterion, examples=len(examples), continuation=continuation,
        grid=grid, scores={f"keys={k},values={v}": {m: round(x, 6) for m, x in s.items()}
                           for (k, v), s in sorted(scores.items())})
    return blended


def source_cache_of(model: torch.nn.Module) -> Callable[[torch.Tensor], CapturedKV]:
    """``ids -> CapturedKV`` of a plain source model (the ``source_cache`` argument of `choose_blend`)."""
    return lambda ids: run_with_cache(model, ids)


def adapter_source_caches(model: torch.nn.Module, adapter: str, reverse: bool, kv_map: KVMap,
                          sequences: Sequence[torch.Tensor], continuation: int) -> Callable[[torch.Tensor], CapturedKV]:
    """The ``source_cache`` of an adapter map (base -> ``adapter``, or back with ``reverse``) for `choose_blend` and
    `peft_kvcache.calibration.rank.choose_rank`: the source side's caches of every scorable sequence's context,
    computed now under the source's own adapter state (the target side then scores under its own)."""
    caches = {}
    with adapter_active(model, adapter if reverse else None), torch.no_grad():
        for ids in sequences:  # only the sequences held_out_examples keeps
            if ids.numel() > continuation + kv_map.config.sink_tokens + 1:
                prefix = ids[None, : ids.numel() - continuation - 1]
                caches[prefix.numpy().tobytes()] = run_with_cache(model, prefix)
    return lambda prefix: caches[prefix.numpy().tobytes()]


def choose_adapter_blends(maps: AdapterMaps, model: torch.nn.Module, sequences: Sequence[torch.Tensor], *,
                          continuation: int = 64, criterion: str = "kl", progress: bool = True) -> AdapterMaps:
    """Every map of ``maps`` blended toward its source cache (`choose_blend`) on held-out ``sequences`` (not the
    calibration data): the source side's caches are computed first under its own adapter state, then the target
    side scores the grid under its own.

    Example:
        >>> maps = choose_adapter_blends(calibrate_adapters(model, data), model, heldout_ids)  # doctest: +SKIP
    """
    sequences = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    chosen = AdapterMaps()
    for adapter, reverse, kv_map in maps.all():
        source_cache = adapter_source_caches(model, adapter, reverse, kv_map, sequences, continuation)
        with adapter_active(model, None if reverse else adapter):
            store = chosen.to_base if reverse else chosen.to_adapter
            store[adapter] = choose_blend(kv_map, model, sequences, source_cache, continuation=continuation,
                                          criterion=criterion, progress=progress)
    return chosen


__all__ = ["DEFAULT_BLEND_GRID", "adapter_source_caches", "blend_toward_source", "choose_adapter_blends",
           "choose_blend", "example_scores", "held_out_examples", "source_cache_of"]
