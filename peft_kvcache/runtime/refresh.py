"""Refresh: after a switch, the target recomputes the few context tokens its own new tokens attend to.

A mapped cache is approximate at every position, and what suffers most is retrieval: a value stated
far back is found by the target's queries and copied from its values, and a small error in either loses
it. The tokens that matter for the next turn are few, and the target itself can say which: it runs the
new turn (the ``probe`` tokens) on the mapped cache and we read where its attention goes. Those context
tokens, in short spans, are then recomputed with the target's own weights — each attending to the mapped
cache before it and to the refreshed tokens before it, at its true position — and their keys/values
replace the mapped ones; the probe tokens are recomputed on top in the same pass.

Cost: ``2 * probe + budget`` target tokens over the context (plus a recent window, if any; vs the whole context for
prefill), in two passes over the target's weights (the probe, then refresh + probe again); a sink the target has not
computed yet for these first tokens rides the first pass (its tokens attend only to themselves) instead of a pass of
its own. With every context position refreshed the result is exactly the target's own prefill (a test checks this).
The probe pass runs with eager attention (transformers returns attention weights only from it) over grouped KV heads
(`_compat.eager_attention`); the recompute pass, whose mask is explicit, with eager attention where the model runs it
and else with SDPA over grouped KV heads (`_compat.masked_attention`; FlashAttention would read the mask as padding):
neither copies a KV head per query head. Two other recipes share the machinery (`Refresh`): the last tokens computed
over the mapped prefix with no probe pass (``hybrid``), and the picked positions kept without the mapped context
around them (``index``: the map only chooses).

Every function here runs on a `MappedCache` (``cache``): it cuts the cache with its ``truncate`` and puts it back
with ``restored_on_error`` when a pass fails midway.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import CacheMismatchError, RecordError
from ..maps.config import Refresh
from ..modeling._compat import eager_attention, masked_attention
from ..modeling.capture import CapturedKV, forward, run_with_cache

if TYPE_CHECKING:  # for annotations only: the cache module runs the refresh
    from .mapped import MappedCache
    from ..maps.kvmap import KVMap

logger = logging.getLogger(__name__)


@dataclass
class RefreshResult:
    """What a refresh did: the context positions the target recomputed, the probe it used, and the wall seconds of
    its two passes over the target (the probe's, 0 where none ran; the recompute's) for anyone accounting its cost
    (host time: work a GPU still has queued when a pass returns is not waited for)."""

    positions: torch.Tensor
    probe_tokens: int
    budget: int
    probe_seconds: float = 0.0
    recompute_seconds: float = 0.0
    sink: CapturedKV | None = None  # the target's own sink KV, where the refresh computed it (``compute_sink``)


@dataclass
class ProbeResult:
    """A probe pass: the attention ``scores`` (`attention_scores`) and, where it computed them, the target's own sink
    KV it wrote into the cache (``sink``)."""

    scores: torch.Tensor
    sink: CapturedKV | None = None


def refresh_policy(kv_map: "KVMap", refresh_tokens: int | str | Refresh | None) -> Refresh | None:
    """The refresh `MappedCache.from_source` runs for ``refresh_tokens``: the map's recommendation, none, a budget with
    the recommended probe, a named recipe (read with the recommended probe and span), or as given."""
    recommended = kv_map.config.refresh
    if refresh_tokens is None:
        return recommended if recommended is not None and recommended.active else None
    if isinstance(refresh_tokens, Refresh):
        policy = refresh_tokens
    elif isinstance(refresh_tokens, str):
        try:
            policy = Refresh.named(refresh_tokens, **({} if recommended is None else {
                "probe_tokens": recommended.probe_tokens, "span": recommended.span}))
        except RecordError as err:
            raise CacheMismatchError(f"refresh_tokens: {err}") from None
    elif isinstance(refresh_tokens, int) and not isinstance(refresh_tokens, bool):
        try:
            policy = Refresh(tokens=refresh_tokens, **({} if recommended is None else {
                "probe_tokens": recommended.probe_tokens, "span": recommended.span}))
        except RecordError as err:
            raise CacheMismatchError(f"refresh_tokens: {err}") from None
    else:
        raise CacheMismatchError(f"refresh_tokens must be None, an integer, a recipe name or a Refresh, got "
                                 f"{refresh_tokens!r}")
    return policy if policy.active else None


@torch.no_grad()
def probe_pass(target_model, cache: "MappedCache", probe_ids: torch.Tensor, position_offset: int = 0,
               every_probe_token: bool = False, sink_ids: torch.Tensor | None = None) -> ProbeResult:
    """Run ``probe_ids`` ``[1, W]`` on top of ``cache`` (batch 1, left holding what it held) and read where they
    attend (`attention_scores`). ``sink_ids`` ``[1, S]``: the cache's first S positions are still mapped; the same
    pass computes the target's own KV for them (they attend only to themselves), writes it in place and returns it,
    the probe attending to it: a pass over the target's weights fewer where the sink is not memoized yet. The
    scores of those S positions are then about 0 (the probe does not see the mapped ones)."""
    length, width = cache.get_seq_length(), probe_ids.shape[1]
    sink = torch.arange(0 if sink_ids is None else sink_ids.shape[1])
    tokens = probe_ids if sink_ids is None else torch.cat([sink_ids.cpu(), probe_ids.cpu()], dim=1)
    mask, queries = None, torch.arange(length, length + width)
    if sink.numel():
        mask, queries = _pass_mask(length, sink, width, cache.layers[0].keys.dtype)
    own_sink = None
    with cache.side_pass():  # the probe's tokens are cut away: the cache ends as it was, but for a sink written
        try:
            with eager_attention(target_model):
                out = forward(target_model, tokens, cache, position_ids=(queries + position_offset)[None],
                              attention_mask=mask, output_attentions=True)
            if sink.numel():
                _move_into_place(cache, length, sink, width)
                own_sink = _leading(cache, sink.numel())
        finally:
            cache.truncate(length)
    rows = slice(sink.numel(), None) if every_probe_token else -1
    per_layer = [a[0, :, rows, :length].float().amax(dim=0).cpu() for a in out.attentions]
    return ProbeResult(torch.stack(per_layer).mean(0), own_sink)


def attention_scores(target_model, cache: "MappedCache", probe_ids: torch.Tensor, position_offset: int = 0,
                     every_probe_token: bool = False) -> torch.Tensor:
    """``[context]``: how strongly the last of the ``probe_ids`` ``[1, W]`` tokens, run on top of ``cache``
    (batch 1, left as it was), attends to each cached position: per layer the maximum attention weight
    over heads, averaged over layers (a position one head retrieves sharply counts, not only positions
    every head skims). The last token is the one whose prediction starts the answer. ``every_probe_token``
    returns ``[W, context]``, one row per probe token."""
    return probe_pass(target_model, cache, probe_ids, position_offset, every_probe_token).scores


def select_spans(scores: torch.Tensor, budget: int, span: int = 8, first: int = 1) -> torch.Tensor:
    """Sorted positions to refresh: the highest-scoring positions in ``[first, len(scores))``, each as a
    run of ``span`` tokens starting one before it (copying reads the tokens that follow a match), until
    ``budget`` positions are chosen."""
    length = scores.numel()
    if budget <= 0 or length <= first:
        return torch.empty(0, dtype=torch.long)
    budget = min(budget, length - first)
    chosen, count = torch.zeros(length, dtype=torch.bool), 0
    for anchor in scores[first:].argsort(descending=True).tolist():
        anchor += first
        for p in range(max(first, anchor - 1), min(length, anchor - 1 + span)):
            if count == budget:
                break
            count += not chosen[p]
            chosen[p] = True
        if count == budget:
            break
    return chosen.nonzero().flatten()


@torch.no_grad()
def refresh_positions(target_model, cache: "MappedCache", context_ids: torch.Tensor, positions: torch.Tensor,
                      position_offset: int = 0, append_ids: torch.Tensor | None = None) -> None:
    """Recompute the cache entries at ``positions`` (sorted, within the ``[1, n]`` ``context_ids`` the cache
    holds) with the target, in place: each refreshed token attends to the cached entries before it that
    are not refreshed, and to the refreshed ones up to itself. ``append_ids`` ``[1, W]``, the tokens that
    follow the context, are computed in the same pass on top of the refreshed cache and appended (one pass
    over the target's weights instead of two)."""
    length = cache.get_seq_length()
    if context_ids.shape != (1, length):
        raise CacheMismatchError(f"refresh needs the [1, {length}] token ids the cache holds, got "
                                 f"{tuple(context_ids.shape)}")
    sorted_unique = bool((positions.diff() > 0).all())
    if positions.numel() and (positions.min() < 0 or positions.max() >= length or not sorted_unique):
        raise CacheMismatchError(f"refresh positions must be sorted, unique and in 0..{length - 1}")
    appended = 0 if append_ids is None else append_ids.shape[1]
    if positions.numel() + appended == 0:
        return
    mask, queries = _pass_mask(length, positions, appended, cache.layers[0].keys.dtype)
    tokens = context_ids[:, positions]
    if append_ids is not None:
        tokens = torch.cat([tokens, append_ids.cpu()], dim=1)
    with cache.side_pass():  # the pass and the move both, or neither; not the conversation's next tokens
        with masked_attention(target_model):
            forward(target_model, tokens, cache, position_ids=(queries + position_offset)[None], attention_mask=mask)
        _move_into_place(cache, length, positions, appended)


def _leading(cache: "MappedCache", tokens: int) -> CapturedKV:
    """A copy of the cache's first ``tokens`` positions (a sink a pass just computed, for the memo)."""
    return CapturedKV([layer.keys[:, :, :tokens].clone() for layer in cache.layers],
                      [layer.values[:, :, :tokens].clone() for layer in cache.layers])


def _pass_mask(length: int, positions: torch.Tensor, appended: int, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """The ``[1, 1, queries, length + queries]`` additive mask of a pass that recomputes the cache ``positions``
    (sorted) of a ``length``-token cache and appends ``appended`` tokens, and the queries' positions: each query
    attends to the cached entries before it that are not recomputed, and to the recomputed/appended ones up to
    itself."""
    queries = torch.cat([positions, torch.arange(length, length + appended)])
    refreshed = torch.zeros(length, dtype=torch.bool)
    refreshed[positions] = True
    old = (torch.arange(length)[None] < queries[:, None]) & ~refreshed[None]  # mapped entries before each query
    new = queries[None] <= queries[:, None]  # refreshed/appended entries up to each query (causal)
    allowed = torch.cat([old, new], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None], queries


def _move_into_place(cache: "MappedCache", length: int, positions: torch.Tensor, appended: int) -> None:
    """After a `_pass_mask` pass appended the recomputed tokens, then the appended ones, to every layer: move them
    into place. The layers' tensors are the pass's own (`ContextCache.update` concatenates into new ones; a tensor the
    cache held before, which a copy of the cache may share, is never written), so the moves run in place and only the
    appended tail (a few tokens) is copied; the context is left in a view of the longer tensor, not copied again."""
    split = length + positions.numel()
    for layer in cache.layers:
        index = positions.to(layer.keys.device)
        for name in ("keys", "values"):
            states = getattr(layer, name)
            states[:, :, index] = states[:, :, length:split]
            states[:, :, length:length + appended] = states[:, :, split:].clone()  # the ranges may overlap
            setattr(layer, name, states[:, :, :length + appended])


def refresh_runs(policy: Refresh, length: int, sink_tokens: int) -> bool:
    """Whether `refresh_cache` runs the target on a ``length``-token context with ``policy`` (a probe pass, or the
    hybrid's recompute pass): a context longer than the sink and one token. A cold sink is computed in that pass."""
    return min(policy.probe_tokens, length - sink_tokens - 1) >= 1


@torch.no_grad()
def refresh_cache(target_model, cache: "MappedCache", input_ids: torch.Tensor, policy: Refresh, sink_tokens: int = 1,
                  position_offset: int = 0, compute_sink: bool = False) -> RefreshResult:
    """The whole refresh on a cache holding ``input_ids`` ``[1, n]`` (batch 1, unpadded): the last
    ``policy.probe_tokens`` are the probe; the ``policy.tokens`` context positions (spans, past the sink, before the
    recent window) its last token attends to most are recomputed by the target, with the ``policy.recent_tokens``
    before the probe and the probe tokens on top, in the same pass, so the cache ends holding all ``n`` tokens; with
    ``policy.mapped_middle`` False the cache ends holding only the sink and what the target computed (at their true
    positions). With nothing to pick (``policy.tokens`` 0, or a recent window that reaches the sink) no probe pass
    runs: the last tokens are computed over the mapped prefix.

    ``compute_sink``: the cache's first ``sink_tokens`` are still mapped, and the refresh's first pass computes the
    target's own sink with its other tokens (the probe pass, `probe_pass`, or the hybrid's recompute pass; the sink's
    tokens attend only to themselves, so the result is the sink computed alone); ``RefreshResult.sink`` holds it for
    the sink memo. Only where `refresh_runs`.

    A probe longer than the context allows is shortened; a recent window or a budget larger than the positions left
    is clamped to them, the budget with a warning (the target then computes the whole context: ordinary prefill).

    Example:
        >>> result = refresh_cache(target, cache, context_ids, Refresh(tokens=32))   # doctest: +SKIP
        >>> result.positions.numel()                                                  # doctest: +SKIP
        32
    """
    length = input_ids.shape[1]
    if input_ids.shape[0] != 1:
        raise CacheMismatchError("the refresh works on one conversation at a time (batch 1)")
    if compute_sink and not refresh_runs(policy, length, sink_tokens):
        raise CacheMismatchError(f"compute_sink needs a refresh that runs the target (refresh_runs): {policy.name} on "
                                 f"{length} tokens runs nothing")
    probe = min(policy.probe_tokens, length - sink_tokens - 1)
    if probe < 1:  # no context beyond the sink to refresh
        return RefreshResult(torch.empty(0, dtype=torch.long), 0, 0)
    start = length - probe
    window_start = start - min(policy.recent_tokens, start - sink_tokens)
    available = window_start - sink_tokens
    budget = policy.tokens
    if budget > available:
        logger.warning("refresh budget %d is larger than the %d context positions left after the sink, the recent "
                       "window and the %d-token probe: clamped to %d (the target computes the whole context, as a "
                       "prefill would)", budget, available, probe, available)
        budget = available
    no_positions = torch.empty(0, dtype=torch.long)
    if budget == 0:  # nothing to pick (none asked, or the window reaches the sink): the last tokens over the mapped
        # prefix, in one pass with no probe
        started = time.perf_counter()
        sink = torch.arange(sink_tokens if compute_sink else 0)
        with cache.restored_on_error():
            cache.truncate(window_start)
            refresh_positions(target_model, cache, input_ids[:, :window_start], sink, position_offset,
                              append_ids=input_ids[:, window_start:])
        return RefreshResult(no_positions, probe, 0, recompute_seconds=time.perf_counter() - started,
                             sink=_leading(cache, sink_tokens) if compute_sink else None)
    with cache.restored_on_error():
        started = time.perf_counter()
        cache.truncate(start)
        probed = probe_pass(target_model, cache, input_ids[:, start:], position_offset,
                            sink_ids=input_ids[:, :sink_tokens] if compute_sink else None)
        positions = select_spans(probed.scores[:window_start], budget, policy.span, first=sink_tokens)
        probe_done = time.perf_counter()
        if policy.mapped_middle:
            recomputed = torch.cat([positions, torch.arange(window_start, start)])
            refresh_positions(target_model, cache, input_ids[:, :start], recomputed, position_offset,
                              append_ids=input_ids[:, start:])
        else:
            _keep_only(target_model, cache, input_ids, torch.cat([torch.arange(sink_tokens), positions,
                                                                  torch.arange(window_start, length)]),
                       position_offset)
    return RefreshResult(positions, probe, budget, probe_done - started, time.perf_counter() - probe_done, probed.sink)


def _keep_only(target_model, cache: "MappedCache", input_ids: torch.Tensor, kept: torch.Tensor,
               position_offset: int) -> None:
    """Replace the cache by the target's own KV of the context positions ``kept`` (sorted), computed in one pass
    at their true positions: the mapped context is dropped, the map only chose what to keep."""
    own = run_with_cache(target_model, input_ids[:, kept], position_ids=(kept + position_offset)[None])
    cache.hold_only(kept, own.pairs())


__all__ = ["ProbeResult", "RefreshResult", "attention_scores", "probe_pass", "refresh_cache", "refresh_positions",
           "refresh_policy", "refresh_runs", "select_spans"]
