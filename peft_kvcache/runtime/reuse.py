"""The reuse core both serving wings stand on (the OpenAI-compatible server and the vLLM connector): one record of
how a cache was made, one vocabulary of where a request's context came from and one label for it, and one policy
for when an approximate prefix may be used.

Where a context came from (`ContextSource`):

- ``"reused"``: computed by the requested model itself on the exact context (as exact as a prefill);
- ``"mapped"``: another model's KV mapped by a published `KVMap` (or a cache that extends such a prefix);
- ``"shared"``: the base model's KV reused as it is by an Activated LoRA, which is exact by construction (the
  adapter acts only from its invocation tokens on);
- ``"naive"``: another model's KV injected unmapped: the baseline a prefix cache that ignores the adapter gives,
  approximate and never exact;
- ``"prefilled"``: nothing was cached.

A response names the model it came from: ``mapped:<model>``, ``shared:<model>``, ``naive:<model>`` (`label`).

Example:
    >>> made = Made("mapped", "shout", 300)
    >>> label(made, 300, base="smollm2"), label(Made(), 0, base="smollm2")
    ('mapped:shout', 'prefilled')
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

ContextSource = Literal["reused", "mapped", "shared", "naive", "prefilled"]
CONTEXT_SOURCES: tuple[str, ...] = get_args(ContextSource)
How = Literal["exact", "mapped", "shared", "naive"]
APPROXIMATE: tuple[str, ...] = ("mapped", "naive")  # KV that is not the model's own on this context

# The least prefill (in tokens) a mapped prefix must save beyond the longest exact one before it is used, per engine:
# the smallest mapped prefix whose switch took at most half the time to first token of prefilling it.
# transformers (the server and sessions): SmolLM2-135M with the committed adapters, benchmarks/map_threshold.py ->
# benchmarks/results/map-threshold.json ("recommended_min_mapped_tokens"); vLLM (the connector, CPU backend, one
# 128-token block): benchmarks/vllm_load.py -> benchmarks/results/vllm-load.json. Tests hold each to its file.
MIN_MAPPED_TOKENS = {"transformers": 256, "vllm": 128}


@dataclass(frozen=True)
class Made:
    """How a cache was made: ``"exact"`` (its own model computed every token on the exact context), or derived from
    ``tokens`` tokens of ``source``'s cache (None: the base model): ``"mapped"`` by a KVMap, ``"shared"`` as it is by
    an Activated LoRA, ``"naive"`` as it is by anything else. ``hops``: how many maps its derived tokens passed
    through (an adapter's KV mapped to the base and then to another adapter: 2). The tokens a model computes on top
    of a derived prefix attend to it, so a cache that extends a derived one is derived too.

    Example:
        >>> Made("mapped", None, 300).cut(120)
        Made(how='mapped', source=None, tokens=120, hops=1)
        >>> Made().exact, Made().then("shout", 40)
        (True, Made(how='mapped', source='shout', tokens=40, hops=1))
        >>> Made().then("shout", 40).then("shout", 30).mapped_again(100)  # turns mapped back, then mapped onward
        Made(how='mapped', source='shout', tokens=100, hops=2)
    """

    how: How = "exact"
    source: str | None = None
    tokens: int = 0
    hops: int = 0

    def __post_init__(self):
        if self.how not in get_args(How):
            raise ValueError(f"Made.how must be one of {get_args(How)}, got {self.how!r}")
        if self.how in APPROXIMATE and self.tokens > 0 and self.hops < 1:
            object.__setattr__(self, "hops", 1)

    @property
    def exact(self) -> bool:
        """Whether its own model computed every token on the exact context (an Activated LoRA's shared prefix holds the
        same values but is labelled as shared, and is not served to a request that asks for exact reuse)."""
        return self.how == "exact"

    @property
    def approximate(self) -> bool:
        return self.how in APPROXIMATE

    def cut(self, length: int) -> "Made":
        """How the first ``length`` tokens of a cache made this way were made."""
        return self if self.how == "exact" else replace(self, tokens=min(self.tokens, length))

    def then(self, source: str | None, mapped_tokens: int) -> "Made":
        """A cache made this way, extended by ``mapped_tokens`` tokens mapped from ``source``'s cache (none: as
        before). A derived cache keeps the model it was first derived from."""
        if mapped_tokens <= 0:
            return self
        if self.how == "exact":
            return Made("mapped", source, mapped_tokens, 1)
        # the new tokens passed through one map, those before through as many as they did
        return replace(self, how="mapped", tokens=self.tokens + mapped_tokens, hops=max(self.hops, 1))

    def mapped_again(self, tokens: int) -> "Made":
        """This cache's first ``tokens`` tokens mapped into another model: derived from the same source, one more map
        (an exact cache of the base mapped into an adapter: one map from the base)."""
        if self.how == "exact":
            return Made("mapped", self.source, tokens, 1)
        return replace(self, how="mapped", tokens=tokens, hops=self.hops + 1)  # all of them mapped once more

    @property
    def context_source(self) -> ContextSource:
        """The vocabulary word for a context made this way."""
        return "reused" if self.how == "exact" else self.how


EXACT = Made()


def label(made: Made, cached_tokens: int, base: str) -> str:
    """The one label of a request's context: ``"prefilled"`` when nothing was cached, ``"reused"`` for the model's own
    cache, else ``"<how>:<model>"`` naming the model the context came from (``base``: the base model's name).

    Example:
        >>> label(Made("naive", None, 256), 256, base="base")
        'naive:base'
    """
    if not cached_tokens:
        return "prefilled"
    if made.how == "exact":
        return "reused"
    return f"{made.how}:{base if made.source is None else made.source}"


def mapping_pays(made: Made, saved_tokens: int, min_mapped_tokens: int) -> bool:
    """Whether a prefix made as ``made`` may be used where it saves ``saved_tokens`` of prefill beyond the longest
    exact prefix: the model's own or an Activated LoRA's shared one always; an approximate one only from ``min_mapped_tokens``
    on (`MIN_MAPPED_TOKENS`), so short shared boilerplate such as a chat template's system prompt is prefilled exactly
    and a conversation's first turn never depends on what other conversations did.

    Example:
        >>> mapping_pays(Made("mapped", None, 300), 300, 256), mapping_pays(Made("mapped", None, 100), 100, 256)
        (True, False)
    """
    return not made.approximate or saved_tokens >= min_mapped_tokens


__all__ = ["APPROXIMATE", "CONTEXT_SOURCES", "ContextSource", "EXACT", "How", "MIN_MAPPED_TOKENS", "Made", "label",
           "mapping_pays"]
