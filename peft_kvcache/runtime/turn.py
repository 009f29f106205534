"""One turn of an adapter-switching conversation, whoever keeps the conversation's caches: an `AdapterSession` (its
own caches) or the server's prefix engine (a store shared by every conversation). Both choose the cache the turn
starts from (a `Start`), then call `take_turn`, then keep what the turn computed; the steps every switch takes live
here too: `cache_from_base` (the base model's cache mapped, or shared, into an adapter) and `catch_up_base` (the
base cache brought up to date after an adapter's turn).

Concurrency: PEFT's active adapter is state of the whole model, so every use of a model holds its lock
(`peft_kvcache.modeling.adapters.model_lock`, one per model object, shared by every `SharedPeftModel` over it);
the caller of these functions holds it.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from transformers.generation.streamers import BaseStreamer

from ..errors import SessionError
from ..maps.adapter_maps import AdapterMaps
from ..maps.apply import map_cache
from ..maps.kvmap import KVMap
from ..modeling._compat import weights_version, with_cache
from ..modeling.adapters import adapter_active, is_activated_lora, is_peft_model, model_lock
from ..modeling.capture import cache_states, forward
from ..modeling.identity import cached_fingerprint, weights_key
from ..modeling.layout import layer_placements, model_device
from .cache import ContextCache
from .mapped import MappedCache
from .reuse import EXACT, ContextSource, Made, label

logger = logging.getLogger(__name__)

KeepBase = Literal["prefill", "reverse_map"]
KEEP_BASE: tuple[str, ...] = get_args(KeepBase)


class SharedPeftModel:
    """A `PeftModel`, its maps and the model's lock (`model_lock`: every wrapper over the same model shares it);
    shared by many `AdapterSession`s and by the server's engine.

    Example:
        >>> shared = SharedPeftModel(peft_model, maps)             # doctest: +SKIP
        >>> sessions = [AdapterSession(shared) for _ in range(8)]   # doctest: +SKIP
    """

    def __init__(self, model: torch.nn.Module, maps: AdapterMaps):
        if not is_peft_model(model):
            raise SessionError(f"SharedPeftModel needs a PeftModel, got {type(model).__name__}")
        self.model = model
        self.maps = maps
        self.lock = model_lock(model)

    @property
    def adapters(self) -> list[str]:
        """The adapters loaded on the model."""
        return list(self.model.peft_config)

    def map_to(self, adapter: str) -> KVMap:
        """The base -> ``adapter`` map (`SessionError` if there is none)."""
        if adapter not in self.maps.to_adapter:
            raise SessionError(f"no base -> {adapter!r} map; maps exist for {sorted(self.maps.to_adapter)}")
        return self.maps.to_adapter[adapter]

    def mappable(self, adapter: str) -> bool:
        """Whether a switch to ``adapter`` can start from the base model's cache (a map, or an Activated LoRA)."""
        return adapter in self.maps.to_adapter or is_activated_lora(self.model, adapter)

    def check_adapter(self, adapter: str | None) -> None:
        """Refuse (`SessionError`) an adapter the model does not have; None is the base."""
        if adapter is not None and adapter not in self.model.peft_config:
            raise SessionError(f"unknown adapter {adapter!r}; the model has {self.adapters}")


@dataclass
class Start:
    """The cache a turn starts from, how it was made (`reuse.Made`), the model tokens spent building it (the target's
    own sink of a mapped cache) and the seconds that took."""

    cache: ContextCache
    made: Made = EXACT
    model_tokens: int = 0
    prepare_seconds: float = 0.0

    @property
    def cached_tokens(self) -> int:
        return self.cache.get_seq_length()


@dataclass
class TurnResult:
    """What one turn did (a session's turn or a server's request): who answered, the generated ids, where the
    context came from and where the time went."""

    adapter: str | None  # the adapter that answered (None: the base model)
    new_ids: torch.Tensor  # [1, generated]
    prompt_tokens: int  # the whole prompt: history and new tokens
    context_source: ContextSource
    cached_tokens: int  # prompt tokens that were not prefilled (reused, mapped or shared)
    first_token_seconds: float  # from the call (a server: the request's arrival) to the first generated token
    prepare_seconds: float  # finding and mapping the cache (nothing when it was reused)
    keep_seconds: float = 0.0  # bringing the base cache up to date after the turn
    # tokens the model ran over, per phase: "prepare" (building the cache), "prefill" (the prompt tokens not cached),
    # "generated", "keep_base" (catching the base cache up after an adapter's turn)
    model_tokens: dict[str, int] = field(default_factory=dict)
    cancelled: bool = False  # generation ended early because the caller said so (nothing was kept)
    context_from: str | None = None  # "mapped" / "shared": the adapter whose cache it came from (None: the base)
    made: Made = EXACT  # how the cache the turn started from was made

    def label(self, base: str) -> str:
        """The context's label (`reuse.label`): ``reused``, ``mapped:<model>``, ... (``base``: the base's name)."""
        return label(self.made, self.cached_tokens, base)


class FirstTokenTimer(BaseStreamer):
    """A generate() streamer that records the seconds from ``started`` to the first new token (the first
    put() is the prompt) and forwards every put to an optional ``inner`` streamer.

    Example:
        >>> timer = FirstTokenTimer(time.perf_counter())                          # doctest: +SKIP
        >>> model.generate(input_ids, streamer=timer); timer.seconds               # doctest: +SKIP
    """

    def __init__(self, started: float, inner: BaseStreamer | None = None):
        self.started, self.seconds, self.inner, self._puts = started, float("nan"), inner, 0

    def put(self, value) -> None:
        self._puts += 1
        if self._puts == 2:
            self.seconds = time.perf_counter() - self.started
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()


def take_turn(shared: SharedPeftModel, adapter: str | None, prompt: torch.Tensor, start: Start,
              generation_kwargs: dict, *, started: float, streamer: BaseStreamer | None = None,
              stopping_criteria=None, seed: int | None = None) -> tuple[TurnResult, torch.Tensor]:
    """``adapter`` (None: the base) answers ``prompt`` ``[1, n]`` continuing ``start.cache``; returns the turn's result
    and the whole output ids ``[1, n + generated]``. ``started`` (a ``time.perf_counter()`` value) is where the
    first-token time counts from; ``seed`` seeds sampling (the global RNG: the caller holds the model's lock)."""
    timer = FirstTokenTimer(started, streamer)
    if seed is not None:
        torch.manual_seed(seed)
    cached = start.cached_tokens
    with adapter_active(shared.model, adapter):
        output = generate_on_cache(shared.model, prompt, start.cache, streamer=timer,
                                   **({"stopping_criteria": stopping_criteria} if stopping_criteria else {}),
                                   **generation_kwargs)
    generated = output[:, prompt.shape[1]:].clone()  # the caller's own: the session keeps output as its history
    made = start.made if cached else EXACT
    result = TurnResult(adapter, generated, prompt.shape[1], made.context_source if cached else "prefilled", cached,
                        timer.seconds, start.prepare_seconds,
                        model_tokens={"prepare": start.model_tokens, "prefill": prompt.shape[1] - cached,
                                      "generated": generated.shape[1]},
                        context_from=None if made.exact else made.source, made=made)
    return result, output


def generate_on_cache(model: torch.nn.Module, prompt: torch.Tensor, cache: ContextCache, **generate_kwargs
                      ) -> torch.Tensor:
    """``model.generate`` over ``prompt`` (``[1, n]``, any device) continuing ``cache``; the output ids on the CPU.
    The prompt and its mask go to the model's device together (generate derives positions from the mask)."""
    ids = prompt.to(model_device(model))
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **with_cache(model, cache),
                          **generate_kwargs).cpu()


def check_keep_base(keep_base: str) -> None:
    """Refuse (`SessionError`) a ``keep_base`` policy that is not one of `KeepBase`."""
    if keep_base not in KEEP_BASE:
        raise SessionError(f"keep_base must be one of {KEEP_BASE}, got {keep_base!r}")


def cache_from_base(shared: SharedPeftModel, adapter: str, base_cache: ContextCache, context_ids: torch.Tensor,
                    base_made: Made = EXACT) -> Start:
    """``adapter``'s cache of ``context_ids`` ``[1, k]`` built from the base model's cache of them (it must cover
    exactly those ``k`` tokens, or for an Activated LoRA at least them; ``base_made``: how that cache was made): for an
    Activated LoRA the first ``k`` positions shared as they are (before its invocation its KV *is* the base's), else
    mapped with the base -> adapter map, the adapter computing the sink itself. The caller holds the model's lock;
    ``base_cache`` is read, never changed.

    Example:
        >>> start = cache_from_base(shared, "shout", base_cache, ids[:, :-1])   # doctest: +SKIP
        >>> model.generate(input_ids=ids, **with_cache(model, start.cache))   # doctest: +SKIP
    """
    began = time.perf_counter()
    model, length = shared.model, context_ids.shape[1]
    if is_activated_lora(model, adapter):
        made = Made("shared", None, length) if base_made.exact else base_made.cut(length)
        shared_cache = base_cache.copy()
        if shared_cache.get_seq_length() > length:  # its invocation lies inside the base's context
            shared_cache.truncate(length)
        return Start(shared_cache, made, 0, time.perf_counter() - began)
    kv_map = shared.map_to(adapter)
    with adapter_active(model, adapter):
        mapped = MappedCache.from_source(base_cache, kv_map, model, input_ids=context_ids)
    return Start(mapped, base_made.mapped_again(length), min(kv_map.config.sink_tokens, length),
                 time.perf_counter() - began)


def catch_up_base(shared: SharedPeftModel, adapter: str, base_cache: ContextCache, adapter_cache: ContextCache,
                  ids: torch.Tensor, keep_base: KeepBase = "prefill") -> int:
    """Extend ``base_cache`` (a prefix of ``ids`` ``[1, n]``) up to what ``adapter_cache`` covers (at most
    ``ids[:, :-1]``), in place: by the adapter -> base map from the adapter's KV of the new tokens
    (``"reverse_map"``; no model runs) or by a base pass over them (``"prefill"``, and always for Activated
    LoRAs, adapters without a reverse map, a base cache that does not hold the sink yet and an adapter cache that
    holds only some of its positions: an index recipe's). Returns the tokens the model ran over (the rest were
    mapped back). The caller holds the model's lock.

    Example:
        >>> catch_up_base(shared, "shout", base_cache, adapter_cache, conversation_ids)   # doctest: +SKIP
    """
    start, end = base_cache.get_seq_length(), min(ids.shape[1], adapter_cache.get_seq_length())
    if end <= start:
        return 0
    model = shared.model
    reverse = shared.maps.to_base.get(adapter)
    # The sink is always the base model's own: mapping it back would cost the most quality.
    if (keep_base == "prefill" or reverse is None or is_activated_lora(model, adapter)
            or start < reverse.config.sink_tokens or adapter_cache.dropped_positions
            or not _fits(reverse, model, adapter)):
        with adapter_active(model, None):
            forward(model, ids[:, start:end], base_cache, position_ids=torch.arange(start, end)[None])
        return end - start
    captured = cache_states(adapter_cache)
    positions = torch.arange(start, end)[None]
    mapped = map_cache(reverse, [k[:, :, start:end] for k in captured.keys],
                       [v[:, :, start:end] for v in captured.values], positions, positions, layer_placements(model))
    for layer, (keys, values) in enumerate(mapped):
        base_cache.update(keys, values, layer)
    return 0


def _fits(kv_map: KVMap, model: torch.nn.Module, adapter: str) -> bool:
    """Whether ``adapter``'s map back to the base was fitted for the weights both load now (an adapter loaded again
    under its name has other weights): where not, the base catches up by a pass of its own, said once per map."""
    version = weights_version(model)  # one walk over the weights for both ends: switching adapters keeps it
    with adapter_active(model, adapter):
        source = cached_fingerprint(model, weights_key(model, version))
    with adapter_active(model, None):
        target = cached_fingerprint(model, weights_key(model, version))
    fits = kv_map.fitted_for(source, target)
    if not fits and kv_map not in _SAID:
        _SAID.add(kv_map)
        logger.warning("the %s -> base map was fitted for other weights than the model loads now: the base cache "
                       "catches up by a pass of the base model instead", adapter)
    return fits


_SAID: weakref.WeakSet = weakref.WeakSet()  # maps whose misfit was said (an id() could be a later map's)


__all__ = ["KEEP_BASE", "FirstTokenTimer", "KeepBase", "SharedPeftModel", "Start", "TurnResult", "cache_from_base",
           "catch_up_base", "check_keep_base", "generate_on_cache", "take_turn"]
