"""Per-example scores of the sibling recipes' records (`benchmarks.recipes`) and their statistics: normalized
retention over a set of examples, paired differences, and 95% intervals from a bootstrap over files (all windows of a
resampled file move together); and the same lever's two fits compared example by example. `benchmarks.recipe_report`
builds its tables on them."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from peft_kvcache.calibration.retention import MIN_GAP

BOOTSTRAP, SEED = 2000, 0
# normalized retention divides by full - no context: resamples whose gap is below MIN_GAP (mean accuracy) make the
# ratio meaningless; past DEGENERATE_SHARE of them an interval is not given (NaN), however the others fall
DEGENERATE_SHARE = 0.01
# below this many files a bootstrap over files has too few distinct resamples to be an interval (2 files: 3)
MIN_FILES = 5
RECALL = "recall (pooled)"


@dataclass
class Scores:
    """Per-example accuracy of every variant on one direction and task (only examples scored by both of a pair
    count in a paired comparison), with each example's file."""

    accuracy: dict[str, dict[str, float]]  # variant -> example -> accuracy over its scored tokens
    kl: dict[str, dict[str, float]]
    files: dict[str, str]

    def common(self, *variants: str) -> list[str]:
        """The examples every one of ``variants`` (and full, no_context) was scored on, in a fixed order."""
        sets = [set(self.accuracy.get(v, {})) for v in ("full", "no_context", *variants)]
        return sorted(set.intersection(*sets))


def current_maps(records: list[dict], direction: str) -> dict[str, str]:
    """``{map set label: fingerprint}``: the map each set held in its latest record of ``direction``."""
    return {r["maps"]: r["map"] for r in records if r["direction"] == direction and r.get("map") is not None}


def group(records: list[dict], direction: str) -> dict[str, Scores]:
    """``{task: Scores}`` for one direction, and every recall task pooled under `RECALL`. A record measured again
    (same example, variant and map) counts once: the latest. Of a map set (``maps``) only the records of the map it
    held last count (its fingerprint in the latest record), and of the models' dtypes the latest: examples measured
    with maps since replaced, or with the models in another dtype, are dropped, never mixed with the new ones."""
    current = current_maps(records, direction)
    return _scores(records, direction, lambda r: None if r.get("map") is not None and r["map"] != current[r["maps"]]
                   else r["variant"])


def _scores(records: list[dict], direction: str, name_of) -> dict[str, Scores]:
    """``{task: Scores}`` of ``direction``'s records in the models' latest dtype, each filed under ``name_of(record)``
    (None: left out); a recall task's records also under `RECALL`, pooled. A later record of a name and example
    replaces an earlier one."""
    dtype = next((r["dtype"] for r in reversed(records) if r["direction"] == direction), None)
    by_task: dict[str, Scores] = defaultdict(lambda: Scores(defaultdict(dict), defaultdict(dict), {}))
    for r in records:
        name = name_of(r) if r["direction"] == direction and r["dtype"] == dtype else None
        if name is None:
            continue
        for task in (r["task"], RECALL) if r["task"].startswith("recall-") else (r["task"],):
            scores = by_task[task]
            scores.accuracy[name][r["example"]] = r["correct"] / r["tokens"]
            scores.kl[name][r["example"]] = r["kl"]
            scores.files[r["example"]] = r["file"]
    return dict(by_task)


def refits(records: list[dict], direction: str) -> dict[str, tuple[str, str]]:
    """``{map set label: (previous fingerprint, current fingerprint)}`` for the map sets of ``direction`` fitted again
    (the same label and options, so the same calibration texts): the current map and the one it replaced (the last
    other fingerprint its records hold)."""
    current = current_maps(records, direction)
    out = {}
    for label, now in current.items():
        before = [r["map"] for r in records if r["direction"] == direction and r["maps"] == label
                  and r.get("map") not in (None, now)]
        if before:
            out[label] = (before[-1], now)
    return out


def refit_scores(records: list[dict], direction: str, label: str, fingerprints: tuple[str, str]) -> dict[str, Scores]:
    """``{task: Scores}`` of one map set's two fits: its variants named ``variant@fingerprint`` (both fits), beside the
    references (full, no context) in the models' latest dtype, so that `summary` pairs the two fits example by
    example."""
    def name_of(r: dict) -> str | None:
        if r["variant"] in ("full", "no_context"):
            return r["variant"]
        return f"{r['variant']}@{r['map']}" if r["maps"] == label and r.get("map") in fingerprints else None

    return _scores(records, direction, name_of)


def refit_differences(records: list[dict], direction: str) -> list[dict]:
    """For each map set fitted again (`refits`) and each of its recipes measured with both fits: the current fit
    minus the previous one, paired on the same examples, per task (continuation and pooled recall): how much a lever's
    row moves when nothing but the fit is redone, to weigh the lever table's differences against."""
    out = []
    for label, (before, now) in sorted(refits(records, direction).items()):
        tasks = refit_scores(records, direction, label, (before, now))
        recipes = sorted({name.rsplit("@", 1)[0] for scores in tasks.values() for name in scores.accuracy
                          if name.endswith(f"@{now}")})
        for variant in recipes:
            entry = {"maps": label, "variant": variant, "previous": before, "current": now}
            for task in ("continuation", RECALL):
                scores = tasks.get(task)
                if scores is None or f"{variant}@{before}" not in scores.accuracy:
                    continue
                current, previous = f"{variant}@{now}", f"{variant}@{before}"
                paired = summary(scores, current, previous)
                if paired["examples"]:  # both fits on the examples both were measured on
                    examples = scores.common(current, previous)
                    entry[task] = {"examples": paired["examples"],
                                   "previous": float(normalized(scores, previous, examples)),
                                   "current": paired["normalized"], "difference": paired["minus_control"],
                                   "interval": paired["minus_control_interval"],
                                   "kl_previous": sum(scores.kl[previous][e] for e in examples) / len(examples),
                                   "kl_current": paired["kl"]}
            if "continuation" in entry or RECALL in entry:
                out.append(entry)
    return out


def cluster_weights(files: list[str], count: int = BOOTSTRAP, seed: int = SEED) -> torch.Tensor:
    """``[count, examples]``: how often each example is drawn when whole files are resampled with replacement."""
    names = sorted(set(files))
    cluster = torch.tensor([names.index(f) for f in files])
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, len(names), (count, len(names)), generator=generator)
    per_file = torch.zeros(count, len(names)).scatter_add_(1, draws, torch.ones(count, len(names)))
    return per_file[:, cluster]


def mean_accuracy(scores: Scores, name: str, examples: list[str], weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean accuracy of ``name`` over ``examples`` (a scalar, or one per resample of ``weights``)."""
    values = torch.tensor([scores.accuracy[name][e] for e in examples], dtype=torch.float64)
    return values.mean() if weights is None else (weights.double() @ values) / weights.sum(1).double()


def normalized(scores: Scores, variant: str, examples: list[str], weights: torch.Tensor | None = None) -> torch.Tensor:
    """(variant - no context) / (full - no context) of mean accuracy over ``examples`` (weighted per resample)."""
    full, none = mean_accuracy(scores, "full", examples, weights), mean_accuracy(scores, "no_context", examples, weights)
    return (mean_accuracy(scores, variant, examples, weights) - none) / (full - none)


def summary(scores: Scores, variant: str, control: str | None) -> dict:
    """Normalized retention of ``variant`` with its interval, its mean KL, and its paired difference from ``control``
    (None: no control row), on the examples both were scored on."""
    examples = scores.common(variant, *([control] if control else []))
    if not examples:
        return {"examples": 0}
    weights = cluster_weights([scores.files[e] for e in examples])
    gap = mean_accuracy(scores, "full", examples, weights) - mean_accuracy(scores, "no_context", examples, weights)
    degenerate = int((gap < MIN_GAP).sum())  # resamples where the context barely helps the full prefill itself

    files = len({scores.files[e] for e in examples})

    def bounds(values: torch.Tensor) -> list[float]:
        values = values[gap >= MIN_GAP]
        if degenerate > DEGENERATE_SHARE * len(gap) or not values.numel() or files < MIN_FILES:
            return [float("nan")] * 2
        return [float(values.quantile(0.025)), float(values.quantile(0.975))]

    def point(value: torch.Tensor) -> float:  # the examples' own ratio, void where their gap is (as a resample's)
        full_gap = mean_accuracy(scores, "full", examples) - mean_accuracy(scores, "no_context", examples)
        return float(value) if full_gap >= MIN_GAP else float("nan")

    out = {"examples": len(examples), "files": files,
           "degenerate_resamples": degenerate,
           "normalized": point(normalized(scores, variant, examples)),
           "interval": bounds(normalized(scores, variant, examples, weights)),
           "kl": sum(scores.kl[variant][e] for e in examples) / len(examples)}
    if control:
        difference = point(normalized(scores, variant, examples) - normalized(scores, control, examples))
        resampled = normalized(scores, variant, examples, weights) - normalized(scores, control, examples, weights)
        out.update({"control": control, "minus_control": float(difference), "minus_control_interval": bounds(resampled)})
    return out
