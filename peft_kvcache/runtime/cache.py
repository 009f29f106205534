"""`ContextCache`: a transformers `DynamicCache` pre-filled with a conversation's context (a prefill's, or another
model's mapped into this one's KV space: `peft_kvcache.runtime.mapped.MappedCache`), handed to
``model.generate(cache=...)`` in place of prefill; it knows where the next tokens go and refuses a prompt that does
not continue it."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from ..errors import CacheMismatchError
from ..maps.kvmap import KVMap
from ..modeling._compat import fill_cache, update_positions
from ..modeling.capture import CapturedKV, cache_states
from .refresh import RefreshResult

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
