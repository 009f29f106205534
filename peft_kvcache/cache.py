"""`MappedCache`: a transformers `DynamicCache` pre-filled with a source model's context mapped into the
target's KV space, handed to ``target_model.generate(past_key_values=...)`` in place of prefill."""

from __future__ import annotations

import logging

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from .apply import map_cache
from .capture import CapturedKV, cache_states, run_with_cache
from .errors import CacheMismatchError, QualityError
from .kvmap import KVMap
from .models import active_adapters, layer_placements
from .positions import positions_from_mask, rotary_spec_of

logger = logging.getLogger(__name__)


class MappedCache(DynamicCache):
    """A `DynamicCache` whose context came from another model through a `KVMap`.

    generate() extends it like any DynamicCache. It remembers the positions its context ends at, and the
    first forward pass that extends it must continue right there: a prompt that repeats the cached
    context (a cache as long as the prompt) raises `CacheMismatchError` instead of silently giving wrong
    output.

    Example:
        >>> cache = MappedCache.from_source(source_model, kv_map, target_model, input_ids=prompt[:, :-1])  # doctest: +SKIP
        >>> out = target_model.generate(input_ids=prompt, past_key_values=cache, max_new_tokens=32)           # doctest: +SKIP
    """

    def __init__(self, layers_kv: list[tuple[torch.Tensor, torch.Tensor]], next_positions: torch.Tensor | None = None,
                 kv_map: KVMap | None = None):
        super().__init__()
        for keys, values in layers_kv:  # adopt the mapped tensors: DynamicLayer.update would copy each once more
            layer = DynamicLayer()
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            self.layers.append(layer)
        self.next_positions = next_positions
        self.kv_map = kv_map
        self._continuation_checked = next_positions is None
        self.fallback: str | None = None  # why the target prefilled instead ("min_quality", "bad_context")
        self.context_check: dict | None = None  # the per-request check's losses (check_tokens > 0)
        self.kept_positions: torch.Tensor | None = None  # drop_middle: the context columns kept
        self.refreshed_positions: torch.Tensor | None = None  # refresh_tokens: the positions the target recomputed

    @classmethod
    def from_source(
        cls,
        source: torch.nn.Module | Cache,
        kv_map: KVMap,
        target_model: torch.nn.Module,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_offset: int = 0,
        sink_tokens: int | None = None,
        verify_models: bool = True,
        min_quality: float | None = None,
        check_tokens: int = 0,
        on_bad_context: str = "prefill",
        check_margin: float = 0.25,
        refresh_tokens: int = 0,
        probe_tokens: int = 16,
        refresh_span: int = 8,
    ) -> "MappedCache":
        """Map a context into the target's KV space.

        Args:
            source: the source model (it is run over ``input_ids``) or a source `Cache` it already holds.
            kv_map: the fitted map from the source to ``target_model``.
            target_model: the model that will continue the conversation (a `PeftModel` works).
            input_ids: ``[batch, seq]`` context token ids, i.e. the prompt without its last token. Required
                with a source model; with a source cache they let the target compute the sink itself.
            attention_mask: ``[batch, seq]`` mask for left-padded batches (positions come from it).
            position_offset: place the mapped context this many positions later (e.g. after a prefix).
            sink_tokens: leading tokens the target computes itself (default: the map's ``sink_tokens``).
            verify_models: check the models' fingerprints against the map (cheap; memoized per model).
            min_quality: the bar for the map's ``predicted_retention`` (``kv_map.config.quality``, written by
                `peft_kvcache.quality.measure_quality`): below it the target prefills ``input_ids`` itself
                (ordinary prefill; a warning is logged and ``cache.fallback == "min_quality"``). A map without
                a predicted retention, or no ``input_ids`` to prefill, raises `QualityError`.
            check_tokens: W > 0 turns on the per-request check: the target recomputes the last W context tokens
                on top of the mapped prefix (those W tokens then hold the target's own keys/values) and on top
                of the sink only, and compares their teacher-forced next-token loss. Cost: two target passes
                over W tokens. Needs ``input_ids`` and an unpadded batch.
            on_bad_context: what a flagged context (mapped loss above window-only loss + ``check_margin``
                nats, in any row) does, always with a warning: ``"prefill"`` (the target prefills the whole
                context), ``"drop_middle"`` (the cache holds only the target's own sink + last W tokens at
                their true positions, ``cache.kept_positions``; continue with explicit ``position_ids``
                starting at ``cache.next_positions``) or ``"raise"`` (`QualityError`).
            check_margin: nats of mean loss the mapped prefix may cost before the context is flagged.
            refresh_tokens: k > 0 turns on the refresh (`peft_kvcache.refresh`): the target runs the last
                ``probe_tokens`` context tokens (the new turn) on the mapped cache, recomputes the k context
                positions the last of them attends to most (in spans of ``refresh_span`` tokens), then the probe
                tokens on top. Cost: ``2 * probe_tokens + k`` target tokens in two passes over its weights.
                Needs ``input_ids``, batch 1.

        Returns:
            A `MappedCache` with the target's layer count, shapes, dtypes and devices.
        """
        source_is_cache = isinstance(source, (Cache, tuple, list))
        if verify_models:
            kv_map.check_models(None if source_is_cache else source, target_model)
        if refresh_tokens and check_tokens:
            raise QualityError("refresh_tokens and check_tokens cannot be combined: both recompute the last tokens")
        if on_bad_context not in ("prefill", "drop_middle", "raise"):
            raise QualityError(f"on_bad_context must be 'prefill', 'drop_middle' or 'raise', got {on_bad_context!r}")
        if min_quality is not None:
            predicted = kv_map.config.quality.get("predicted_retention")
            if predicted is None:
                raise QualityError(
                    f"min_quality={min_quality} was asked but map {kv_map.config.source_name!r} -> "
                    f"{kv_map.config.target_name!r} records no predicted_retention: measure it with "
                    "peft_kvcache.quality.measure_quality(kv_map, source, target, heldout_ids) and save the map")
            if predicted < min_quality:
                logger.warning("map %s -> %s predicts retention %.3f < min_quality %.3f: the target prefills the "
                               "context itself instead", kv_map.config.source_name, kv_map.config.target_name,
                               predicted, min_quality)
                return cls._target_prefill(target_model, input_ids, attention_mask, position_offset, "min_quality")
        if source_is_cache:
            captured = cache_states(source)
        else:
            if input_ids is None:
                raise CacheMismatchError("from_source with a source model needs input_ids (the prompt minus its last token)")
            captured = run_with_cache(source, input_ids, attention_mask)

        batch, length = captured.keys[0].shape[0], captured.keys[0].shape[2]
        if input_ids is not None and tuple(input_ids.shape) != (batch, length):
            raise CacheMismatchError(
                f"input_ids has shape {tuple(input_ids.shape)} but the source cache holds {batch} x {length} tokens"
            )
        if attention_mask is None:
            attention_mask = torch.ones(batch, length, dtype=torch.long)
        elif tuple(attention_mask.shape) != (batch, length):
            raise CacheMismatchError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but the cache holds {batch} x {length} tokens"
            )
        attention_mask = attention_mask.cpu()
        source_positions = positions_from_mask(attention_mask)
        target_positions = source_positions + position_offset

        placements = layer_placements(target_model)
        mapped = map_cache(kv_map, captured.keys, captured.values, source_positions, target_positions, placements,
                           source_rotary=None if source_is_cache else rotary_spec_of(source),
                           target_rotary=rotary_spec_of(target_model))

        sink_tokens = kv_map.config.sink_tokens if sink_tokens is None else sink_tokens
        if sink_tokens > 0:
            if input_ids is None:
                logger.warning(
                    "no input_ids given with the source cache: the first %d token(s) (the attention sink) are "
                    "mapped instead of computed by the target, which costs quality; pass input_ids", sink_tokens)
            else:
                mapped = _with_target_sink(mapped, target_model, input_ids, attention_mask, sink_tokens,
                                           position_offset)
        next_positions = target_positions[:, -1] + 1 if length else torch.full((batch,), position_offset)
        if check_tokens:
            return cls._checked(mapped, kv_map, target_model, input_ids, attention_mask, target_positions,
                                next_positions, check_tokens, sink_tokens, on_bad_context, check_margin,
                                position_offset)
        if refresh_tokens:
            return cls._refreshed(mapped, kv_map, target_model, input_ids, attention_mask, next_positions,
                                  refresh_tokens, probe_tokens, refresh_span, sink_tokens, position_offset)
        return cls(mapped, next_positions=next_positions, kv_map=kv_map)

    @classmethod
    def _refreshed(cls, mapped, kv_map, target_model, input_ids, attention_mask, next_positions, budget, probe,
                   span, sink_tokens, position_offset) -> "MappedCache":
        """The refresh (`peft_kvcache.refresh.refresh_attended`) on the mapped cache."""
        from .refresh import refresh_attended

        if input_ids is None:
            raise QualityError("refresh_tokens needs input_ids: the target recomputes context tokens")
        if input_ids.shape[0] != 1 or not bool(attention_mask.bool().all()):
            raise CacheMismatchError("refresh_tokens works on one unpadded conversation at a time (batch 1)")
        cache = cls(mapped, next_positions=next_positions, kv_map=kv_map)  # the refresh's passes skip its check
        cache.refreshed_positions = refresh_attended(target_model, cache, input_ids.cpu(), probe, budget, span,
                                                     sink_tokens, position_offset)
        return cache

    @classmethod
    def _target_prefill(cls, target_model, input_ids, attention_mask, position_offset, reason) -> "MappedCache":
        """The fallback: the target's own prefill of ``input_ids`` (at the same positions a mapped cache takes)."""
        if input_ids is None:
            raise QualityError(f"the map was refused ({reason}) and the target cannot prefill the context itself: "
                               "no input_ids were given; pass input_ids (the prompt minus its last token)")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.cpu()
        positions = positions_from_mask(attention_mask) + position_offset
        own = run_with_cache(target_model, input_ids, attention_mask, position_ids=positions)
        cache = cls(list(zip(own.keys, own.values)), next_positions=positions[:, -1] + 1)
        cache.fallback = reason
        return cache

    @classmethod
    def _checked(cls, mapped, kv_map, target_model, input_ids, attention_mask, positions, next_positions, window,
                 sink_tokens, on_bad_context, margin, position_offset) -> "MappedCache":
        """The per-request check (`peft_kvcache.quality.check_context`) and the fallback it may trigger."""
        from .quality import check_context

        length = positions.shape[1]
        if input_ids is None:
            raise QualityError("check_tokens needs input_ids: the target recomputes the last context tokens")
        if not bool(attention_mask.bool().all()):
            raise CacheMismatchError("check_tokens does not support left-padded batches; check rows one at a time")
        if not 2 <= window <= length - sink_tokens:
            raise CacheMismatchError(f"check_tokens must be in 2..{length - sink_tokens} for a context of {length} "
                                     f"tokens with {sink_tokens} sink token(s), got {window}")
        report, recomputed, (window_only, keep) = check_context(target_model, mapped, input_ids, positions, window,
                                                                sink_tokens, margin)
        if not report["flagged"]:
            cache = cls([(layer.keys, layer.values) for layer in recomputed.layers], next_positions=next_positions,
                        kv_map=kv_map)
            cache.context_check = report
            return cache
        logger.warning("the mapped context raised the loss of its last %d tokens from %s (window only) to %s "
                       "nats: taking the %r fallback", window, [round(v, 3) for v in report["window_loss"]],
                       [round(v, 3) for v in report["mapped_loss"]], on_bad_context)
        if on_bad_context == "raise":
            raise QualityError(f"the mapped context failed the per-request check: next-token loss of the last "
                               f"{window} context tokens {report['mapped_loss']} with the mapped prefix vs "
                               f"{report['window_loss']} without it (margin {margin})")
        if on_bad_context == "prefill":
            cache = cls._target_prefill(target_model, input_ids, attention_mask, position_offset, "bad_context")
        else:
            cache = cls([(layer.keys, layer.values) for layer in window_only.layers], next_positions=next_positions,
                        kv_map=kv_map)
            cache.fallback, cache.kept_positions = "bad_context", keep
        cache.context_check = report
        return cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if not self._continuation_checked and layer_idx == 0:
            self._check_continuation(kwargs)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_continuation(self, kwargs: dict) -> None:
        """The first tokens added must sit right after the mapped context (see API-NOTES: a cache as long
        as the prompt otherwise gives wrong output with no error)."""
        self._continuation_checked = True
        position_ids = kwargs.get("position_ids", (kwargs.get("kwargs") or {}).get("position_ids"))
        if position_ids is None:
            return
        first = position_ids[..., 0].reshape(-1).cpu()
        expected = self.next_positions.reshape(-1)
        if first.numel() == 1 and expected.numel() > 1:
            first = first.expand_as(expected)
        if first.numel() == expected.numel() and not torch.equal(first, expected):
            raise CacheMismatchError(
                f"the mapped cache covers positions up to {(expected - 1).tolist()}, but the next tokens start at "
                f"positions {first.tolist()}: the prompt passed to generate() must extend the mapped context by "
                "at least one token (build the cache from input_ids=prompt[:, :-1]), or pass position_ids that "
                "continue a position_offset"
            )


@torch.no_grad()
def _with_target_sink(mapped, target_model, input_ids, attention_mask, sink_tokens, position_offset):
    """Replace the leading columns (left padding + ``sink_tokens`` real tokens) by the target's own KV:
    those tokens attend only to themselves, so the target computes them exactly for a few tokens' cost."""
    real_start = int((attention_mask.shape[1] - attention_mask.sum(1)).max())
    columns = min(real_start + sink_tokens, attention_mask.shape[1])
    if columns == 0:
        return mapped
    mask = attention_mask[:, :columns]
    own = _target_sink(target_model, input_ids[:, :columns].cpu(), mask, position_offset)
    for (k, v), k_own, v_own in zip(mapped, own.keys, own.values):  # fresh tensors from map_cache: write in place
        k[:, :, :columns] = k_own
        v[:, :, :columns] = v_own
    return mapped


# The sink's KV depends only on its token ids, their positions and the target's weights, and a chat
# template starts every conversation with the same tokens: memoize it instead of paying a full pass over
# the target's weights (one decode step) at every switch.
_SINK_MEMO_SIZE = 16


def _target_sink(target_model, ids: torch.Tensor, mask: torch.Tensor, position_offset: int) -> CapturedKV:
    memo = target_model.__dict__.setdefault("_peft_kvcache_sink_memo", {})
    key = repr((sorted(active_adapters(target_model)), ids.tolist(), mask.tolist(), position_offset))
    if key not in memo:
        if len(memo) >= _SINK_MEMO_SIZE:
            memo.pop(next(iter(memo)))
        memo[key] = run_with_cache(target_model, ids, mask, position_ids=positions_from_mask(mask) + position_offset)
    return memo[key]
