"""Retention metrics: how much of what the full context gives the target a mapped cache keeps.

Each example is ``context (C tokens) + continuation (M tokens)``; the target predicts every continuation
token teacher-forced. Variants differ only in what the target knows of the context:

- ``full``: the target's own prefill of the whole context;
- ``mapped@W``: the source's cache mapped by the KV map, with the target computing the last W context
  tokens itself (W=1: only the last one, the plain switch) and the sink;
- ``mapped@W+rK``: the mapped cache refreshed (`peft_kvcache.runtime.refresh`): the last W context tokens probe the
  mapped cache, the target recomputes the K context positions the last one attends to most, then the W tokens
  (target compute ``2W + K`` tokens: its control is ``window@(2W+K)``);
- ``window@W``: control at equal target compute: the target keeps only the sink and the last W context
  tokens, at their true positions, and drops the middle (no mapped cache at all);
- ``naive``: the source's cache used unmapped (same-shape pairs: what a prefix cache ignoring the adapter does);
- ``no_context``: only the last context token.

Normalized retention = (acc - acc_no_context) / (acc_full - acc_no_context); intervals come from a paired
bootstrap over examples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import EvaluationError
from ..maps.config import Figure, Refresh
from ..modeling.capture import forward, run_with_cache
from ..runtime.mapped import MappedCache
from ..runtime.check import ContextCheck, check_context
from .bootstrap import resample_indices


@torch.no_grad()
def _logits(model, ids: torch.Tensor, positions: torch.Tensor, cache=None, keep: int = 0) -> torch.Tensor:
    # a cache even when none is given: without one, transformers reads a jump in position_ids (the window
    # control's sink at 0, then the window at C-W) as packed sequences and masks the sink out.
    out = forward(model, ids[None], cache, position_ids=positions[None], logits_to_keep=keep)
    return out.logits[0].float().cpu()


def full_logits(target, ids: torch.Tensor, context: int) -> torch.Tensor:
    """``[M, vocab]`` logits of the continuation with the target's own prefill."""
    inputs = ids[:-1]
    return _logits(target, inputs, torch.arange(inputs.numel()), keep=ids.numel() - context)


def window_logits(target, ids: torch.Tensor, context: int, window: int, sink: int,
                  also: torch.Tensor | None = None) -> torch.Tensor:
    """Continuation logits when the target keeps only ``sink`` leading and ``window`` trailing context tokens (and
    the context positions ``also``), computing all of them itself at their true positions."""
    keep = torch.cat([torch.arange(min(sink, context - window)), torch.arange(context - window, ids.numel() - 1)])
    if also is not None:
        keep = torch.unique(torch.cat([keep, also]))  # sorted
    return _logits(target, ids[keep], keep, keep=ids.numel() - context)


def cached_logits(target, cache, ids: torch.Tensor, context: int, window: int) -> torch.Tensor:
    """Continuation logits with a cache covering the first ``context - window`` tokens."""
    start = context - window
    return _logits(target, ids[start:-1], torch.arange(start, ids.numel() - 1), cache=cache,
                   keep=ids.numel() - context)


def token_kl(full: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per-position KL(full || other) of next-token distributions from logits ``[..., vocab]`` (float32)."""
    log_full, log_other = F.log_softmax(full.float(), -1), F.log_softmax(other.float(), -1)
    return (log_full.exp() * (log_full - log_other)).sum(-1)


@dataclass
class VariantScores:
    """Per-example, per-token scores of one variant (lists over examples of ``[M]`` tensors)."""

    correct: list[torch.Tensor] = field(default_factory=list)
    kl: list[torch.Tensor] = field(default_factory=list)
    agree: list[torch.Tensor] = field(default_factory=list)

    def add(self, logits: torch.Tensor, full: torch.Tensor, labels: torch.Tensor) -> None:
        """Score one example's continuation logits against the full prefill's and the labels."""
        self.correct.append((logits.argmax(-1) == labels).float())
        self.kl.append(token_kl(full, logits))
        self.agree.append((logits.argmax(-1) == full.argmax(-1)).float())


def _per_example(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([v.mean() for v in values])


# normalized retention divides by what the context adds to the full prefill's mean accuracy: below this, NaN
MIN_GAP = 0.01


@dataclass
class RetentionReport:
    """Scores of every variant on the same examples, with paired bootstrap intervals."""

    scores: dict[str, VariantScores]
    context_length: int
    continuation_length: int
    bootstrap: int = 1000
    seed: int = 0
    context_checks: list[dict] = field(default_factory=list)  # per example: the per-request check's report

    def check_catch_rate(self, window: int) -> dict:
        """How the per-request check (``check_tokens=W`` in `evaluate_retention`) sorted the examples: a
        context is *bad* when ``mapped@W`` scores below the window-only control ``window@W`` (top-1 accuracy
        over the continuation); returns counts of bad/good contexts and how many of each it flagged."""
        mapped = _per_example(self.scores[f"mapped@{window}"].correct)
        control = _per_example(self.scores[f"window@{window}"].correct)
        flagged = torch.tensor([c["flagged"] for c in self.context_checks])
        bad = mapped < control
        return {"window": window, "bad": int(bad.sum()), "bad_flagged": int((bad & flagged).sum()),
                "good": int((~bad).sum()), "good_flagged": int((~bad & flagged).sum())}

    def _resamples(self) -> torch.Tensor:
        count = len(self.scores["full"].correct)
        return resample_indices(count, self.bootstrap, self.seed)

    def normalized(self, name: str, index: torch.Tensor | None = None) -> torch.Tensor:
        """Normalized retention of ``name``: a point estimate, or one per bootstrap resample in ``index``."""
        def mean(variant: str) -> torch.Tensor:
            per_example = _per_example(self.scores[variant].correct)
            return per_example.mean() if index is None else per_example[index].mean(-1)

        full, none = mean("full"), mean("no_context")
        gap = full - none  # where the context barely helps the full prefill itself, a share of it means nothing: NaN
        return torch.where(gap >= MIN_GAP, (mean(name) - none) / gap, torch.nan)

    def interval(self, statistic: Callable[[torch.Tensor | None], torch.Tensor]) -> tuple[float, float]:
        """95% paired bootstrap interval of ``statistic(index)`` over examples. A resample whose statistic is undefined
        (normalized retention where its examples' context gains too little) could lie anywhere: it counts at the far
        end of each tail, so the interval only widens, and is NaN where more than 2.5% of resamples are undefined."""
        values = statistic(self._resamples())
        finite = values[torch.isfinite(values)]
        undefined = values.numel() - finite.numel()
        # the 2.5% and 97.5% positions among all resamples, the undefined ones first for the low tail, last for the high
        low, high = 0.025 * (values.numel() - 1) - undefined, 0.975 * (values.numel() - 1)
        if finite.numel() == 0 or low < 0 or high > finite.numel() - 1:
            return float("nan"), float("nan")
        span = max(finite.numel() - 1, 1)
        return float(finite.quantile(low / span)), float(finite.quantile(high / span))

    def paired_difference(self, a: str, b: str, metric: str = "normalized") -> dict:
        """Difference ``a - b`` of normalized retention (or of mean KL with ``metric='kl'``) with its paired
        95% interval: above zero means ``a`` is better (for KL, below zero)."""
        if metric == "kl":
            diff = _per_example(self.scores[a].kl) - _per_example(self.scores[b].kl)
            point = float(diff.mean())
            low, high = self.interval(lambda idx: diff[idx].mean(-1))
        else:
            point = float(self.normalized(a) - self.normalized(b))
            low, high = self.interval(lambda idx: self.normalized(a, idx) - self.normalized(b, idx))
        return {"a": a, "b": b, "metric": metric, "difference": point, "low": low, "high": high}

    def rows(self) -> list[dict]:
        """One dict per variant: accuracy, raw and normalized retention with paired intervals, KL, agreement."""
        full_acc = float(torch.cat(self.scores["full"].correct).mean())
        rows = []
        for name, s in self.scores.items():
            acc = float(torch.cat(s.correct).mean())
            kl = _per_example(s.kl)
            low, high = self.interval(lambda idx, n=name: self.normalized(n, idx))
            rows.append({
                "variant": name, "accuracy": acc, "raw_retention": acc / full_acc if full_acc else float("nan"),
                "normalized_retention": float(self.normalized(name)), "normalized_low": low, "normalized_high": high,
                "kl": float(kl.mean()), "greedy_agreement": float(torch.cat(s.agree).mean()),
            })
        return rows

    def table(self) -> str:
        """A markdown table of every variant."""
        lines = [f"context {self.context_length} tokens, continuation {self.continuation_length}, "
                 f"{len(self.scores['full'].correct)} examples",
                 "| variant | accuracy | raw retention | normalized [95% CI] | KL(full‖variant) | greedy agreement |",
                 "|---|---|---|---|---|---|"]
        for r in self.rows():
            lines.append(f"| {r['variant']} | {r['accuracy']:.3f} | {r['raw_retention']:.3f} | "
                         f"{r['normalized_retention']:.3f} [{r['normalized_low']:.2f}, {r['normalized_high']:.2f}] | "
                         f"{r['kl']:.4f} | {r['greedy_agreement']:.3f} |")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The report as JSON-ready data (lengths, example count, rows)."""
        return {"context_length": self.context_length, "continuation_length": self.continuation_length,
                "examples": len(self.scores["full"].correct), "rows": self.rows()}


@torch.no_grad()
def picked_positions(cache: MappedCache) -> torch.Tensor:
    """The context positions a cache's refresh recomputed (none where no refresh ran: a context too short)."""
    return cache.refresh.positions if cache.refresh is not None else torch.empty(0, dtype=torch.long)


def evaluate_retention(
    source_model,
    target_model,
    kv_map,
    sequences: Sequence[torch.Tensor],
    context_length: int,
    continuation_length: int = 64,
    windows: Sequence[int] = (1,),
    window_control: bool = True,
    naive_reuse: bool | None = None,
    refresh: Sequence[int] = (),
    refresh_span: int = 8,
    sparse_control: bool = False,
    check_tokens: int = 0,
    check_margin: float = 0.25,
    progress: bool = True,
) -> RetentionReport:
    """Score the mapped cache against full prefill, no context, the window-only control and (same-shape
    pairs) naive reuse, on ``sequences`` of at least ``context_length + continuation_length`` tokens.

    Args:
        windows: W values: the target computes the last W context tokens itself on top of the mapped cache
            (and the window-only control keeps the same W, at equal target compute).
        naive_reuse: score the unmapped source cache; by default only when the pair has the same shape.
        refresh: budgets K of refreshed context positions: adds ``mapped@W+rK`` for every W (and its
            window-only control at equal target compute, ``window@(2W+K)``).
        sparse_control: with ``refresh``, also ``sparse@W+rK``: the positions the refresh chose (through the
            mapped cache), computed by the target beside only the sink and the last W tokens, no mapped context:
            what the map adds beyond choosing the positions.
        check_tokens: W > 0 also runs the per-request check (`peft_kvcache.runtime.check.check_context` with
            ``ContextCheck(W)``) on every example and keeps its reports in ``report.context_checks`` (see
            ``check_catch_rate``),
            with ``check_margin`` nats of margin.

    Example:
        >>> report = evaluate_retention(src, tgt, kv_map, seqs, context_length=256)  # doctest: +SKIP
        >>> print(report.table())                                                     # doctest: +SKIP
    """
    if naive_reuse is None:
        naive_reuse = kv_map.config.pair_kind == "same_shape"
    if context_length < 2 or continuation_length < 1:
        raise EvaluationError(f"an example needs a context of 2 or more tokens and a continuation of 1 or more, got "
                              f"context_length={context_length}, continuation_length={continuation_length}")
    total = context_length + continuation_length
    usable = [s[:total] for s in sequences if s.numel() >= total]
    if not usable:
        raise EvaluationError(f"no sequence has the {total} tokens an example needs")
    if not windows or min(windows) < 1 or max(windows) >= context_length:
        raise EvaluationError(f"windows must be one or more W in 1..{context_length - 1}, got {list(windows)}")
    if any(k < 1 for k in refresh):
        raise EvaluationError(f"refresh budgets must be positive (mapped@W is the budget-0 row), got {list(refresh)}")
    kv_map.check_models(source_model, target_model)
    sink = kv_map.config.sink_tokens
    names = ["full", "no_context"] + [f"mapped@{w}" for w in windows]
    refreshed = [(w, k) for w in windows for k in refresh]
    names += [f"mapped@{w}+r{k}" for w, k in refreshed]
    names += [f"sparse@{w}+r{k}" for w, k in refreshed] if sparse_control else []
    controls = sorted(set(windows) | {2 * w + k for w, k in refreshed if 2 * w + k < context_length})
    names += [f"window@{w}" for w in controls] if window_control else []
    names += [f"naive@{w}" for w in windows] if naive_reuse else []
    scores = {name: VariantScores() for name in names}
    checks = []
    for ids in tqdm(usable, desc="retention", disable=not progress):
        labels = ids[context_length:]
        full = full_logits(target_model, ids, context_length)
        scores["full"].add(full, full, labels)
        scores["no_context"].add(window_logits(target_model, ids, context_length, 1, sink=0), full, labels)
        # one source pass over the whole context serves every W: a causal model's cache of a prefix is the
        # prefix of its cache
        context_cache = run_with_cache(source_model, ids[None, :context_length])
        for w in windows:
            prefix = ids[None, : context_length - w]
            source_cache = context_cache.prefix(context_length - w)
            mapped = MappedCache.from_source(source_cache, kv_map, target_model, input_ids=prefix,
                                             refresh_tokens=0, verify_models=False)
            scores[f"mapped@{w}"].add(cached_logits(target_model, mapped, ids, context_length, w), full, labels)
            if naive_reuse:
                naive = MappedCache(source_cache)
                scores[f"naive@{w}"].add(cached_logits(target_model, naive, ids, context_length, w), full, labels)
        for w, k in refreshed:
            context = ids[None, :context_length]
            cache = MappedCache.from_source(context_cache, kv_map, target_model, input_ids=context,
                                            verify_models=False, refresh_tokens=Refresh(k, w, refresh_span))
            # the last context token's logits predict the first label: drop it and let the target redo it
            cache.truncate(context_length - 1)
            scores[f"mapped@{w}+r{k}"].add(cached_logits(target_model, cache, ids, context_length, 1), full, labels)
            if sparse_control:
                scores[f"sparse@{w}+r{k}"].add(window_logits(target_model, ids, context_length, w, sink,
                                                             also=picked_positions(cache)), full, labels)
        for w in controls if window_control else []:
            scores[f"window@{w}"].add(window_logits(target_model, ids, context_length, w, sink), full, labels)
        if check_tokens:
            context = ids[None, :context_length]
            mapped = MappedCache.from_source(context_cache, kv_map, target_model, input_ids=context,
                                             refresh_tokens=0, verify_models=False)
            result = check_context(mapped, target_model, context, ContextCheck(check_tokens, check_margin, "drop_middle"))
            checks.append({"flagged": result.flagged, "mapped_loss": result.mapped_loss,
                           "window_loss": result.window_loss})
    return RetentionReport(scores, context_length, continuation_length, context_checks=checks)


def record_figures(kv_map, report: RetentionReport, folder, data: dict) -> None:
    """Write ``report`` as ``evaluation.json`` (with its provenance and ``data``: the evaluation texts) into the map
    folder and copy its mapped rows' figures into ``kv_map.config.quality``, citing that file; the caller saves."""
    from pathlib import Path

    from ..lab.provenance import write_results
    from ..maps.storage import EVALUATION_NAME

    write_results(Path(folder) / EVALUATION_NAME, {"retention": report.to_dict()}, data=data)
    kv_map.config.quality.figures = {
        f"{row['variant']}.{key}": Figure(row[key], EVALUATION_NAME, f"retention/rows/variant={row['variant']}/{key}")
        for row in report.rows() if row["variant"].startswith("mapped@") for key in ("normalized_retention", "kl")
        if math.isfinite(row[key])}  # undefined where full and no-context tie
