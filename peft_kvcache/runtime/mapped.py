"""`MappedCache`: a `ContextCache` pre-filled with a source model's context mapped into the target's KV space, the
target's own attention sink in front and the map's recommended refresh applied, handed to
``target_model.generate(cache=...)`` in place of prefill."""

from __future__ import annotations

import logging

import torch
from transformers.cache_utils import Cache

from ..errors import CacheMismatchError
from ..maps.apply import map_cache
from ..maps.config import Refresh
from ..maps.kvmap import KVMap
from ..modeling.adapters import model_lock
from ..modeling.capture import CapturedKV, cache_states, run_with_cache
from ..modeling.identity import weights_key
from ..modeling.layout import check_token_ids, layer_placements, vocab_size_of
from ..modeling.positions import check_rotary_reach, positions_from_mask, rotary_spec_of
from .cache import ContextCache
from .refresh import refresh_cache, refresh_policy, refresh_runs
from .target_sink import remember_sink, sink_is_memoized, with_target_sink

logger = logging.getLogger(__name__)


class MappedCache(ContextCache):
    """A `ContextCache` whose context came from another model through a `KVMap`: the source's cache mapped into the
    target's KV space, the target's own attention sink in front and the map's recommended refresh applied
    (``refresh`` says what it did; None when none ran).

    Example:
        >>> cache = MappedCache.from_source(source_model, kv_map, target_model, input_ids=prompt[:, :-1])  # doctest: +SKIP
        >>> out = target_model.generate(input_ids=prompt, cache=cache, max_new_tokens=32)                    # doctest: +SKIP
    """

    @classmethod
    def from_source(
        cls,
        source: torch.nn.Module | Cache | CapturedKV,
        kv_map: KVMap,
        target_model: torch.nn.Module,
        input_ids: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_offset: int = 0,
        refresh_tokens: int | str | Refresh | None = None,
        verify_models: bool = True,
    ) -> "MappedCache":
        """Map a context into the target's KV space; the target computes the attention sink itself.

        Args:
            source: the source model (it is run over ``input_ids``) or a cache it already holds (a `Cache`,
                a `CapturedKV` or ``(keys, values)`` pairs per layer).
            kv_map: the fitted map from the source to ``target_model``.
            target_model: the model that will continue the conversation (a `PeftModel` works).
            input_ids: ``[batch, seq]`` context token ids, i.e. the prompt without its last token. Required
                with a source model; with a source cache they let the target compute the sink itself.
            attention_mask: ``[batch, seq]`` mask for left-padded batches (positions come from it).
            position_offset: place the mapped context this many positions later (e.g. after a prefix).
            refresh_tokens: the refresh (`peft_kvcache.runtime.refresh`): ``None`` applies the map's recommended one
                (``kv_map.config.refresh``, if any), ``0`` none, ``K`` recomputes K context positions with the
                recommended (or default) probe, a recipe name (``"hybrid@160"``, ``"refresh@160/p20"``,
                ``"index@160/p20"``: `Refresh.named`) or a `Refresh` sets everything. It needs ``input_ids`` and one
                unpadded conversation.
            verify_models: check the models' fingerprints against the map (cheap; memoized per model).

        Returns:
            A `MappedCache` with the target's layer count, shapes, dtypes and devices.
        """
        source_is_cache = isinstance(source, (Cache, CapturedKV, tuple, list))
        if not source_is_cache and not isinstance(source, torch.nn.Module):
            raise CacheMismatchError(f"source must be a source model or its cache (a transformers Cache, a "
                                     f"CapturedKV or (keys, values) pairs per layer), got {type(source).__name__}")
        policy = refresh_policy(kv_map, refresh_tokens)
        if not isinstance(position_offset, int) or isinstance(position_offset, bool) or position_offset < 0:
            raise CacheMismatchError(f"position_offset must be a non-negative integer, got {position_offset!r}")
        if input_ids is not None:
            input_ids = check_token_ids(input_ids, vocab_size_of(target_model)).cpu()
        elif not source_is_cache:
            raise CacheMismatchError("from_source with a source model needs input_ids (the prompt minus its last token)")
        attention_mask = _checked_mask(attention_mask, input_ids)
        captured = cache_states(source) if source_is_cache else None
        if captured is not None:
            _check_cache_matches(captured, input_ids, attention_mask)
        if policy is not None and (input_ids is None or input_ids.shape[0] != 1 or
                                   (attention_mask is not None and not bool(attention_mask.bool().all()))):
            if refresh_tokens is not None:
                raise CacheMismatchError("refresh_tokens needs input_ids of one unpadded conversation (batch 1)")
            logger.warning("map %s -> %s recommends a refresh, which needs input_ids of one unpadded conversation: "
                           "this cache is mapped without it (pass refresh_tokens=0 to say so)",
                           kv_map.config.source_name, kv_map.config.target_name)
            policy = None
        source_rotary = None if source_is_cache else rotary_spec_of(source)
        target_rotary = rotary_spec_of(target_model)
        length = captured.length if captured is not None else input_ids.shape[1]
        for spec, offset in ((source_rotary, 0), (target_rotary, position_offset)):
            if spec is not None and length:  # refused before any model runs
                check_rotary_reach(spec, length - 1 + offset)
        # the target's weights (its active adapter) stay those its key names until the sink is memoized
        with model_lock(target_model):
            target_key = weights_key(target_model)  # read once: it walks every parameter (the check and the sink memo)
            if verify_models:
                kv_map.check_models(None if source_is_cache else source, target_model, target_key)
            if captured is None:
                captured = run_with_cache(source, input_ids, attention_mask)
            return cls._mapped(source, captured, kv_map, target_model, input_ids, attention_mask, position_offset,
                               policy, (source_rotary, target_rotary), target_key)

    @classmethod
    def _mapped(cls, source, captured: CapturedKV, kv_map: KVMap, target_model: torch.nn.Module,
                input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, position_offset: int,
                policy: Refresh | None, rotary: tuple, target_key) -> "MappedCache":
        """`from_source` once its input is checked and the source's states are captured, under the target's lock:
        the map, the target's sink, the refresh."""
        batch, length = captured.keys[0].shape[0], captured.length
        if attention_mask is None:
            attention_mask = torch.ones(batch, length, dtype=torch.long)
        positions = positions_from_mask(attention_mask)
        source_positions = positions + source_placement(source, positions)  # where the source's keys were rotated
        target_positions = positions + position_offset
        mapped = map_cache(kv_map, captured.keys, captured.values, source_positions, target_positions,
                           layer_placements(target_model), source_rotary=rotary[0], target_rotary=rotary[1])
        sink_tokens = kv_map.config.sink_tokens
        runs = policy is not None and input_ids is not None and refresh_runs(policy, length, sink_tokens)
        # a cold sink (not memoized) is computed inside the refresh's first pass where one runs: one pass over the
        # target's weights fewer
        sink_in_refresh = (sink_tokens > 0 and runs
                           and not sink_is_memoized(target_model, input_ids[:, :sink_tokens],
                                                    attention_mask[:, :sink_tokens], position_offset, target_key))
        if sink_tokens > 0 and not sink_in_refresh:
            if input_ids is None:
                logger.warning(
                    "no input_ids given with the source cache: the first %d token(s) (the attention sink) are "
                    "mapped instead of computed by the target, which costs quality; pass input_ids", sink_tokens)
            else:
                with_target_sink(mapped, target_model, input_ids, attention_mask, sink_tokens, position_offset,
                                  target_key)
        cache = cls(mapped, kv_map=kv_map)
        if runs:  # before the positions are set: the refresh writes inside the context
            cache.refresh = refresh_cache(target_model, cache, input_ids, policy, sink_tokens, position_offset,
                                          compute_sink=sink_in_refresh)
            if sink_in_refresh:  # the refresh's first pass wrote the target's own sink and returned it
                remember_sink(target_model, input_ids[:, :sink_tokens], attention_mask[:, :sink_tokens],
                              position_offset, cache.refresh.sink, target_key)
        cache.next_positions = target_positions[:, -1] + 1 if length else torch.full((batch,), position_offset)
        return cache


def source_placement(source, positions: torch.Tensor) -> int:
    """How many positions later than ``positions`` (``[batch, seq]``, from the mask) a source cache's context sits: a
    `ContextCache` knows where its next token goes (one prefilled or mapped at a ``position_offset``), and its keys
    were rotated there; 0 for any other cache. Refuses (`CacheMismatchError`) a cache that holds only some of its
    positions or whose rows sit at different offsets."""
    if not isinstance(source, ContextCache) or source.next_positions is None or not positions.shape[1]:
        return 0
    if source.dropped_positions:
        raise CacheMismatchError("the source cache holds only some of its context's positions (an index recipe): map "
                                 "from a cache that holds its whole context")
    offsets = source.next_positions - (positions[:, -1] + 1)
    if bool((offsets != offsets[0]).any()) or int(offsets[0]) < 0:
        raise CacheMismatchError(f"the source cache's rows continue at positions {source.next_positions.tolist()}, "
                                 "which its attention_mask does not explain by one offset: pass the mask it was "
                                 "built with")
    return int(offsets[0])


def _checked_mask(attention_mask, input_ids: torch.Tensor | None) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    attention_mask = torch.as_tensor(attention_mask).cpu()
    if input_ids is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise CacheMismatchError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                                 f"{tuple(input_ids.shape)}; pass one 0/1 entry per token")
    if attention_mask.dim() != 2 or not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise CacheMismatchError("attention_mask must be a [batch, seq] tensor of 0s and 1s")
    if bool((attention_mask.diff(dim=1) < 0).any()):
        raise CacheMismatchError("attention_mask must be left-padded (0s before the 1s of each row)")
    return attention_mask.long()


def _check_cache_matches(captured: CapturedKV, input_ids, attention_mask) -> None:
    batch, length = captured.keys[0].shape[0], captured.length
    for ids, name in ((input_ids, "input_ids"), (attention_mask, "attention_mask")):
        if ids is not None and tuple(ids.shape) != (batch, length):
            raise CacheMismatchError(f"{name} has shape {tuple(ids.shape)} but the source cache holds {batch} x "
                                     f"{length} tokens")
