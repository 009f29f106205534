"""`MappedCache`: a transformers `DynamicCache` pre-filled with a source model's context mapped into the
target's KV space, handed to ``target_model.generate(cache=...)`` (or ``past_key_values=``) in place of
prefill."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache

from ..errors import CacheMismatchError
from ..maps.apply import map_cache
from ..maps.config import Refresh
from ..maps.kvmap import KVMap
from ..modeling._compat import fill_cache, update_positions
from ..modeling.adapters import model_lock
from ..modeling.capture import CapturedKV, cache_states, run_with_cache
from ..modeling.identity import weights_key
from ..modeling.layout import check_token_ids, layer_placements, vocab_size_of
from ..modeling.positions import check_rotary_reach, positions_from_mask, rotary_spec_of
from .refresh import RefreshResult, refresh_cache, refresh_policy, refresh_runs
from .target_sink import remember_sink, sink_is_memoized, with_target_sink

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheSnapshot:
    """What `MappedCache.restore` puts back: each layer object with the tensors it held, the layer count and the
    cache's position bookkeeping. Taking one copies no tensor: a cache is extended by rebinding each layer to a new
    tensor, never by writing into the old one."""

    layers: tuple[tuple[Any, torch.Tensor | None, torch.Tensor | None], ...]
    shift: torch.Tensor | None
    continuation_checked: bool
    dropped: int = 0
    held_from: int = 0


class ContextCache(DynamicCache):
    """A `DynamicCache` that knows where its context ends: every cache the library hands to ``generate()`` (a model's
    own prefill, a cache reused from a store, or a `MappedCache`), or a `CapturedKV`'s KV as it is.

    generate() extends it like any DynamicCache. It knows the positions its context ends at (``next_positions``,
    kept right as it grows or is cut), and the first forward pass that extends it must continue right there: a
    prompt that repeats the cached context (a cache as long as the prompt) raises `CacheMismatchError` instead of
    silently giving wrong output.

    It owns the operations the library runs on a cache: `truncate`, `copy`, `snapshot` / `restore` (put it back
    exactly as it was after a failure), and the refresh (`peft_kvcache.runtime.refresh`) runs on it.

    A cache may hold only some of its context's positions (`hold_only`: an ``index@B/pP`` recipe keeps the sink, the
    picked positions and a recent tail): ``get_seq_length()`` is then the context's length (what generate() slices
    the prompt by and numbers new positions from) and ``dropped_positions`` how many of them it does not hold.
    """

    def __init__(self, layers_kv: CapturedKV | Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
                 next_positions: torch.Tensor | None = None, kv_map: KVMap | None = None):
        super().__init__()
        fill_cache(self, layers_kv.pairs() if isinstance(layers_kv, CapturedKV) else layers_kv)
        self.kv_map = kv_map  # the map its context came through (None: not mapped)
        self.refresh: RefreshResult | None = None
        self._shift: torch.Tensor | None = None  # [batch] next position minus the cached length
        self._continuation_checked = True
        self._refeed = False  # assisted decoding's first pass runs the whole prompt again (activate_past_recording)
        self._dropped = 0  # context positions not held (hold_only)
        self._held_from = 0  # every context position from here on is held, in order
        if next_positions is not None:
            self.next_positions = next_positions

    # ----- positions -----

    @property
    def next_positions(self) -> torch.Tensor | None:
        """``[batch]`` position of the next token of each row (None: the cache does not track them)."""
        return None if self._shift is None else self._shift + self.get_seq_length()

    @next_positions.setter
    def next_positions(self, positions: torch.Tensor | None) -> None:
        """Say where the next tokens must start; the next extension is checked against it."""
        if positions is None:
            self._shift, self._continuation_checked = None, True
            return
        self._shift = torch.as_tensor(positions).reshape(-1).cpu() - self.get_seq_length()
        self._continuation_checked = False

    # ----- a context held in part -----

    @property
    def dropped_positions(self) -> int:
        """How many positions of the context the cache stands for it does not hold (0: it holds them all)."""
        return self._dropped

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The length of the context the cache stands for: the positions it holds plus those it dropped."""
        held = super().get_seq_length(layer_idx)
        return held + self._dropped if held else held

    def hold_only(self, positions: torch.Tensor, layers_kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Hold only the context positions ``positions`` (sorted, ending at the context's last position), whose keys
        and values per layer are ``layers_kv``: the attention reads these alone, new tokens are numbered after the
        whole context."""
        positions = positions.reshape(-1).cpu()
        layers_kv = list(layers_kv)
        if not positions.numel() or bool((positions.diff() <= 0).any()) or int(positions[0]) < 0:
            raise CacheMismatchError("hold_only needs context positions, increasing, at least one")
        if len(layers_kv) != len(self.layers) or any(k.shape[2] != positions.numel() for k, _ in layers_kv):
            raise CacheMismatchError(f"hold_only needs the keys and values of {positions.numel()} positions for each of "
                                     f"the cache's {len(self.layers)} layers")
        length = int(positions[-1]) + 1
        gaps = torch.nonzero(positions.diff() != 1).reshape(-1)
        for layer, (keys, values) in zip(self.layers, layers_kv):
            layer.keys, layer.values = keys.to(layer.keys.dtype), values.to(layer.values.dtype)
        self._dropped = length - positions.numel()
        self._held_from = int(positions[int(gaps[-1]) + 1 if gaps.numel() else 0])  # where the held tail begins

    # ----- operations -----

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions of every layer; ``next_positions`` moves back with them. A cache that
        holds its context in part is cut only inside the tail it holds in full."""
        if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= self.get_seq_length():
            raise CacheMismatchError(f"truncate takes a whole number of positions in 0..{self.get_seq_length()} (the "
                                     f"cache's length), got {length!r}")
        if self._dropped:
            if length < self._held_from:
                raise CacheMismatchError(f"this cache holds only some positions before {self._held_from} (an index "
                                         f"recipe): it cannot be cut to {length} tokens")
            length -= self._dropped
        for layer in self.layers:
            layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]

    def copy(self) -> "ContextCache":
        """A cache holding the same tensors and positions; extending either never changes the other."""
        twin = type(self)([(layer.keys, layer.values) for layer in self.layers], kv_map=self.kv_map)
        twin._shift, twin._continuation_checked, twin.refresh = self._shift, self._continuation_checked, self.refresh
        twin._dropped, twin._held_from = self._dropped, self._held_from
        return twin

    def snapshot(self) -> CacheSnapshot:
        """The cache's state now, for `restore` (no tensor is copied)."""
        return CacheSnapshot(tuple((layer, layer.keys, layer.values) for layer in self.layers), self._shift,
                             self._continuation_checked, self._dropped, self._held_from)

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Put the cache back exactly as it was at ``snapshot`` (layers a failed pass added are dropped)."""
        del self.layers[len(snapshot.layers):]
        for layer, keys, values in snapshot.layers:
            layer.keys, layer.values = keys, values
        self._shift, self._continuation_checked = snapshot.shift, snapshot.continuation_checked
        self._dropped, self._held_from = snapshot.dropped, snapshot.held_from
        self._refeed = False

    @contextmanager
    def restored_on_error(self) -> Iterator[None]:
        """Run the block; if it raises (a forward that fails midway leaves some layers extended), `restore` the
        cache as it was before it."""
        snapshot = self.snapshot()
        try:
            yield
        except BaseException:
            self.restore(snapshot)
            raise

    @contextmanager
    def side_pass(self) -> Iterator[None]:
        """Run a pass that is not the conversation's continuation (a probe, a recompute of positions inside the
        context): its tokens are not checked as one, and the check that guards the next extension stays as it was;
        as `restored_on_error`, the cache is put back if the pass raises."""
        checked = self._continuation_checked
        with self.restored_on_error():
            self._continuation_checked = True
            try:
                yield
            finally:
                self._continuation_checked = checked

    def captured(self) -> CapturedKV:
        """The cached keys and values, per layer (the tensors themselves)."""
        return cache_states(self)

    # ----- generate()'s decoding modes (the transformers hooks a DynamicCache has) -----

    def get_mask_sizes(self, query_length, *args, **kwargs):
        """transformers' mask sizes; refuses a first pass that brings no token beyond the mapped context. While
        assisted decoding feeds the whole prompt again (see `activate_past_recording`), the mask covers that pass
        alone: its first tokens read the cached context in place of their own keys and values."""
        if self._refeed:
            return query_length, 0
        if not self._continuation_checked and isinstance(query_length, int) and query_length == 0:
            # generate() sliced away every token: the prompt is not longer than the cache
            raise CacheMismatchError(self._nothing_beyond())
        kv_length, kv_offset = super().get_mask_sizes(query_length, *args, **kwargs)
        # held positions count from the dropped ones on: each held one is before every new token, new ones stay causal
        return kv_length, kv_offset + self._dropped

    def _nothing_beyond(self) -> str:
        return (f"generate() was given no token beyond the {self.get_seq_length()} the cache holds: pass the whole "
                "conversation as input_ids (the cached context plus at least one new token)")

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0 if self._refeed else super().get_query_offset(layer_idx)

    def activate_past_recording(self, **kwargs) -> None:
        """Assisted decoding (a draft model, or prompt lookup) calls this first, then runs the whole prompt from
        position 0 through the model once, whatever the cache holds (transformers 5.24 gives wrong output on a
        pre-filled `DynamicCache` there). This cache takes that pass as a re-feed: the tokens it already holds keep
        their cached keys and values at every layer (a mapped context stays mapped), the rest are appended. Keyword
        arguments go on to `Cache.activate_past_recording` (5.25 passes ``recurrent_states_to_keep``)."""
        if self._dropped:
            raise CacheMismatchError("assisted decoding runs the prompt from position 0 on the cache: a cache holding "
                                     "only some context positions (an index recipe) cannot take it; map with a "
                                     "recipe that keeps the mapped middle")
        super().activate_past_recording(**kwargs)
        if self.get_seq_length() and not self._continuation_checked:
            if self._shift is not None and bool((self._shift != 0).any()):
                raise CacheMismatchError("assisted decoding runs the prompt from position 0: it cannot continue a cache "
                                         "placed at a position_offset or built from a left-padded batch")
            self._refeed = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """`DynamicCache.update`, checking once that the first tokens appended continue the cached context (a
        batch expanded by generate() for beams or several sequences expands the cache with it). A call refused
        leaves the cache as it was, and the next one is checked again: the checks run before anything changes."""
        if layer_idx == 0:
            repeats = self._repeats(key_states.shape[0]) if self.get_seq_length() else 1
            if self._refeed:
                self._check_refeed(key_states, kwargs)
            elif not self._continuation_checked:
                self._check_continuation(key_states, kwargs, repeats)
            if repeats > 1:
                self.batch_repeat_interleave(repeats)
        if self._refeed:
            return self._refed(key_states, value_states, layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_refeed(self, key_states: torch.Tensor, update_kwargs: dict) -> None:
        """Assisted decoding's re-fed prompt must be the whole conversation from position 0, longer than the cache;
        refused, the cache goes back to plain decoding."""
        position_ids = update_positions(update_kwargs)
        starts = None if position_ids is None else int(position_ids.reshape(-1)[0])
        held = self.layers[0].keys.shape[2]
        problem = (self._nothing_beyond() if key_states.shape[2] <= held else
                   None if starts in (0, None) else
                   f"assisted decoding re-fed {key_states.shape[2]} tokens from position {starts} onto a cache of "
                   f"{held}: expected the whole prompt from position 0")
        if problem:
            self._refeed = False
            raise CacheMismatchError(problem)

    def _refed(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        layer = self.layers[layer_idx]
        held = layer.keys.shape[2]
        layer.keys = torch.cat([layer.keys, key_states[:, :, held:].to(layer.keys.dtype)], dim=2)
        layer.values = torch.cat([layer.values, value_states[:, :, held:].to(layer.values.dtype)], dim=2)
        if layer_idx == len(self.layers) - 1:
            self._refeed, self._continuation_checked = False, True
        return layer.keys, layer.values

    def _repeats(self, batch: int) -> int:
        """How many times generate() repeated each of the cache's rows (beams, several return sequences: transformers
        expands the ids, not a cache it was given)."""
        rows = self.layers[0].keys.shape[0]
        if batch % rows:
            raise CacheMismatchError(f"the cache holds {rows} conversation(s); generate() ran {batch} rows")
        return batch // rows

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self._shift is not None:
            self._shift = self._shift.repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self._shift is not None:
            self._shift = self._shift[indices.cpu()]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self._shift is not None:
            self._shift = self._shift[beam_idx.cpu()]

    def _check_continuation(self, key_states: torch.Tensor, update_kwargs: dict, repeats: int = 1) -> None:
        """The first tokens added (``repeats`` rows per cached row) must sit right after the cached context: a cache
        as long as the prompt otherwise gives wrong output with no error. Marked checked only once they do."""
        position_ids = update_positions(update_kwargs)
        if position_ids is None:
            import transformers

            logger.warning("cannot verify that the tokens added to the mapped cache continue its context: "
                           "transformers %s passes no position_ids to the cache; the continuation check needs "
                           "transformers >= 5.24", transformers.__version__)
            self._continuation_checked = True
            return
        first = position_ids[..., 0].reshape(-1).cpu()
        expected = self.next_positions.repeat_interleave(repeats)  # layer 0 is not extended yet
        if first.numel() == 1 and expected.numel() > 1:
            first = first.expand_as(expected)
        if first.numel() == expected.numel() and not torch.equal(first, expected):
            raise CacheMismatchError(
                f"the cache covers positions up to {(expected - 1).tolist()}, but the next tokens start at "
                f"positions {first.tolist()}: the prompt passed to generate() must be the whole conversation and "
                "extend the cached context by at least one token (build the cache from input_ids=prompt[:, :-1] and "
                "pass input_ids=prompt), or pass position_ids that continue a position_offset")
        self._continuation_checked = True


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
