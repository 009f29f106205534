"""A token-prefix KV store shared by every conversation of a server, and the engine that serves a request for
the base model or one of its PEFT adapters from it.

The chat API is stateless: each request carries the whole conversation. `PrefixEngine.run` finds the longest
token prefix of the prompt the store holds and

- reuses it when it was computed by the requested model on the exact context (``"reused"``: as exact as a
  prefill);
- else maps the base model's cache of the longest base prefix into the requested adapter
  (`sessions.cache_from_base`, ``"mapped"``; an Activated LoRA reuses the base prefix as is, ``"shared"``), or
  reuses an entry of the requested model that was itself derived from a mapped (or shared) prefix, labelled as
  what it is (``"mapped"`` / ``"shared"``, never ``"reused"``);
- and prefills only the rest (all of it: ``"prefilled"``).

The policy for approximate caches. Every entry records how it was made (`Made`): computed by its own model on
the exact context, or derived from a prefix of which model, mapped or shared, of how many tokens. A mapped cache
is only offered where it pays: mapping a prefix (or reusing an entry derived from a mapped one) must save at least
``min_mapped_tokens`` of prefill beyond the longest exact prefix (`DEFAULT_MIN_MAPPED_TOKENS`, measured by
``benchmarks/map_threshold.py``), so short shared boilerplate such as a chat template's system prompt is always
prefilled exactly and a conversation's first turn never depends on what other conversations did. A request may ask
for exact reuse only (``reuse="exact"``: nothing mapped or shared reaches it) or for no reuse (``"none"``). An
entry derived from a mapped prefix never replaces an exact one, so exact prefixes stay available to such requests.

After the reply it stores the adapter's cache of the whole conversation and, after an adapter's reply, the base
model's cache of it too (`sessions.catch_up_base`: reverse map or a base pass over the new tokens), so the next
switch maps from it. Entries are read through fresh caches built from slices of their tensors: generate()
extends a cache by rebinding each layer to a new tensor, so an entry is never written. Entries enter
the store only when a request completes, so one that fails or is cancelled leaves the store as it was.

Memory is bounded (bytes of the entries' tensors) with least-recently-used eviction; an entry is keyed by
its adapter and is never served to another one.

Example:
    >>> engine = PrefixEngine(SharedPeftModel(peft_model, maps), PrefixStore(2 * 2**30))   # doctest: +SKIP
    >>> result = engine.run("shout", prompt_ids, {"max_new_tokens": 32, "do_sample": False})  # doctest: +SKIP
    >>> result.context_source, result.cached_tokens                                        # doctest: +SKIP
    ('mapped', 412)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..errors import ServerError
from ..modeling.adapters import adapter_active, is_activated_lora
from ..modeling.capture import CapturedKV, cache_states
from ..runtime.cache import MappedCache
from ..runtime.sessions import (
    ContextSource,
    FirstTokenTimer,
    KeepBase,
    SharedPeftModel,
    TurnResult,
    cache_from_base,
    catch_up_base,
    check_keep_base,
    generate_on_cache,
)

logger = logging.getLogger(__name__)

# What a server reuses across requests: "map" (this library: exact reuse, or the base cache mapped into an
# adapter), "exact" (a prefix cache keyed by adapter, what vLLM / SGLang do today), "none" (prefill every time).
# A request may ask for a stricter mode than the server's (never a looser one).
Reuse = Literal["map", "exact", "none"]
REUSE_MODES: tuple[str, ...] = get_args(Reuse)
# Below this many tokens of prefill saved, a prefix is not mapped (nor an entry derived from a mapped one reused):
# the smallest mapped prefix whose switch takes at most half the time to first token of prefilling it, on SmolLM2
# with the committed adapters and published maps (benchmarks/map_threshold.py ->
# benchmarks/results/map-threshold.json, whose "recommended_min_mapped_tokens" this must equal).
DEFAULT_MIN_MAPPED_TOKENS = 256

How = Literal["exact", "mapped", "shared"]


@dataclass(frozen=True)
class Made:
    """How a cache was made: ``"exact"`` (its own model computed every token on the exact context), or derived
    from ``tokens`` tokens of ``source``'s cache (``None``: the base model) ``"mapped"`` by a KVMap or
    ``"shared"`` as is (an Activated LoRA). The tokens a model computes on top of a derived prefix attend to it,
    so a cache that extends a derived one is derived too.

    Example:
        >>> Made("mapped", None, 300).cut(120)
        Made(how='mapped', source=None, tokens=120)
        >>> Made().exact, Made().then("shout", 40)
        (True, Made(how='mapped', source='shout', tokens=40))
    """

    how: How = "exact"
    source: str | None = None
    tokens: int = 0

    @property
    def exact(self) -> bool:
        return self.how == "exact"

    def cut(self, length: int) -> "Made":
        """How the first ``length`` tokens of a cache made this way were made."""
        return self if self.exact else replace(self, tokens=min(self.tokens, length))

    def then(self, source: str | None, mapped_tokens: int) -> "Made":
        """A cache made this way, extended by ``mapped_tokens`` tokens mapped from ``source``'s cache (none: as
        before). A derived cache keeps the model it was first derived from."""
        if mapped_tokens <= 0:
            return self
        if self.exact:
            return Made("mapped", source, mapped_tokens)
        return replace(self, how="mapped", tokens=self.tokens + mapped_tokens)


EXACT = Made()


@dataclass
class Entry:
    """One stored cache: ``adapter``'s KV (``None``: the base model) of the tokens ``ids``, made as ``made`` says."""

    adapter: str | None
    ids: torch.Tensor  # [n] token ids
    kv: CapturedKV  # per layer [1, kv_heads, n, head_dim]
    nbytes: int
    made: Made = EXACT


class PrefixStore:
    """Caches of token prefixes per adapter (or the base model), bounded to ``max_bytes`` with LRU eviction; thread-safe.

    Example:
        >>> store = PrefixStore(max_bytes=2**20)
        >>> kv = CapturedKV([torch.zeros(1, 1, 3, 2)], [torch.zeros(1, 1, 3, 2)])
        >>> store.add("shout", torch.tensor([5, 6, 7]), kv, Made("mapped", None, 3))
        True
        >>> entry, k = store.longest("shout", torch.tensor([5, 6, 9, 9]), limit=3); k, entry.made.how
        (2, 'mapped')
        >>> store.longest("shout", torch.tensor([5, 6, 9, 9]), limit=3, exact=True)[1]   # only exact entries
        0
        >>> store.longest(None, torch.tensor([5, 6, 9, 9]), limit=3)[1]   # never served to another adapter
        0
    """

    def __init__(self, max_bytes: int):
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ServerError(f"the prefix store needs a positive memory bound in bytes, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.evictions = 0
        self._entries: OrderedDict[tuple, Entry] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.RLock()

    @property
    def nbytes(self) -> int:
        """Bytes the stored caches hold."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, adapter: str | None, ids: torch.Tensor, limit: int, exact: bool = False
                ) -> tuple[Entry | None, int]:
        """The entry of ``adapter`` sharing the longest prefix with ``ids`` ``[n]`` and that prefix's length
        (at most ``limit``); ``exact``: among the exact entries only. At equal length an exact entry is preferred.
        ``(None, 0)`` when none shares a token."""
        best, best_length = None, 0
        with self._lock:
            for entry in self._entries.values():
                if entry.adapter != adapter or (exact and not entry.made.exact):
                    continue
                m = min(entry.ids.shape[0], ids.shape[0], limit)
                differ = (entry.ids[:m] != ids[:m]).nonzero()
                length = int(differ[0, 0]) if differ.numel() else m
                if length > best_length or (length == best_length > 0 and entry.made.exact and not best.made.exact):
                    best, best_length = entry, length
        return best, best_length

    def touch(self, entry: Entry) -> None:
        """Mark ``entry`` as just used (it is evicted last)."""
        with self._lock:
            key = _key(entry.adapter, entry.ids, entry.made)
            if key in self._entries:
                self._entries.move_to_end(key)

    def add(self, adapter: str | None, ids: torch.Tensor, kv: CapturedKV, made: Made = EXACT) -> bool:
        """Store ``adapter``'s cache ``kv`` of ``ids`` ``[n]`` (``kv`` covers exactly those tokens), made as ``made``
        says, replacing the entries of that adapter it extends (an exact entry is replaced only by an exact one),
        then evict the least recently used entries beyond the bound. Returns False when the entry alone exceeds
        the bound (it is not stored)."""
        if kv.length != ids.shape[0]:
            raise ServerError(f"a prefix entry of {ids.shape[0]} tokens came with a cache of {kv.length}")
        kv = CapturedKV([_owned(k) for k in kv.keys], [_owned(v) for v in kv.values])
        nbytes = sum(t.nbytes for t in kv.keys + kv.values)
        if nbytes > self.max_bytes:
            logger.warning("a %d-token cache (%.1f MiB) exceeds the prefix store's bound (%.1f MiB): not stored",
                           ids.shape[0], nbytes / 2**20, self.max_bytes / 2**20)
            return False
        ids = ids.detach().cpu().clone()
        with self._lock:
            # already held, as an entry or a prefix of one, as well made (a derived cache adds nothing to any)
            longer, length = self.longest(adapter, ids, ids.shape[0], exact=made.exact)
            if longer is not None and length == ids.shape[0]:
                self.touch(longer)
                return True
            for key, entry in list(self._entries.items()):
                if entry.adapter != adapter or entry.ids.shape[0] > ids.shape[0] or (entry.made.exact and not made.exact):
                    continue
                if torch.equal(entry.ids, ids[: entry.ids.shape[0]]):  # a prefix of the new entry: redundant
                    self._remove(key)
            self._entries[_key(adapter, ids, made)] = Entry(adapter, ids, kv, nbytes, made)
            self._bytes += nbytes
            while self._bytes > self.max_bytes:
                self._remove(next(iter(self._entries)))
                self.evictions += 1
        return True

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def entries(self) -> list[Entry]:
        """The entries, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._entries.values())

    def _remove(self, key: tuple) -> None:
        self._bytes -= self._entries.pop(key).nbytes


def _key(adapter: str | None, ids: torch.Tensor, made: Made) -> tuple:
    return adapter, made.exact, ids.shape[0], ids.numpy().tobytes()


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself if it owns its whole storage, else a compact copy (a view would pin, and hide from
    the memory bound, the larger tensor it is cut from)."""
    tensor = tensor.detach()
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.contiguous().clone()


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
        keep_base: how the base cache catches up after an adapter's reply (`sessions.catch_up_base`): ``"prefill"``
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
        if reuse not in REUSE_MODES:
            raise ServerError(f"reuse must be one of {REUSE_MODES}, got {reuse!r}")
        check_keep_base(keep_base, ServerError)
        if not isinstance(min_mapped_tokens, int) or min_mapped_tokens < 0:
            raise ServerError(f"min_mapped_tokens must be a non-negative number of tokens, got {min_mapped_tokens!r}")
        self.shared, self.store, self.reuse, self.keep_base = shared, store, reuse, keep_base
        self.min_mapped_tokens = min_mapped_tokens

    def mappable(self, adapter: str) -> bool:
        """Whether a switch to ``adapter`` can start from the base model's cache (a map, or an Activated LoRA)."""
        return adapter in self.shared.maps.to_adapter or is_activated_lora(self.shared.model, adapter)

    def run(self, adapter: str | None, prompt_ids: torch.Tensor, generation_kwargs: dict, *,
            streamer: BaseStreamer | None = None, should_stop: Callable[[], bool] | None = None,
            cancelled: Callable[[], bool] | None = None, started: float | None = None, seed: int | None = None,
            reuse: Reuse | None = None, on_prepared: Callable[[str, int, str | None], None] | None = None,
            on_generated: Callable[[TurnResult], None] | None = None) -> TurnResult:
        """Generate ``adapter``'s reply to ``prompt_ids`` ``[n]`` from the longest cached prefix.

        ``streamer`` receives the tokens as generate() makes them; ``should_stop`` is polled after each token
        (a stop string was generated); ``cancelled`` too, and a cancelled request stores nothing (its client went
        away); ``started`` (a ``time.perf_counter()`` value, default now) is where the
        first-token time counts from; ``seed`` seeds sampling; ``reuse`` is the request's own reuse mode (the
        stricter of it and the engine's applies: ``"exact"`` never gets a mapped or shared cache).
        ``on_prepared(source, cached_tokens, context_from)`` is called once the cache is chosen (before
        generation), ``on_generated`` is called with the result as soon as the reply is complete, before the store
        is updated (the model's lock is still held, so the next request sees the updated store). If generation
        raises, the store is left as it was.
        """
        self.shared.check_adapter(adapter)
        started = time.perf_counter() if started is None else started
        prompt = prompt_ids.reshape(1, -1).cpu()
        criteria = StoppingCriteriaList([_StopWhen(f) for f in (should_stop, cancelled) if f is not None])
        model = self.shared.model
        with self.shared.lock, torch.no_grad():
            prepare_started = time.perf_counter()
            cache, made, cached, prepared = self._cache_for(adapter, prompt, stricter(self.reuse, reuse))
            source: ContextSource = "prefilled" if not cached else "reused" if made.exact else made.how
            prepare_seconds = time.perf_counter() - prepare_started
            if on_prepared is not None:
                on_prepared(source, cached, made.source)
            timer = FirstTokenTimer(started, streamer)
            if seed is not None:
                torch.manual_seed(seed)  # global RNG: safe, every model use holds the lock
            with adapter_active(model, adapter):
                output = generate_on_cache(model, prompt, cache, streamer=timer, stopping_criteria=criteria,
                                           **generation_kwargs)
            result = TurnResult(adapter, output[:, prompt.shape[1]:], prompt.shape[1], source, cached, timer.seconds,
                                prepare_seconds, model_tokens={"prepare": prepared, "prefill": prompt.shape[1] - cached},
                                cancelled=cancelled is not None and bool(cancelled()),
                                context_from=made.source if cached else None)
            if on_generated is not None:
                on_generated(result)
            if not result.cancelled:
                keep_started = time.perf_counter()
                result.model_tokens["keep_base"] = self._keep(adapter, output, cache, made)
                result.keep_seconds = time.perf_counter() - keep_started
        logger.debug("request adapter=%s source=%s cached=%d tokens=%s", adapter, source, cached, result.model_tokens)
        return result

    def _cache_for(self, adapter: str | None, prompt: torch.Tensor, reuse: Reuse
                   ) -> tuple[MappedCache, Made, int, int]:
        """The cache the request starts from: ``(cache, how it was made, cached tokens, model tokens spent on it)``.
        The longest prefix wins among the exact one of this model, an entry of this model derived from a mapped or
        shared prefix, and the base model's prefix mapped (or shared) into the adapter; an approximate one only
        where the policy allows it (see the module). At equal length: exact, then a stored entry, then mapping."""
        limit = prompt.shape[1] - 1  # generate() must compute at least the last prompt token
        if reuse == "none" or limit <= 0:
            return MappedCache(), EXACT, 0, 0
        ids = prompt[0]
        own, exact_length = self.store.longest(adapter, ids, limit, exact=True)
        best, best_length = own, exact_length
        if reuse == "map":
            derived, length = self.store.longest(adapter, ids, limit)
            if length > best_length and self._pays(derived.made, length - exact_length):
                best, best_length = derived, length
            if adapter is not None and self.mappable(adapter):
                base, base_length = self.store.longest(None, ids, limit)
                how: How = "shared" if is_activated_lora(self.shared.model, adapter) and base is not None \
                    and base.made.exact else "mapped"
                if base_length > best_length and self._pays(Made(how), base_length - exact_length):
                    self.store.touch(base)
                    cache, _, prepared = cache_from_base(self.shared, adapter, MappedCache(base.kv.prefix(base_length)),
                                                         prompt[:, :base_length])
                    return cache, Made(how, None, base_length), base_length, prepared
        if best is None:
            return MappedCache(), EXACT, 0, 0
        self.store.touch(best)
        return MappedCache(best.kv.prefix(best_length)), best.made.cut(best_length), best_length, 0

    def _pays(self, made: Made, saved: int) -> bool:
        """Whether a cache made as ``made`` saving ``saved`` tokens of prefill over the exact one may be used."""
        return made.how == "shared" or saved >= self.min_mapped_tokens

    def _keep(self, adapter: str | None, output: torch.Tensor, cache: MappedCache, made: Made) -> int:
        """Store the reply's cache (and the base's, after an adapter's reply); returns the model tokens spent."""
        if self.reuse == "none":
            return 0
        covered = cache.get_seq_length()  # the conversation but its last token
        self.store.add(adapter, output[0, :covered], cache_states(cache), made)
        if self.reuse != "map" or adapter is None:
            return 0
        base, length = self.store.longest(None, output[0], covered)
        base_cache = MappedCache() if base is None else MappedCache(base.kv.prefix(length))
        spent = catch_up_base(self.shared, adapter, base_cache, cache, output, self.keep_base)
        kept = base_cache.get_seq_length()
        if kept > length:
            base_made = EXACT if base is None else base.made.cut(length)
            # the tokens no model ran over were mapped back from the adapter's cache (keep_base="reverse_map")
            self.store.add(None, output[0, :kept], cache_states(base_cache), base_made.then(adapter, kept - length - spent))
        return spent


__all__ = ["DEFAULT_MIN_MAPPED_TOKENS", "EXACT", "Entry", "Made", "PrefixEngine", "PrefixStore", "REUSE_MODES",
           "Reuse", "stricter"]
