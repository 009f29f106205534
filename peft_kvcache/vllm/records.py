"""What the connector's scheduler half keeps per request: the plan of its load until vLLM allocates its blocks, the
record of how it got its context (its response label, what its finish counts and evicts), and the counters since the
last report."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..maps.registry import MapMatch
from ..runtime.reuse import EXACT, Made, label
from .pairs import Variant
from .store import IndexEntry


@dataclass
class Plan:
    """What a request would load (until vLLM allocates its blocks), or why it loads nothing."""

    local_blocks: int
    kind: str | None = None  # "reused" (as stored) | "mapped" | "naive"; None: nothing to load
    entry: IndexEntry | None = None
    blocks: int = 0  # whole blocks of the prefix after the load
    made: Made = EXACT  # how the loaded KV was made
    choice: MapMatch | None = None
    sink_key: tuple | None = None
    fallback: str | None = None  # why a longer prefix was not used

    @property
    def tokens(self) -> int:
        """Blocks to load beyond vLLM's own hit (the caller multiplies by the block size)."""
        return max(0, self.blocks - self.local_blocks)


@dataclass
class RequestRecord:
    """How one request got its context, from its first admission to its end (a preempted request is admitted again:
    its label keeps the most approximate context it ever ran on, its counts the admission that label describes)."""

    variant: Variant
    salt: str | None
    reuse: str
    prompt_tokens: int
    local_tokens: int = 0
    loaded_tokens: int = 0
    made: Made = EXACT
    fallback: str | None = None
    fingerprint: str | None = None  # of the files its variant loaded when it was first admitted
    earlier: tuple | None = None  # (local, loaded, made, fallback) as they were before the last admission

    def admitted(self, local_tokens: int, loaded_tokens: int, made: Made, fallback: str | None) -> None:
        """One admission (the first, or one after a preemption): kept unless an earlier one was approximate and this
        one is not. Only prompt tokens count: after a preemption vLLM's own hit covers the reply so far too."""
        self.earlier = (self.local_tokens, self.loaded_tokens, self.made, self.fallback)
        if self.made.approximate and not made.approximate:
            return
        local_tokens = min(local_tokens, self.prompt_tokens)
        loaded_tokens = min(loaded_tokens, self.prompt_tokens - local_tokens)
        self.local_tokens, self.loaded_tokens, self.made, self.fallback = local_tokens, loaded_tokens, made, fallback

    def load_failed(self) -> None:
        """The last admission's load failed: vLLM computes those tokens itself. An approximate admission before it (the
        request ran on mapped KV, was preempted, and its load failed when admitted again) stays what the label and the
        evictions go by: what it computed then may still sit in vLLM's prefix cache (so does the approximate admission
        an exact one after a preemption did not replace: then ``earlier`` is that admission itself)."""
        if self.earlier is not None and self.earlier[2].approximate:
            self.local_tokens, self.loaded_tokens, self.made, self.fallback = self.earlier
        else:
            self.loaded_tokens, self.made, self.fallback = 0, EXACT, "load_error"

    def label(self, base: str) -> dict:
        """The response's ``kv_transfer_params.peft_kvcache``: where the context came from (`reuse.label`, ``base``:
        the served base model's name), how much of it, and for derived KV how many maps it passed through (``hops``)."""
        cached = self.local_tokens + self.loaded_tokens
        derived = {"hops": self.made.hops} if cached and self.made.approximate else {}
        return {"context_source": label(self.made, cached, base), "cached_tokens": cached,
                "engine_cached_tokens": self.local_tokens, "loaded_tokens": self.loaded_tokens,
                "prefilled_tokens": self.prompt_tokens - cached, **derived,
                **({"fallback": self.fallback} if self.fallback else {})}


@dataclass
class Counts:
    """Counters since the last report (vLLM's connector stats)."""

    # prompt tokens by where their KV came from, counted once per request when it finishes: engine (vLLM's own prefix
    # cache), reused (the variant's own, from the store), mapped, naive (another variant's, unmapped), prefilled
    tokens: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)  # by reason, once per request
    evictions: int = 0


__all__ = ["Counts", "Plan", "RequestRecord"]
