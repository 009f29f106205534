"""The target budget a sibling direction's recipes run at: the largest the TTFT goals leave. A `benchmarks.ttft` sweep
(``--sweep``, results ``ttft-<pair>-sweep``) times refreshes of several budgets against the target's full prefill in
one run; the budget is the largest whose refresh (probe pass included: the costliest recipe at a budget) meets the
goal at every swept context length that has one. The selection and final runs compare recipes at that budget, so the
default they choose can reach the goals by construction (the defaults' own TTFT run checks it)."""

from __future__ import annotations

from . import siblings
from .common import RESULTS, read_results
from peft_kvcache.errors import RecordError

TTFT_GOALS = {2048: 10, 8192: 30}  # the sibling defaults' TTFT speedup goals by context length


def ttft_budget(sweep: dict, goals: dict[int, int] = TTFT_GOALS) -> dict:
    """The largest target budget whose refresh meets the TTFT goal at every swept context length that has one, from a
    sweep's payload; None if no swept refresh does. Returns the budget and, per swept budget, the speedup at each
    length and whether it passed."""
    verdicts: dict[int, dict] = {}
    for row in sweep["rows"]:
        goal = goals.get(row["context"])
        for name, r in row["recipes"].items():
            if goal is None or not name.startswith("refresh@"):
                continue
            verdict = verdicts.setdefault(r["budget"], {"speedups": {}, "meets": True})
            verdict["speedups"][row["context"]] = r["speedup"]
            verdict["meets"] &= r["speedup"] >= goal
    meeting = [budget for budget, verdict in verdicts.items() if verdict["meets"]]
    return {"budget": max(meeting, default=None), "goals": goals, "budgets": dict(sorted(verdicts.items()))}


def sweep_stem(direction: str) -> str:
    return f"ttft-{siblings.pair_name(direction)}-sweep"


def direction_budget(direction: str) -> int | None:
    """The budget ``direction``'s recipes run at, from its sweep: None where no swept refresh meets the goals (the runs
    then keep the published recipe's budget, and the defaults' TTFT run reports the miss); refuses (`RecordError`)
    without a sweep."""
    stem = sweep_stem(direction)
    if not (RESULTS / f"{stem}.json").is_file():
        raise RecordError(f"no {stem}.json: the budget comes from a TTFT sweep; run `python -m benchmarks.ttft --pair "
                          f"{direction} --lengths 2048 --sweep refresh@64/p32 refresh@80/p48 ...` first")
    return ttft_budget(read_results(stem))["budget"]
