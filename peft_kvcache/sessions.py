"""Adapter-switching conversations: a session holds one conversation's token ids and caches, and switches
the active PEFT adapter (or the base model) per turn without ever re-prefilling the history: it maps the
base cache it holds into the next adapter's KV space (`MappedCache.from_source`, the target computing the
attention sink itself).

State kept per session, so that any adapter can take the next turn:

- a **base cache**, always: the base model's KV of the history (all but the last token);
- the cache of the adapter that took the last turn, reused as is when the same adapter continues.

After an adapter's turn the base cache must catch up with the new tokens (the user message and the
reply). Two policies (``keep_base=``), measured by benchmarks/adapters.py on SmolLM2-135M-Instruct (an
8-turn chat switching docstring/shout/base; KL(full prefill || session) per turn, 2 CPU threads):

- ``"reverse_map"`` (default): the adapter's KV of the new tokens is mapped back with the adapter -> base
  map: 0.024 s for 96 new tokens after 1k of history. Mean KL 0.0160, top-1 agreement 0.959; adapter turns
  after the first switch come out *better* than with an exact base cache (the round trip adapter -> base ->
  adapter keeps what the adapter computed), but base turns are no longer exact.
- ``"prefill"``: the base model runs over just the new tokens, attending to its own cache: 0.47 s for the
  same 96 tokens (19x more). Exact base cache (base turns KL 0), mean KL 0.0187, top-1 agreement 0.960;
  no error can compound over a long conversation. Choose it when base turns must be exact.

Concurrency: PEFT's active adapter is global state of the model, so every use of a model goes through
`SharedPeftModel.lock`, one lock shared by all sessions of that model: sessions run their model work one at
a time (turns of different conversations interleave, they never run inside each other). Each session also
has its own lock, so one conversation object may be used from several threads. PEFT's per-row
``adapter_names=`` batching is not used here.

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
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.streamers import BaseStreamer

from .apply import map_cache
from .cache import MappedCache
from .capture import NO_LOGITS, cache_states
from .errors import PeftKVCacheError
from .models import layer_placements
from .peft_maps import AdapterMaps, adapter_active, is_activated_lora

logger = logging.getLogger(__name__)

KeepBase = Literal["prefill", "reverse_map"]


class SessionError(PeftKVCacheError, ValueError):
    """A session was asked for something it cannot do (unknown adapter, missing map, empty turn)."""


class SharedPeftModel:
    """A `PeftModel`, its maps and the lock that serializes its use; shared by many `AdapterSession`s.

    Example:
        >>> shared = SharedPeftModel(peft_model, maps)        # doctest: +SKIP
        >>> sessions = [AdapterSession(shared) for _ in range(8)]   # doctest: +SKIP
    """

    def __init__(self, model: torch.nn.Module, maps: AdapterMaps):
        if not hasattr(model, "peft_config"):
            raise SessionError(f"SharedPeftModel needs a PeftModel, got {type(model).__name__}")
        self.model = model
        self.maps = maps
        self.lock = threading.RLock()

    @property
    def adapters(self) -> list[str]:
        return list(self.model.peft_config)

    def map_to(self, adapter: str):
        """The base -> ``adapter`` map (`SessionError` if there is none)."""
        if adapter not in self.maps.to_adapter:
            raise SessionError(f"no base -> {adapter!r} map; maps exist for {sorted(self.maps.to_adapter)}")
        return self.maps.to_adapter[adapter]


@dataclass
class TurnResult:
    """What one turn did: the generated ids and where the time went."""

    adapter: str | None
    new_ids: torch.Tensor  # [1, generated]
    first_token_seconds: float  # from the call to the first generated token (cache preparation included)
    prepare_seconds: float  # mapping (or nothing, when the cache was reused)
    keep_seconds: float  # bringing the base cache up to date after the turn
    cache_source: str  # "base" | "mapped" | "same_adapter" | "activated_lora"
    model_tokens: dict[str, int] = field(default_factory=dict)  # tokens the model ran over, per phase


class FirstTokenTimer(BaseStreamer):
    """A generate() streamer that records the seconds from ``started`` to the first new token (the first
    put() is the prompt).

    Example:
        >>> timer = FirstTokenTimer(time.perf_counter())                          # doctest: +SKIP
        >>> model.generate(input_ids, streamer=timer); timer.seconds               # doctest: +SKIP
    """

    def __init__(self, started: float):
        self.started, self.seconds, self._puts = started, float("nan"), 0

    def put(self, value) -> None:
        self._puts += 1
        if self._puts == 2:
            self.seconds = time.perf_counter() - self.started

    def end(self) -> None:
        pass


class AdapterSession:
    """One conversation that may switch the active adapter (or the base model) at every turn.

    Invariants: ``ids`` is the whole conversation ``[1, n]``; the base cache covers ``ids[:, :k]`` for some
    ``k < n`` (the base model's own KV, or mapped back under ``keep_base="reverse_map"``); the history is
    never passed through a model again, only new tokens are.

    Args:
        shared: the shared model and maps.
        keep_base: how the base cache catches up after an adapter's turn: ``"reverse_map"`` (default; falls
            back to prefill for adapters without a reverse map, for Activated LoRAs and for the sink) or
            ``"prefill"`` (exact base cache).
        generation_kwargs: defaults for ``generate`` (e.g. ``max_new_tokens``, ``eos_token_id``).

    Example:
        >>> session = AdapterSession(shared, max_new_tokens=32)                             # doctest: +SKIP
        >>> session.turn(user_ids, adapter="docstring").new_ids                            # doctest: +SKIP
    """

    def __init__(self, shared: SharedPeftModel, keep_base: KeepBase = "reverse_map", **generation_kwargs):
        if keep_base not in ("prefill", "reverse_map"):
            raise SessionError(f"keep_base must be 'prefill' or 'reverse_map', got {keep_base!r}")
        self.shared = shared
        self.keep_base = keep_base
        self.generation_kwargs = {"do_sample": False, "max_new_tokens": 32, **generation_kwargs}
        self.ids = torch.zeros((1, 0), dtype=torch.long)
        self._base_cache = DynamicCache()
        self._last: tuple[str, DynamicCache] | None = None  # (adapter, its cache) of the last adapter turn
        self._lock = threading.RLock()

    # ----- public API -----

    @property
    def base_cached_tokens(self) -> int:
        """How many leading tokens of the conversation the base cache covers."""
        return self._base_cache.get_seq_length()

    def turn(self, new_ids: torch.Tensor, adapter: str | None = None, **generation_kwargs) -> TurnResult:
        """Append ``new_ids`` (``[1, m]`` or ``[m]``, e.g. a templated user message) and let ``adapter`` (``None``:
        the base model) generate the reply, which is appended too.

        The history is never re-prefilled: the base cache is mapped into ``adapter``'s KV space (or reused
        when the same adapter took the last turn), and the model computes only the new tokens.

        Example:
            >>> result = session.turn(tokenizer(msg, return_tensors="pt").input_ids, adapter="shout")  # doctest: +SKIP
        """
        new_ids = torch.as_tensor(new_ids, dtype=torch.long).reshape(1, -1).cpu()
        if new_ids.numel() == 0:
            raise SessionError("a turn needs at least one new token")
        if adapter is not None and adapter not in self.shared.adapters:
            raise SessionError(f"unknown adapter {adapter!r}; the model has {self.shared.adapters}")
        with self._lock, self.shared.lock:
            return self._turn(new_ids, adapter, {**self.generation_kwargs, **generation_kwargs})

    def feed(self, new_ids: torch.Tensor, adapter: str | None = None) -> torch.Tensor:
        """Append ``new_ids`` without generating (a known reply, a system prompt, teacher forcing) and return
        ``adapter``'s logits ``[1, m, vocab]`` at the new tokens' positions (each predicts the token after it).

        Example:
            >>> logits = session.feed(reply_ids, adapter="docstring")   # doctest: +SKIP
        """
        new_ids = torch.as_tensor(new_ids, dtype=torch.long).reshape(1, -1).cpu()
        if new_ids.numel() == 0:
            raise SessionError("feed needs at least one new token")
        if adapter is not None and adapter not in self.shared.adapters:
            raise SessionError(f"unknown adapter {adapter!r}; the model has {self.shared.adapters}")
        with self._lock, self.shared.lock, torch.no_grad():
            model = self.shared.model
            prompt = torch.cat([self.ids, new_ids], dim=1)
            cache, _, _ = self._cache_for(adapter, prompt)
            cached, device = cache.get_seq_length(), _device(model)
            with adapter_active(model, adapter):
                logits = model(input_ids=prompt[:, cached:].to(device),
                               position_ids=torch.arange(cached, prompt.shape[1])[None].to(device),
                               past_key_values=cache, use_cache=True).logits[:, -new_ids.shape[1]:]
            self.ids = prompt
            if adapter is None:
                self._base_cache, self._last = cache, None
            else:
                self._last = (adapter, cache)
                self._catch_up_base(adapter, cache)
            return logits.float().cpu()

    def reset(self) -> None:
        """Forget the conversation."""
        with self._lock:
            self.ids = torch.zeros((1, 0), dtype=torch.long)
            self._base_cache, self._last = DynamicCache(), None

    # ----- one turn -----

    @torch.no_grad()
    def _turn(self, new_ids: torch.Tensor, adapter: str | None, generation_kwargs: dict) -> TurnResult:
        model = self.shared.model
        started = time.perf_counter()
        prompt = torch.cat([self.ids, new_ids], dim=1)
        cache, source, prepared = self._cache_for(adapter, prompt)
        prepare_seconds = time.perf_counter() - started
        cached = cache.get_seq_length()
        streamer = FirstTokenTimer(started)
        with adapter_active(model, adapter):
            output = model.generate(input_ids=prompt.to(_device(model)), attention_mask=torch.ones_like(prompt),
                                    past_key_values=cache, streamer=streamer, **generation_kwargs)
        output = output.cpu()
        generated = output[:, prompt.shape[1]:]
        tokens = {"prepare": prepared, "generate_prompt": prompt.shape[1] - cached, "generated": generated.shape[1]}
        self.ids = output
        keep_started = time.perf_counter()
        if adapter is None:
            self._base_cache, self._last = cache, None  # generate extended the base cache in place
        else:
            self._last = (adapter, cache)
            tokens["keep_base"] = self._catch_up_base(adapter, cache)
        keep_seconds = time.perf_counter() - keep_started
        logger.debug("turn adapter=%s source=%s tokens=%s", adapter, source, tokens)
        return TurnResult(adapter, generated, streamer.seconds, prepare_seconds, keep_seconds, source, tokens)

    def _cache_for(self, adapter: str | None, prompt: torch.Tensor) -> tuple[DynamicCache, str, int]:
        """The cache the turn starts from, what it came from, and the tokens a model ran over to build it."""
        if adapter is None:
            return self._base_cache, "base", 0
        if self._last is not None and self._last[0] == adapter:
            return self._last[1], "same_adapter", 0
        length = self._base_cache.get_seq_length()
        if length == 0:
            return DynamicCache(), "empty", 0
        model = self.shared.model
        if is_activated_lora(model, adapter):
            return _copy(self._base_cache), "activated_lora", 0  # the base prefix KV is the aLoRA's exactly
        kv_map = self.shared.map_to(adapter)
        with adapter_active(model, adapter):
            sink = kv_map.config.sink_tokens
            mapped = MappedCache.from_source(self._base_cache, kv_map, model, input_ids=prompt[:, :length])
        return mapped, "mapped", min(sink, length)

    def _catch_up_base(self, adapter: str, adapter_cache: DynamicCache) -> int:
        """Bring the base cache up to ``ids[:, :-1]`` after ``adapter``'s turn; returns model tokens used."""
        start, end = self._base_cache.get_seq_length(), min(self.ids.shape[1], adapter_cache.get_seq_length())
        if end <= start:
            return 0
        model = self.shared.model
        reverse = self.shared.maps.to_base.get(adapter)
        # The sink is always the base model's own: mapping it back would cost the most quality.
        if (self.keep_base == "prefill" or reverse is None or is_activated_lora(model, adapter)
                or start < reverse.config.sink_tokens):
            with adapter_active(model, None):
                model(input_ids=self.ids[:, start:end].to(_device(model)),
                      position_ids=torch.arange(start, end)[None].to(_device(model)),
                      past_key_values=self._base_cache, use_cache=True, logits_to_keep=NO_LOGITS)
            return end - start
        captured = cache_states(adapter_cache)
        positions = torch.arange(start, end)[None]
        mapped = map_cache(reverse, [k[:, :, start:end] for k in captured.keys],
                           [v[:, :, start:end] for v in captured.values], positions, positions,
                           layer_placements(model))
        for layer, (keys, values) in enumerate(mapped):
            self._base_cache.update(keys, values, layer)
        return 0


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _copy(cache: DynamicCache) -> DynamicCache:
    captured = cache_states(cache)
    return DynamicCache([(k.clone(), v.clone()) for k, v in zip(captured.keys, captured.values)])


__all__ = ["AdapterSession", "SharedPeftModel", "SessionError", "TurnResult", "KeepBase", "FirstTokenTimer"]
