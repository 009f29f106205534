"""The engine that serves a request for the base model or one of its PEFT adapters from the prefix store shared by
every conversation (`store.PrefixStore`).

The chat API is stateless: each request carries the whole conversation. `PrefixEngine.run` finds the longest
token prefix of the prompt the store holds and

- reuses it when it was computed by the requested model on the exact context (``"reused"``);
- else maps the base model's cache of the longest base prefix into the requested adapter
  (`peft_kvcache.runtime.turn.cache_from_base`: ``"mapped"``; an Activated LoRA reuses it as is up to the request's
  invocation, ``"shared"``, and never its own entries: they hold its KV from another request's invocation on), or
  reuses an entry of the requested model that was itself derived from a mapped (or shared) prefix, labelled as what
  it is, never ``"reused"``;
- and prefills only the rest (all of it: ``"prefilled"``);

then takes the turn (`peft_kvcache.runtime.turn.take_turn`, the one every session takes too).

The policy for approximate caches is the reuse core's (`peft_kvcache.runtime.reuse`): every entry records how it
was made (`Made`), and a mapped prefix (or an entry derived from one) is used only where it saves
``min_mapped_tokens`` of prefill beyond the longest exact prefix (`mapping_pays`). A request may ask for exact reuse
only (``reuse="exact"``: nothing mapped or shared reaches it) or for no reuse (``"none"``). An entry derived from a
mapped prefix never replaces an exact one, so exact prefixes stay available to such requests.

After the reply it stores the adapter's cache of the whole conversation and, after an adapter's reply, the base
model's cache of it too (`catch_up_base`: reverse map or a base pass over the new tokens), so the next switch maps
from it. Entries enter the store only when a request completes, so one that fails or is cancelled leaves the store
as it was.

Example:
    >>> engine = PrefixEngine(SharedPeftModel(peft_model, maps), PrefixStore(2 * 2**30))   # doctest: +SKIP
    >>> result = engine.run("shout", prompt_ids, {"max_new_tokens": 32, "do_sample": False})  # doctest: +SKIP
    >>> result.context_source, result.cached_tokens                                        # doctest: +SKIP
    ('mapped', 412)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal, get_args

import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..modeling._compat import weights_version
from ..modeling.adapters import activated_from, is_activated_lora
from ..modeling.capture import cache_states
from ..runtime.cache import ContextCache
from ..runtime.reuse import EXACT, MIN_MAPPED_TOKENS, Made, mapping_pays
from ..runtime.turn import KeepBase, SharedPeftModel, Start, TurnResult, cache_from_base, catch_up_base, take_turn
from .errors import ServerError
from .store import PrefixStore

logger = logging.getLogger(__name__)

# What a server reuses across requests: "map" (this library: exact reuse, or the base cache mapped into an
# adapter), "exact" (a prefix cache keyed by adapter, what vLLM / SGLang do today), "none" (prefill every time).
# A request may ask for a stricter mode than the server's (never a looser one).
Reuse = Literal["map", "exact", "none"]
REUSE_MODES: tuple[str, ...] = get_args(Reuse)
DEFAULT_MIN_MAPPED_TOKENS = MIN_MAPPED_TOKENS["transformers"]


class _StopWhen(StoppingCriteria):
    def __init__(self, should_stop: Callable[[], bool]):
        self.should_stop = should_stop

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), bool(self.should_stop()), dtype=torch.bool, device=input_ids.device)


def stricter(*modes: Reuse | None) -> Reuse:
    """The strictest of reuse modes (``"none"`` < ``"exact"`` < ``"map"``; None: no say)."""
    return min((m for m in modes if m is not None), key=REUSE_MODES[::-1].index, default="map")


class PrefixEngine:
    """Serves generation requests for any adapter of a `SharedPeftModel` from a `PrefixStore` (see the module).

    Args:
        shared: the PEFT model, its maps and its lock (every model use holds it).
        store: the prefix store (one per model).
        reuse: ``"map"`` (default), ``"exact"`` (reuse only caches of the same adapter) or ``"none"``.
        keep_base: how the base cache catches up after an adapter's reply (`catch_up_base`): ``"prefill"``
            (default: a base pass over the new tokens, after the reply is delivered; base requests stay exact and
            every switch maps from an exact base cache) or ``"reverse_map"`` (no model pass; base requests then
            run on mapped-back caches, as good as the reverse maps are, and are labelled mapped).
        min_mapped_tokens: the least prefill a mapped prefix (or an entry derived from one) must save beyond the
            longest exact prefix to be used (`DEFAULT_MIN_MAPPED_TOKENS`); shorter ones are prefilled exactly.

    Example:
        >>> engine = PrefixEngine(shared, PrefixStore(2**30), reuse="map")               # doctest: +SKIP
        >>> engine.run(None, prompt_ids, {"max_new_tokens": 16, "do_sample": False}).context_source  # doctest: +SKIP
        'prefilled'
    """

    def __init__(self, shared: SharedPeftModel, store: PrefixStore, reuse: Reuse = "map",
                 keep_base: KeepBase = "prefill", min_mapped_tokens: int = DEFAULT_MIN_MAPPED_TOKENS):
        from ..runtime.turn import KEEP_BASE

        if reuse not in REUSE_MODES:
            raise ServerError(f"reuse must be one of {REUSE_MODES}, got {reuse!r}")
        if keep_base not in KEEP_BASE:
            raise ServerError(f"keep_base must be one of {KEEP_BASE}, got {keep_base!r}")
        if not isinstance(min_mapped_tokens, int) or min_mapped_tokens < 0:
            raise ServerError(f"min_mapped_tokens must be a non-negative number of tokens, got {min_mapped_tokens!r}")
        self.shared, self.store, self.reuse, self.keep_base = shared, store, reuse, keep_base
        self.min_mapped_tokens = min_mapped_tokens
        self._weights: tuple | None = None  # the model's weights version when the store was last filled

    def _drop_entries_of_other_weights(self) -> None:
        """Empty the store where the model's weights changed since the last request (an adapter loaded again under its
        name, weights written in place: `weights_version`): its entries were computed with the old ones."""
        version = weights_version(self.shared.model)
        if self._weights is not None and version != self._weights and len(self.store):
            logger.warning("the model's weights changed since the last request: the prefix store's %d entries were "
                           "computed with the old ones and are dropped", len(self.store))
            self.store.clear()
        self._weights = version

    def run(self, adapter: str | None, prompt_ids: torch.Tensor, generation_kwargs: dict, *,
            streamer: BaseStreamer | None = None, should_stop: Callable[[], bool] | None = None,
            cancelled: Callable[[], bool] | None = None, started: float | None = None, seed: int | None = None,
            reuse: Reuse | None = None, on_prepared: Callable[[Made, int], None] | None = None,
            on_generated: Callable[[TurnResult], None] | None = None) -> TurnResult:
        """Generate ``adapter``'s reply to ``prompt_ids`` ``[n]`` from the longest cached prefix.

        ``streamer`` receives the tokens as generate() makes them; ``should_stop`` is polled after each token
        (a stop string was generated); ``cancelled`` too, and a cancelled request stores nothing (its client went
        away); ``started`` (a ``time.perf_counter()`` value, default now) is where the
        first-token time counts from; ``seed`` seeds sampling; ``reuse`` is the request's own reuse mode (the
        stricter of it and the engine's applies: ``"exact"`` never gets a mapped or shared cache).
        ``on_prepared(made, cached_tokens)`` is called once the cache is chosen (before generation),
        ``on_generated`` is called with the result as soon as the reply is complete, before the store
        is updated (the model's lock is still held, so the next request sees the updated store). If generation
        raises, the store is left as it was.
        """
        self.shared.check_adapter(adapter)
        started = time.perf_counter() if started is None else started
        prompt = prompt_ids.reshape(1, -1).cpu()
        criteria = StoppingCriteriaList([_StopWhen(f) for f in (should_stop, cancelled) if f is not None])
        with self.shared.lock, torch.no_grad():
            self._drop_entries_of_other_weights()
            start = self._start(adapter, prompt, stricter(self.reuse, reuse))
            if on_prepared is not None:
                on_prepared(start.made, start.cached_tokens)
            result, output = take_turn(self.shared, adapter, prompt, start, generation_kwargs, started=started,
                                       streamer=streamer, stopping_criteria=criteria, seed=seed)
            result.cancelled = cancelled is not None and bool(cancelled())
            if on_generated is not None:
                on_generated(result)
            if not result.cancelled:
                keep_started = time.perf_counter()
                result.model_tokens["keep_base"] = self._keep(adapter, output, start.cache, start.made)
                result.keep_seconds = time.perf_counter() - keep_started
        logger.debug("request adapter=%s source=%s cached=%d tokens=%s", adapter, result.context_source,
                     result.cached_tokens, result.model_tokens)
        return result

    def _start(self, adapter: str | None, prompt: torch.Tensor, reuse: Reuse) -> Start:
        """The cache the request starts from. The longest prefix wins among the exact one of this model, an entry of
        this model derived from a mapped or shared prefix, and the base model's prefix mapped (or shared) into the
        adapter; an approximate one only where the policy allows it (see the module). At equal length: exact, then a
        stored entry, then mapping."""
        limit = prompt.shape[1] - 1  # generate() must compute at least the last prompt token
        if reuse == "none" or limit <= 0:
            return Start(ContextCache())
        ids = prompt[0]
        # an Activated LoRA's own entries hold its KV from another request's invocation on: it starts from the base's
        # KV only, up to this request's invocation
        activated = activated_from(self.shared.model, adapter, ids)
        own_entries = activated is None
        limit = limit if own_entries else min(limit, activated)
        own, exact_length = self.store.longest(adapter, ids, limit, exact=True) if own_entries else (None, 0)
        best, best_length = own, exact_length
        if reuse == "map" and limit > 0:
            derived, length = self.store.longest(adapter, ids, limit) if own_entries else (None, 0)
            if length > best_length and mapping_pays(derived.made, length - exact_length, self.min_mapped_tokens):
                best, best_length = derived, length
            if adapter is not None and self.shared.mappable(adapter):
                base, base_length = self.store.longest(None, ids, limit)
                if base_length > best_length and self._pays_from_base(adapter, base.made, base_length, exact_length):
                    self.store.touch(base)
                    return cache_from_base(self.shared, adapter, ContextCache(base.kv.prefix(base_length)),
                                           prompt[:, :base_length], base.made.cut(base_length))
        if best is None:
            return Start(ContextCache())
        self.store.touch(best)
        return Start(ContextCache(best.kv.prefix(best_length)), best.made.cut(best_length))

    def _pays_from_base(self, adapter: str, base_made: Made, length: int, exact_length: int) -> bool:
        """Whether the base's prefix of ``length`` tokens may serve ``adapter`` (mapped, or shared as is by an
        Activated LoRA: exact when the base prefix is)."""
        shared_exactly = is_activated_lora(self.shared.model, adapter) and base_made.exact
        made = Made("shared", None, length) if shared_exactly else base_made.mapped_again(length)
        return mapping_pays(made, length - exact_length, self.min_mapped_tokens)

    def _keep(self, adapter: str | None, output: torch.Tensor, cache: ContextCache, made: Made) -> int:
        """Store the reply's cache (and the base's, after an adapter's reply); returns the model tokens spent."""
        if self.reuse == "none":
            return 0
        covered = cache.get_seq_length()  # the conversation but its last token
        # a cache holding only some positions (an index recipe) is not a prefix's KV; an Activated LoRA's serves only
        # requests of the same last invocation (never looked up: they recompute a few tokens)
        if not cache.dropped_positions and not (adapter is not None and is_activated_lora(self.shared.model, adapter)):
            self.store.add(adapter, output[0, :covered], cache_states(cache), made if covered else EXACT)
        if self.reuse != "map" or adapter is None:
            return 0
        base, length = self.store.longest(None, output[0], covered)
        base_cache = ContextCache() if base is None else ContextCache(base.kv.prefix(length))
        spent = catch_up_base(self.shared, adapter, base_cache, cache, output, self.keep_base)
        kept = base_cache.get_seq_length()
        if kept > length:
            base_made = EXACT if base is None else base.made.cut(length)
            # the tokens no model ran over were mapped back from the adapter's cache (keep_base="reverse_map")
            self.store.add(None, output[0, :kept], cache_states(base_cache), base_made.then(adapter, kept - length - spent))
        return spent


__all__ = ["DEFAULT_MIN_MAPPED_TOKENS", "PrefixEngine", "REUSE_MODES", "Reuse", "stricter"]
