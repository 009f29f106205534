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
`peft_kvcache.modeling.adapters.model_lock`, one lock per model object shared by every `SharedPeftModel` and session over it:
turns of different conversations interleave but never run inside each other, and the model's adapter state
is restored after each use. Each session also has its own lock, so one conversation object may be used from
several threads.

Example:
    >>> shared = SharedPeftModel(peft_model, AdapterMaps.from_pretrained("hub_cards", peft_model))  # doctest: +SKIP
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

import torch
from transformers.generation.streamers import BaseStreamer

from ..errors import CacheMismatchError, SessionError
from ..modeling._compat import weights_version
from ..modeling.adapters import activated_from, adapter_active
from ..modeling.capture import forward
from ..modeling.layout import check_token_ids, vocab_size_of
from .cache import ContextCache
from .reuse import EXACT, Made
from .turn import (
    KeepBase,
    SharedPeftModel,
    Start,
    TurnResult,
    cache_from_base,
    catch_up_base,
    check_keep_base,
    take_turn,
)

logger = logging.getLogger(__name__)


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
        self.generation_kwargs = _one_reply({"do_sample": False, "max_new_tokens": 32, **generation_kwargs})
        self.ids = torch.zeros((1, 0), dtype=torch.long)
        self._base_cache = ContextCache()
        self._base_made: Made = EXACT  # how the base cache was made (mapped back from an adapter, under reverse_map)
        # (adapter, its cache, how that cache was made) of the last adapter turn
        self._last: tuple[str, ContextCache, Made] | None = None
        self._weights: tuple | None = None  # the model's weights version the caches were computed with
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
        generation = _one_reply({**self.generation_kwargs, **generation_kwargs})
        with self._lock, self.shared.lock, self._transaction(), torch.no_grad():
            started = time.perf_counter()
            prompt = torch.cat([self.ids, new_ids], dim=1)
            start = self._start(adapter, prompt)
            result, output = take_turn(self.shared, adapter, prompt, start, generation, started=started,
                                       streamer=streamer)
            self.ids = output
            keep_started = time.perf_counter()
            result.model_tokens["keep_base"] = self._after(adapter, start.cache, start.made)
            result.keep_seconds = time.perf_counter() - keep_started
            logger.debug("turn adapter=%s source=%s tokens=%s", adapter, result.context_source, result.model_tokens)
            return result

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
            start = self._start(adapter, prompt)
            cached = start.cached_tokens
            with adapter_active(model, adapter):
                logits = forward(model, prompt[:, cached:], start.cache,
                                 position_ids=torch.arange(cached, prompt.shape[1])[None],
                                 logits_to_keep=new_ids.shape[1]).logits
            self.ids = prompt
            self._after(adapter, start.cache, start.made)
            return logits.float().cpu()

    # ----- one turn -----

    def _checked_ids(self, new_ids, adapter: str | None) -> torch.Tensor:
        self.shared.check_adapter(adapter)
        try:
            ids = check_token_ids(new_ids, vocab_size_of(self.shared.model), "new_ids", dims=(1, 2))
        except CacheMismatchError as err:  # say it in the session's terms
            raise SessionError(f"{err}; a turn takes [1, m] or [m] integer token ids") from None
        if ids.dim() == 2 and ids.shape[0] != 1:
            raise SessionError(f"a session holds one conversation: new_ids must be [1, m] or [m], got {tuple(ids.shape)}")
        return ids.reshape(1, -1).cpu()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """Put the session back exactly as it was if the block raises (ids, which caches it holds, and each
        cache's content: `ContextCache.restore`)."""
        ids, last, base, base_made, weights = self.ids, self._last, self._base_cache, self._base_made, self._weights
        caches = [base] + ([last[1]] if last is not None else [])
        snapshots = [(cache, cache.snapshot()) for cache in caches]
        try:
            yield
        except BaseException:
            for cache, snapshot in snapshots:
                cache.restore(snapshot)
            self.ids, self._last, self._base_cache, self._base_made, self._weights = ids, last, base, base_made, weights
            raise

    def _forget_old_weights(self) -> None:
        """Drop the caches where the model's weights changed since they were computed (an adapter loaded again under
        its name, weights written in place): they hold the old weights' KV, and the next turn prefills the
        conversation."""
        now = weights_version(self.shared.model)
        if self._weights is not None and now != self._weights and (self._last or self._base_cache.get_seq_length()):
            logger.warning("the model's weights changed since this session's caches were computed: they are dropped "
                           "and the next turn prefills the conversation (%d tokens)", self.ids.shape[1])
            self._base_cache, self._base_made, self._last = ContextCache(), EXACT, None
        self._weights = now

    def _start(self, adapter: str | None, prompt: torch.Tensor) -> Start:
        """The cache the turn starts from: the base cache (base turns), the adapter's own (it took the last turn), or
        the base cache mapped (or shared) into the adapter."""
        self._forget_old_weights()
        if adapter is None:
            return Start(self._base_cache, self._base_made)
        # an Activated LoRA's own cache holds its KV from its last turn's invocation on: this turn shares the base's
        # KV up to its own invocation instead
        activated = activated_from(self.shared.model, adapter, prompt[0])
        if self._last is not None and self._last[0] == adapter and activated is None:
            return Start(self._last[1], self._last[2])
        length = self._base_cache.get_seq_length()
        if activated is not None:
            length = min(length, activated)
        if length == 0:
            return Start(ContextCache())
        return cache_from_base(self.shared, adapter, self._base_cache, prompt[:, :length], self._base_made)

    def _after(self, adapter: str | None, cache: ContextCache, made: Made) -> int:
        """Keep the caches of the turn just taken (and how each was made: a cache that began mapped is mapped
        whenever it is continued); returns the model tokens the base catch-up cost (none after a base turn)."""
        if adapter is None:
            self._base_cache, self._last = cache, None  # the model extended the base cache in place
            self._base_made = made if cache.get_seq_length() else EXACT
            return 0
        self._last = (adapter, cache, made)
        before = self._base_cache.get_seq_length()
        spent = catch_up_base(self.shared, adapter, self._base_cache, cache, self.ids, self.keep_base)
        mapped_back = self._base_cache.get_seq_length() - before - spent  # tokens no model ran over
        self._base_made = self._base_made.then(adapter, mapped_back)
        return spent


def _one_reply(generation_kwargs: dict) -> dict:
    """``generation_kwargs``, refused (`SessionError`) where they ask for more than one reply: a session continues one
    conversation, and the turn's timing streamer cannot follow a beam search."""
    for name in ("num_return_sequences", "num_beams"):
        value = generation_kwargs.get(name)
        if value is not None and value != 1:
            raise SessionError(f"{name}={value!r}: a session continues one conversation with one reply per turn; "
                               f"leave {name} at 1")
    owned = sorted(SESSION_OWNED.intersection(generation_kwargs))
    if owned:  # before any model runs: generate() would take them twice, or return what a turn cannot read
        raise SessionError(f"{', '.join(owned)}: the session passes the conversation, its cache and mask itself "
                           "(a streamer goes to turn(streamer=...)); leave them out of the generation arguments")
    return generation_kwargs


SESSION_OWNED = frozenset({"input_ids", "attention_mask", "cache", "past_key_values", "position_ids", "streamer",
                           "return_dict_in_generate", "inputs"})


__all__ = ["AdapterSession"]
