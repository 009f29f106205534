"""Adapter-switching conversations: a session holds one conversation's token ids and caches, and switches
the active PEFT adapter (or the base model) per turn without ever re-prefilling the history: it maps the
base cache it holds into the next adapter's KV space (`MappedCache.from_source`, the target computing the
attention sink itself).

State kept per session, so that any adapter can take the next turn:

- a **base cache**, always: the base model's KV of the history (all but the last token);
- the cache of the adapter that took the last turn, reused as is when the same adapter continues.

After an adapter's turn the base cache must catch up with the new tokens (the user message and the reply).
Two policies (``keep_base=``), compared by ``benchmarks/adapters.py``:

- ``"prefill"`` (default, as in the server): the base model runs over just the new tokens, attending to its own
  cache: an exact base cache (base turns match a full prefill, and every switch maps from an exact base cache), at
  the price of a pass over the new tokens;
- ``"reverse_map"``: the adapter's KV of the new tokens is mapped back with the adapter -> base map; no model
  runs over them. Base turns are then no longer exact (the server's load benchmark measured base replies drifting
  on mapped-back caches), so it is an explicit choice.

A turn is a transaction: if it raises (out of memory, Ctrl-C, a streamer or a client that fails), the
session's ids and caches are exactly as before it and the next turn equals that of a session that never
failed.

Concurrency: PEFT's active adapter is state of the whole model, so every use of a model holds its
`models.model_lock`, one lock per model object shared by every `SharedPeftModel` and session over it:
turns of different conversations interleave but never run inside each other, and the model's adapter state
is restored after each use. Each session also has its own lock, so one conversation object may be used from
several threads.

Example:
    >>> shared = SharedPeftModel(peft_model, AdapterMaps.from_pretrained("hub_cards", "smollm2-135m-instruct",
    ...                                                                   ["shout", "docstring"]))  # doctest: +SKIP
    >>> session = AdapterSession(shared)                                                          # doctest: +SKIP
    >>> turn = session.turn(tokenizer("Hello", return_tensors="pt").input_ids, adapter="shout")  # doctest: +SKIP
    >>> turn.new_ids, turn.first_token_seconds                                                  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from transformers.generation.streamers import BaseStreamer

from ..errors import SessionError
from ..maps.adapter_maps import AdapterMaps
from ..maps.apply import map_cache
from ..maps.kvmap import KVMap
from ..modeling._compat import with_cache
from ..modeling.adapters import adapter_active, is_activated_lora, is_peft_model, model_lock
from ..modeling.capture import cache_states, forward
from ..modeling.layout import check_token_ids, layer_placements, model_device, vocab_size_of
from .cache import MappedCache

logger = logging.getLogger(__name__)

KeepBase = Literal["prefill", "reverse_map"]
KEEP_BASE: tuple[str, ...] = get_args(KeepBase)
# Where the context of a turn came from: a cache the same model built ("reused"), another model's cache mapped by a
# KVMap ("mapped"), the base model's cache reused as is by an Activated LoRA ("shared"), or nothing ("prefilled").
ContextSource = Literal["reused", "mapped", "shared", "prefilled"]
CONTEXT_SOURCES: tuple[str, ...] = get_args(ContextSource)


class SharedPeftModel:
    """A `PeftModel`, its maps and the model's lock (`models.model_lock`: every wrapper over the same model shares
    it); shared by many `AdapterSession`s.

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

    def check_adapter(self, adapter: str | None) -> None:
        """Refuse (`SessionError`) an adapter the model does not have; None is the base."""
        if adapter is not None and adapter not in self.model.peft_config:
            raise SessionError(f"unknown adapter {adapter!r}; the model has {self.adapters}")


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
    model_tokens: dict[str, int] = field(default_factory=dict)  # tokens the model ran over, per phase
    cancelled: bool = False  # generation ended early because the caller said so (nothing was kept)
    context_from: str | None = None  # "mapped" / "shared": the adapter whose cache it came from (None: the base)


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


class AdapterSession:
    """One conversation that may switch the active adapter (or the base model) at every turn.

    Invariants: ``ids`` is the whole conversation ``[1, n]``; the base cache covers ``ids[:, :k]`` for some
    ``k < n`` (the base model's own KV, or mapped back under ``keep_base="reverse_map"``); the history is
    never passed through a model again, only new tokens are.

    Args:
        shared: the shared model and maps.
        keep_base: how the base cache catches up after an adapter's turn: ``"prefill"`` (default: an exact base
            cache) or ``"reverse_map"`` (no model pass; falls back to prefill for adapters without a reverse map,
            for Activated LoRAs and for the sink).
        generation_kwargs: defaults for ``generate`` (e.g. ``max_new_tokens``, ``eos_token_id``).

    Example:
        >>> session = AdapterSession(shared, max_new_tokens=32)                             # doctest: +SKIP
        >>> session.turn(user_ids, adapter="docstring").new_ids                            # doctest: +SKIP
    """

    def __init__(self, shared: SharedPeftModel, keep_base: KeepBase = "prefill", **generation_kwargs):
        check_keep_base(keep_base)
        self.shared = shared
        self.keep_base = keep_base
        self.generation_kwargs = {"do_sample": False, "max_new_tokens": 32, **generation_kwargs}
        self.ids = torch.zeros((1, 0), dtype=torch.long)
        self._base_cache = MappedCache()
        # (adapter, its cache, where that cache's context came from) of the last adapter turn
        self._last: tuple[str, MappedCache, ContextSource] | None = None
        self._base_source: ContextSource = "reused"  # "mapped" once the base cache holds KV mapped back
        self._lock = threading.RLock()

    # ----- public API -----

    @property
    def base_cached_tokens(self) -> int:
        """How many leading tokens of the conversation the base cache covers."""
        return self._base_cache.get_seq_length()

    def turn(self, new_ids: torch.Tensor, adapter: str | None = None, streamer: BaseStreamer | None = None,
             **generation_kwargs) -> TurnResult:
        """Append ``new_ids`` (``[1, m]`` or ``[m]`` integer token ids, e.g. a templated user message) and let
        ``adapter`` (``None``: the base model) generate the reply, which is appended too. ``streamer`` receives the
        new tokens as generate() produces them.

        The history is never re-prefilled: the base cache is mapped into ``adapter``'s KV space (or reused when the
        same adapter took the last turn), and the model computes only the new tokens. If the turn raises, the
        session is left exactly as before it.

        Example:
            >>> result = session.turn(tokenizer(msg, return_tensors="pt").input_ids, adapter="shout")  # doctest: +SKIP
        """
        new_ids = self._checked_ids(new_ids, adapter)
        with self._lock, self.shared.lock, self._transaction(), torch.no_grad():
            return self._turn(new_ids, adapter, streamer, {**self.generation_kwargs, **generation_kwargs})

    def feed(self, new_ids: torch.Tensor, adapter: str | None = None) -> torch.Tensor:
        """Append ``new_ids`` without generating (a known reply, a system prompt, teacher forcing) and return
        ``adapter``'s logits ``[1, m, vocab]`` at the new tokens' positions (each predicts the token after it).

        Example:
            >>> logits = session.feed(reply_ids, adapter="docstring")   # doctest: +SKIP
        """
        new_ids = self._checked_ids(new_ids, adapter)
        with self._lock, self.shared.lock, self._transaction(), torch.no_grad():
            model = self.shared.model
            prompt = torch.cat([self.ids, new_ids], dim=1)
            cache, source, _ = self._cache_for(adapter, prompt)
            cached = cache.get_seq_length()
            with adapter_active(model, adapter):
                logits = forward(model, prompt[:, cached:], cache, position_ids=torch.arange(cached, prompt.shape[1])[None],
                                 logits_to_keep=new_ids.shape[1]).logits
            self.ids = prompt
            self._after(adapter, cache, source)
            return logits.float().cpu()

    # ----- one turn -----

    def _checked_ids(self, new_ids, adapter: str | None) -> torch.Tensor:
        self.shared.check_adapter(adapter)
        try:
            ids = check_token_ids(new_ids, vocab_size_of(self.shared.model), "new_ids", dims=(1, 2))
        except Exception as err:  # a CacheMismatchError: say it in the session's terms
            raise SessionError(f"{err}; a turn takes [1, m] or [m] integer token ids") from None
        if ids.dim() == 2 and ids.shape[0] != 1:
            raise SessionError(f"a session holds one conversation: new_ids must be [1, m] or [m], got {tuple(ids.shape)}")
        return ids.reshape(1, -1).cpu()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """Put the session back exactly as it was if the block raises (ids, which caches it holds, and each
        cache's content: `MappedCache.restore`)."""
        ids, last, base, base_source = self.ids, self._last, self._base_cache, self._base_source
        caches = [base] + ([last[1]] if last is not None else [])
        snapshots = [(cache, cache.snapshot()) for cache in caches]
        try:
            yield
        except BaseException:
            for cache, snapshot in snapshots:
                cache.restore(snapshot)
            self.ids, self._last, self._base_cache, self._base_source = ids, last, base, base_source
            raise

    def _turn(self, new_ids: torch.Tensor, adapter: str | None, streamer: BaseStreamer | None,
              generation_kwargs: dict) -> TurnResult:
        model = self.shared.model
        started = time.perf_counter()
        prompt = torch.cat([self.ids, new_ids], dim=1)
        cache, source, prepared = self._cache_for(adapter, prompt)
        prepare_seconds = time.perf_counter() - started
        cached = cache.get_seq_length()
        timer = FirstTokenTimer(started, streamer)
        with adapter_active(model, adapter):
            output = generate_on_cache(model, prompt, cache, streamer=timer, **generation_kwargs)
        generated = output[:, prompt.shape[1]:]
        tokens = {"prepare": prepared, "generate_prompt": prompt.shape[1] - cached, "generated": generated.shape[1]}
        self.ids = output
        keep_started = time.perf_counter()
        kept = self._after(adapter, cache, source)
        if kept is not None:
            tokens["keep_base"] = kept
        keep_seconds = time.perf_counter() - keep_started
        logger.debug("turn adapter=%s source=%s tokens=%s", adapter, source, tokens)
        return TurnResult(adapter, generated, prompt.shape[1], source if cached else "prefilled", cached, timer.seconds,
                          prepare_seconds, keep_seconds, tokens)

    def _after(self, adapter: str | None, cache: MappedCache, source: ContextSource) -> int | None:
        """Keep the caches of the turn just taken (and where each one's context came from: a cache that began mapped
        is mapped whenever it is continued); returns the model tokens the base catch-up cost (adapters)."""
        if adapter is None:
            self._base_cache, self._last = cache, None  # the model extended the base cache in place
            return None
        self._last = (adapter, cache, source if source in ("mapped", "shared") else "reused")
        before = self._base_cache.get_seq_length()
        spent = self._catch_up_base(adapter, cache)
        if self._base_cache.get_seq_length() - before > spent:  # tokens no model ran over: mapped back
            self._base_source = "mapped"
        return spent

    def _cache_for(self, adapter: str | None, prompt: torch.Tensor) -> tuple[MappedCache, ContextSource, int]:
        """The cache the turn starts from, what it came from, and the tokens a model ran over to build it."""
        if adapter is None:
            return self._base_cache, self._base_source, 0
        if self._last is not None and self._last[0] == adapter:
            return self._last[1], self._last[2], 0
        length = self._base_cache.get_seq_length()
        if length == 0:
            return MappedCache(), "prefilled", 0
        return cache_from_base(self.shared, adapter, self._base_cache, prompt[:, :length])

    def _catch_up_base(self, adapter: str, adapter_cache: MappedCache) -> int:
        """Bring the base cache up to ``ids[:, :-1]`` after ``adapter``'s turn; returns model tokens used."""
        return catch_up_base(self.shared, adapter, self._base_cache, adapter_cache, self.ids, self.keep_base)


# ----- the two steps every adapter switch takes, shared by sessions and the server's prefix store -----


def generate_on_cache(model: torch.nn.Module, prompt: torch.Tensor, cache: MappedCache, **generate_kwargs
                      ) -> torch.Tensor:
    """``model.generate`` over ``prompt`` (``[1, n]``, any device) continuing ``cache``; the output ids on the CPU.
    The prompt and its mask go to the model's device together (generate derives positions from the mask)."""
    ids = prompt.to(model_device(model))
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **with_cache(model, cache),
                          **generate_kwargs).cpu()


def check_keep_base(keep_base: str, error: type[Exception] = SessionError) -> None:
    """Refuse a ``keep_base`` policy that is not one of `KeepBase`."""
    if keep_base not in KEEP_BASE:
        raise error(f"keep_base must be one of {KEEP_BASE}, got {keep_base!r}")


def cache_from_base(shared: SharedPeftModel, adapter: str, base_cache: MappedCache,
                    context_ids: torch.Tensor) -> tuple[MappedCache, ContextSource, int]:
    """``adapter``'s cache of ``context_ids`` ``[1, k]`` built from the base model's cache of them (it must
    cover exactly those ``k`` tokens): reused as is for an Activated LoRA (its prefix KV *is* the base's),
    else mapped with the base -> adapter map, the adapter computing the sink itself. Returns the cache, its
    source (``"shared"`` or ``"mapped"``) and the tokens a model ran over to build it. The caller
    holds the model's lock; ``base_cache`` is read, never changed.

    Example:
        >>> cache, source, _ = cache_from_base(shared, "shout", base_cache, ids[:, :-1])   # doctest: +SKIP
        >>> model.generate(input_ids=ids, **with_cache(model, cache))                     # doctest: +SKIP
    """
    model = shared.model
    if is_activated_lora(model, adapter):
        return base_cache.copy(), "shared", 0
    kv_map = shared.map_to(adapter)
    with adapter_active(model, adapter):
        mapped = MappedCache.from_source(base_cache, kv_map, model, input_ids=context_ids)
    return mapped, "mapped", min(kv_map.config.sink_tokens, context_ids.shape[1])


def catch_up_base(shared: SharedPeftModel, adapter: str, base_cache: MappedCache, adapter_cache: MappedCache,
                  ids: torch.Tensor, keep_base: KeepBase = "prefill") -> int:
    """Extend ``base_cache`` (a prefix of ``ids`` ``[1, n]``) up to what ``adapter_cache`` covers (at most
    ``ids[:, :-1]``), in place: by the adapter -> base map from the adapter's KV of the new tokens
    (``"reverse_map"``; no model runs) or by a base pass over them (``"prefill"``, and always for Activated
    LoRAs, adapters without a reverse map and a base cache that does not hold the sink yet). Returns the
    tokens the model ran over. The caller holds the model's lock.

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
            or start < reverse.config.sink_tokens):
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


__all__ = ["CONTEXT_SOURCES", "KEEP_BASE", "AdapterSession", "ContextSource", "FirstTokenTimer", "KeepBase", "SharedPeftModel", "TurnResult",
           "cache_from_base", "catch_up_base", "check_keep_base", "generate_on_cache"]
