"""The target budget a sibling direction's recipes run at: the largest the TTFT goals leave. A `benchmarks.ttft` sweep
(``--sweep``, results ``ttft-<pair>-sweep``) times refreshes of several budgets against the target's full prefill in
one run; the budget is the largest B such that the refresh (probe pass included: the costliest recipe at a budget) of
every swept budget up to B meets the goal at every swept context length that has one (a budget that passes only by
noise above one that failed does not count), and a default's maps may cost no more per token than the maps the sweep
timed. Goals at lengths the sweep did not time are not checked here: the defaults' own TTFT run reports them. Where
no swept budget meets the goals, the runs keep the published recipe's budget and say so."""

from __future__ import annotations

from . import siblings
from .common import RESULTS, read_results
from peft_kvcache.errors import RecordError

TTFT_GOALS = {2048: 10, 8192: 30}  # the sibling defaults' TTFT speedup goals by context length


def ttft_budget(sweep: dict, goals: dict[int, int] = TTFT_GOALS) -> dict:
    """The budget a sweep's payload leaves (None if its smallest refresh already misses a goal), per swept budget the
    slowest refresh's speedup at each length with a goal and whether it met them all, the lengths checked and the
    goals' lengths the sweep did not time."""
    verdicts: dict[int, dict] = {}
    for row in sweep["rows"]:
        goal = goals.get(row["context"])
        for name, r in row["recipes"].items():
            if goal is None or not name.startswith("refresh@"):
                continue
            verdict = verdicts.setdefault(r["budget"], {"speedups": {}, "meets": True})
            verdict["speedups"][row["context"]] = min(r["speedup"], verdict["speedups"].get(row["context"], r["speedup"]))
            verdict["meets"] &= r["speedup"] >= goal
    budget = None
    for candidate, verdict in sorted(verdicts.items()):
        if not verdict["meets"]:
            break
        budget = candidate
    swept = sorted({row["context"] for row in sweep["rows"]})
    return {"budget": budget, "goals": goals, "budgets": dict(sorted(verdicts.items())),
            "checked": [n for n in swept if n in goals], "unchecked": sorted(set(goals) - set(swept))}


def sweep_stem(direction: str) -> str:
    return f"ttft-{siblings.pair_name(direction)}-sweep"


def direction_budget(direction: str) -> dict:
    """Where ``direction``'s budget comes from: its sweep's choice (``budget``, None where no swept refresh meets the
    goals: the runs then keep the published recipe's), the maps it ran and their multiply-adds per token (a default's
    maps may cost no more: only those were timed), the lengths checked and unchecked. Refuses (`RecordError`) without
    a sweep."""
    stem = sweep_stem(direction)
    if not (RESULTS / f"{stem}.json").is_file():
        raise RecordError(f"no {stem}.json: the budget comes from a TTFT sweep; run `python -m benchmarks.ttft --pair "
                          f"{direction} --lengths 2048 8192 --sweep refresh@64/p32 refresh@80/p48 ...` first")
    sweep = read_results(stem)
    choice = ttft_budget(sweep)
    return {"budget": choice["budget"], "sweep": stem, "maps": sweep.get("maps", "published"),
            "multiply_adds_per_token": sweep.get("map_multiply_adds_per_token"), "checked": choice["checked"],
            "unchecked": choice["unchecked"]}
