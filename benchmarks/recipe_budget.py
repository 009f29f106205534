"""The target budget a sibling direction's recipes run at: the largest the TTFT goals leave. A `benchmarks.ttft` sweep
(``--sweep``, results ``ttft-<pair>-sweep``) times refreshes of several budgets against the target's full prefill in
one run; the budget is the largest B such that the refresh (probe pass included: the costliest recipe at a budget) of
every swept budget up to B meets the goal at every swept context length that has one (a budget that passes only by
noise above one that failed does not count), and a default's maps may cost no more per token than the maps the sweep
timed. A sweep keeps the earlier runs, and the budget must meet the goals in every one of them that timed maps of the
same label and size with as many threads (`same_maps`): on a machine whose speed drifts by a quarter within an hour,
one run's pass at the margin is not a budget a user can count on. A budget no run timed at some length with a goal is
passed over: it neither qualifies nor stops the larger ones (only a miss stops the scan). Goals at lengths no run
timed are not checked here: the defaults' own TTFT run reports them. Where no swept budget meets the goals, the runs
keep the published recipe's budget and say so."""

from __future__ import annotations

from . import siblings
from .common import RESULTS, read_results
from peft_kvcache.errors import RecordError

TTFT_GOALS = {2048: 10, 8192: 30}  # the sibling defaults' TTFT speedup goals by context length


def ttft_budget(sweep: dict, goals: dict[int, int] = TTFT_GOALS) -> dict:
    """The budget a sweep's payload leaves (None if the smallest refresh timed at every goal's length misses one, or
    none was), per swept budget the slowest refresh's speedup at each length with a goal, the checked lengths it was
    not timed at and whether it met every goal (timed at each checked length), the lengths checked and the goals'
    lengths the sweep did not time."""
    verdicts: dict[int, dict] = {}
    for row in sweep["rows"]:
        goal = goals.get(row["context"])
        for name, r in row["recipes"].items():
            if goal is None or not name.startswith("refresh@"):
                continue
            verdict = verdicts.setdefault(r["budget"], {"speedups": {}, "meets": True})
            verdict["speedups"][row["context"]] = min(r["speedup"], verdict["speedups"].get(row["context"], r["speedup"]))
            verdict["meets"] &= r["speedup"] >= goal
    swept = sorted({row["context"] for row in sweep["rows"]})
    checked = [n for n in swept if n in goals]
    for verdict in verdicts.values():  # a budget some checked length never timed has not shown it meets that goal
        verdict["untimed"] = [n for n in checked if n not in verdict["speedups"]]
        verdict["meets"] &= not verdict["untimed"]
    budget = None
    for candidate, verdict in sorted(verdicts.items()):
        if verdict["untimed"] and all(s >= goals[n] for n, s in verdict["speedups"].items()):
            continue  # never timed at some length, not seen to miss: it neither counts nor stops larger budgets
        if not verdict["meets"]:
            break
        budget = candidate
    return {"budget": budget, "goals": goals, "budgets": dict(sorted(verdicts.items())),
            "checked": checked, "unchecked": sorted(set(goals) - set(swept))}


def same_maps(run: dict, other: dict) -> bool:
    """Whether two sweep runs timed maps of the same label, size and cost per token (a cost either leaves unrecorded
    is not compared) with as many threads: the maps' weights do not move a timing, their shapes and the threads do."""
    costs = (run.get("map_multiply_adds_per_token"), other.get("map_multiply_adds_per_token"))
    threads = (run.get("provenance", {}).get("torch_threads"), other.get("provenance", {}).get("torch_threads"))
    return (run.get("maps") == other.get("maps") and run.get("map_parameters") == other.get("map_parameters")
            and (None in costs or costs[0] == costs[1]) and (None in threads or threads[0] == threads[1]))


def with_earlier_runs(payload: dict, previous: dict | None) -> dict:
    """A new sweep's ``payload`` with ``earlier_runs``: the ``previous`` results file's run and its own earlier runs,
    each with its provenance, whatever maps they timed (`direction_budget` reads those of the same maps)."""
    if previous is None:
        return payload
    return {**payload, "earlier_runs": [{k: v for k, v in previous.items() if k != "earlier_runs"},
                                        *previous.get("earlier_runs", [])]}


def runs_of_the_same_maps(sweep: dict) -> list[dict]:
    """The sweep's latest run and its earlier runs that timed the same maps (`same_maps`), newest first."""
    return [sweep, *(run for run in sweep.get("earlier_runs", []) if same_maps(run, sweep))]


def budget_over_runs(sweep: dict) -> tuple[dict, list[dict]]:
    """The `ttft_budget` of a sweep's runs of the same maps (`runs_of_the_same_maps`) taken together, and those runs:
    every run's rows at once, so a budget holds where its slowest refresh in any run meets the goals."""
    runs = runs_of_the_same_maps(sweep)
    return ttft_budget({"rows": [row for run in runs for row in run["rows"]]}), runs


def sweep_stem(direction: str) -> str:
    return f"ttft-{siblings.pair_name(direction)}-sweep"


def direction_budget(direction: str) -> dict:
    """Where ``direction``'s budget comes from: its sweep's choice over its runs of the same maps (``budget``: the
    `ttft_budget` of all their rows, so a budget holds only where every run that swept it met the goals; None where no
    swept budget meets them: the runs then keep the published recipe's), the maps it ran and their
    multiply-adds per token (a default's maps may cost no more: only those were timed), the number of runs, the lengths
    some run checked and those none did. Refuses (`RecordError`) without a sweep."""
    stem = sweep_stem(direction)
    if not (RESULTS / f"{stem}.json").is_file():
        raise RecordError(f"no {stem}.json: the budget comes from a TTFT sweep; run `python -m benchmarks.ttft --pair "
                          f"{direction} --label LABEL --lengths 2048 8192 --sweep refresh@64/p32 refresh@80/p48 ...` "
                          "first (LABEL: the lever whose maps the sweep times)")
    sweep = read_results(stem)
    choice, runs = budget_over_runs(sweep)
    return {"budget": choice["budget"], "sweep": stem, "runs": len(runs), "maps": sweep.get("maps", "published"),
            "multiply_adds_per_token": sweep.get("map_multiply_adds_per_token"), "checked": choice["checked"],
            "unchecked": choice["unchecked"]}
