"""The target budget a sibling direction's recipes run at: the largest the TTFT goals leave. A `benchmarks.ttft` sweep
(``--sweep``, results ``ttft-<pair>-sweep``) times refreshes of several budgets against the target's full prefill in
one run; the budget is the largest B such that the refresh (probe pass included: the costliest recipe at a budget) of
every swept budget up to B meets the goal at every swept context length that has one (a budget that passes only by
noise above one that failed does not count), and a default's maps may cost no more per token than the maps the sweep
timed. A sweep keeps the earlier runs that timed maps of the same label and size (`same_maps`), and the budget must
meet the goals in every one of them: on a machine whose speed drifts by a quarter within an hour, one run's pass at
the margin is not a budget a user can count on. Goals at lengths no run timed are not checked here: the defaults'
own TTFT run reports them. Where no swept budget meets the goals, the runs keep the published recipe's budget and
say so."""

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


def same_maps(run: dict, other: dict) -> bool:
    """Whether two sweep runs timed maps of the same label, size and cost per token (a cost either leaves unrecorded
    is not compared): the maps' weights do not move a timing, their shapes do."""
    costs = (run.get("map_multiply_adds_per_token"), other.get("map_multiply_adds_per_token"))
    return (run.get("maps") == other.get("maps") and run.get("map_parameters") == other.get("map_parameters")
            and (None in costs or costs[0] == costs[1]))


def with_earlier_runs(payload: dict, previous: dict | None) -> dict:
    """A new sweep's ``payload`` with ``earlier_runs``: the ``previous`` results file's run and its own earlier runs
    (each with its provenance), those that timed the same maps (`same_maps`); others are dropped."""
    if previous is None:
        return payload
    runs = [{k: v for k, v in previous.items() if k != "earlier_runs"}, *previous.get("earlier_runs", [])]
    return {**payload, "earlier_runs": [r for r in runs if same_maps(r, payload)]}


def sweep_stem(direction: str) -> str:
    return f"ttft-{siblings.pair_name(direction)}-sweep"


def direction_budget(direction: str) -> dict:
    """Where ``direction``'s budget comes from: its sweep's choice over its runs (``budget``: the smallest of the runs'
    own, None where some run's smallest refresh misses a goal: the runs then keep the published recipe's), the maps it
    ran and their multiply-adds per token (a default's maps may cost no more: only those were timed), the number of
    runs, the lengths some run checked and those none did. Refuses (`RecordError`) without a sweep."""
    stem = sweep_stem(direction)
    if not (RESULTS / f"{stem}.json").is_file():
        raise RecordError(f"no {stem}.json: the budget comes from a TTFT sweep; run `python -m benchmarks.ttft --pair "
                          f"{direction} --lengths 2048 8192 --sweep refresh@64/p32 refresh@80/p48 ...` first")
    sweep = read_results(stem)
    choices = [ttft_budget(run) for run in (sweep, *sweep.get("earlier_runs", []))]
    budgets = [choice["budget"] for choice in choices]
    checked = sorted({n for choice in choices for n in choice["checked"]})
    return {"budget": None if None in budgets else min(budgets), "sweep": stem, "runs": len(choices),
            "maps": sweep.get("maps", "published"), "multiply_adds_per_token": sweep.get("map_multiply_adds_per_token"),
            "checked": checked, "unchecked": sorted(set(TTFT_GOALS) - set(checked))}
