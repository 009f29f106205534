"""Tables from the sibling recipes' per-example records (`benchmarks.recipes`): per direction and task, each
variant's normalized retention and its paired difference from the window-only control at equal target compute, with
95% intervals from a bootstrap over files (all windows of a resampled file move together), and the default recipe
each direction has earned on the selection texts (the scores and their statistics: `benchmarks.recipe_scores`).

    python -m benchmarks.recipes report --role selection --context 2048

Writes benchmarks/results/sibling-recipes-<role>-<context>.json/.md.
"""

from __future__ import annotations

from pathlib import Path

from . import siblings
from .common import RESULTS, ROOT, map_fingerprint, save, table
from .ttft import prefill_multiply_adds_per_token
from peft_kvcache.errors import RecordError
from peft_kvcache.maps.storage import WEIGHTS_NAME

from .recipe_budget import TTFT_GOALS
from .recipe_scores import RECALL, Scores, current_maps, group, normalized, refit_differences, summary
from .recipe_records import read_records, records_path
from .recipes import check_chosen_maps, chosen_defaults, report_stem

RECALL_FLOOR = 0.95  # a default keeps at least this normalized far-fact recall
TTFT_LENGTH = max(TTFT_GOALS)  # the goal at the longest context bounds the maps' cost
TTFT_GOAL = TTFT_GOALS[TTFT_LENGTH]


def recipe_budget(records: list[dict], runs: list[dict], direction: str) -> int:
    """The direction's recipe budget: the latest run's (runs record the budget they compared recipes at); for records
    of older runs, the one most of the published-map refresh variants run at (0 without any)."""
    recorded = [run["budgets"][direction] for run in runs if direction in run.get("budgets", {})]
    if recorded:
        return recorded[-1]
    budgets = [r["budget"] for r in {(r["variant"], r["budget"]): r for r in records
                                     if r["direction"] == direction and r["variant"].startswith("refresh@")
                                     and r["maps"] == "published"}.values()]
    return max(set(budgets), key=budgets.count) if budgets else 0


def budget_source(runs: list[dict], direction: str) -> dict | None:
    """Where the latest run's budget in ``direction`` came from (`recipes.budget_sources`; None for older runs)."""
    sources = [run["budget_sources"][direction] for run in runs if direction in run.get("budget_sources", {})]
    return sources[-1] if sources else None


def cost_limit(runs: list[dict], direction: str) -> int:
    """The most multiply-adds per token a default's maps may cost: `map_cost_limit`, and no more than the maps the
    TTFT sweep that set the budget timed (a costlier map's recipe was not timed at that budget)."""
    timed = (budget_source(runs, direction) or {}).get("multiply_adds_per_token")
    return map_cost_limit(direction) if timed is None else min(map_cost_limit(direction), timed)


def budget_note(runs: list[dict], direction: str) -> str:
    """Where the latest run's budget in ``direction`` came from, in a sentence ("" for runs that did not record it)."""
    source = budget_source(runs, direction)
    if source is None:
        return ""
    said = f"The budget, {source['budget']}, comes from {source['from']}"
    if "sweep" in source:
        swept_runs = source.get("runs", 1)
        said += f" (`{source['sweep']}.md`, timed with the {source['maps']} maps"
        met = source["from"] == "the TTFT sweep" and swept_runs > 1
        said += f", met in each of {swept_runs} runs" if met else ""
        said += f"; goals checked at {', '.join(map(str, source['checked'])) or 'no length'}"
        said += f", not at {', '.join(map(str, source['unchecked']))})" if source.get("unchecked") else ")"
    return said + "."


def control_of(variant: str, compute: int) -> str | None:
    """The window-only control at the variant's target compute (none for the references and the controls)."""
    if variant in ("full", "no_context") or variant.startswith("window@") or compute < 2:
        return None
    return f"window@{compute}"


def planned_examples(runs: list[dict], direction: str) -> dict[str, int] | None:
    """The examples per task (continuation, and recall pooled under `RECALL`) the latest of ``runs`` in ``direction``
    (a run names its directions by their budgets; one that names none, every direction) that recorded its plan set
    out to score (`recipes.run`); None where no run recorded one (runs before plans were recorded)."""
    plan = next((run["planned"] for run in reversed(runs)
                 if "planned" in run and direction in run.get("budgets", {direction: None})), None)
    if plan is None:
        return None
    return {"continuation": plan.get("continuation", 0),
            RECALL: sum(n for task, n in plan.items() if task.startswith("recall-"))}


def choose_default(rows: dict[str, dict], budget: int, costs: dict[str, int] | None = None,
                   cost_limit: int | None = None, gone: frozenset[str] = frozenset(),
                   planned: dict[str, int] | None = None) -> dict:
    """Among the recipes at the direction's budget that use no oracle, on the published maps or a lever's (a variant
    ``label:recipe``): those whose continuation interval against the window-only control is not below zero (its upper
    end at or above zero: not measurably worse than the control; above zero, its lower end, is the goal), whose
    pooled recall keeps `RECALL_FLOOR`, and whose maps' multiply-adds per token (``costs[label]``) stay within
    ``cost_limit`` (a lever's maps need both; without a limit only the published maps compete), and that were scored on
    every example the control was and every one the run ``planned`` (`planned_examples`: a run stopped halfway leaves
    the control as short as the rest); the best continuation wins. While a candidate that may compete is scored on fewer
    examples (a run stopped halfway, a lever's maps fitted again), nothing is chosen: it is ``waiting``; unless its
    maps are ``gone`` (labels no folder holds the weights of any more: nothing can complete them). A gone candidate
    never qualifies (it can be neither measured on the final texts nor published), and where it would have won
    (``gone_best``) nothing is chosen either: the runner-up never takes its place. Returns the choice (None if no
    recipe qualifies, one is waited for or the best is gone) and why each candidate passed or failed."""
    control = rows.get(f"window@{budget}", {})
    wanted = {task: max(control.get(task, {}).get("examples", 0), (planned or {}).get(task, 0))
              for task in ("continuation", RECALL)}
    verdicts, standing = {}, {}  # standing: would qualify but for gone maps (name -> continuation)
    for name, row in rows.items():
        label = row.get("maps", "published")
        if "true-" in name or row["compute"] != budget or row.get("kind") not in ("hybrid", "refresh", "index") \
                or (label != "published" and cost_limit is None):
            continue
        cont, recall = row.get("continuation", {}), row.get(RECALL, {})
        counts = [cont.get("examples", 0), recall.get("examples", 0)]
        if not any(counts):
            continue
        cost = (costs or {}).get(label)
        affordable = cost_limit is None or (cost is not None and cost <= cost_limit)
        complete = counts[0] >= wanted["continuation"] and counts[1] >= wanted[RECALL]
        nan = float("nan")  # a task not scored yet (an incomplete candidate never qualifies)
        interval = cont.get("minus_control_interval", [nan, nan])
        stands = (complete and affordable and interval[1] >= 0
                  and recall.get("normalized", nan) >= RECALL_FLOOR)
        verdicts[name] = {"maps": label, "continuation": cont.get("normalized", nan),
                          "minus_control": cont.get("minus_control", nan), "interval": interval,
                          "recall": recall.get("normalized", nan), "examples": counts, "complete": complete,
                          "multiply_adds_per_token": cost, "within_cost": affordable, "maps_gone": label in gone,
                          "qualifies": stands and label not in gone}
        if stands:
            standing[name] = verdicts[name]["continuation"]
    # a candidate that may compete but is not yet scored on every example (a run under way, maps fitted again) could
    # still win: the choice waits for it instead of falling to the runner-up
    waiting = sorted(n for n, v in verdicts.items() if v["within_cost"] and not v["complete"] and not v["maps_gone"])
    best = max(standing, key=standing.get) if standing and not waiting else None
    # best, but nothing can publish it: never the runner-up in its place (as while waiting)
    gone_best = best if best is not None and verdicts[best]["maps_gone"] else None
    default = None if gone_best else best
    return {"default": default, "maps": None if default is None else verdicts[default]["maps"],
            "cost_limit": cost_limit, "waiting": waiting, "gone_best": gone_best, "candidates": verdicts}


def map_cost_limit(direction: str) -> int:
    """The most multiply-adds per token a default's maps may cost in ``direction``: the target's prefill per token at
    `TTFT_LENGTH` over `TTFT_GOAL` (a map that costs more cannot reach the goal, whatever else a switch costs)."""
    target = siblings.model_config(siblings.DIRECTIONS[direction][1])
    return prefill_multiply_adds_per_token(target, TTFT_LENGTH) // TTFT_GOAL


def lever_gains(scores: Scores, budget: int, added_to: dict[str, str] | None = None) -> list[dict]:
    """Each lever's recipes (variants ``label:recipe``) against the published maps' same recipe, paired on the same
    examples, and for the hybrid at the budget the share of the oracle gap it closes: (lever - published) /
    (oracle - published), the oracle being the target's own keys (or values) in the mapped prefix. A lever added to
    another's maps (``added_to[label]``: distillation or nonlinear heads ``--on`` that lever) is also paired against
    that lever's same recipe (``minus_on``): what the addition itself gains."""
    out = []
    for name in sorted(scores.accuracy):
        label, _, recipe = name.partition(":")
        if not recipe or recipe not in scores.accuracy:
            continue
        paired = summary(scores, name, recipe)
        if not paired["examples"]:
            continue
        entry = {"lever": label, "recipe": recipe, "examples": paired["examples"], "normalized": paired["normalized"],
                 "minus_published": paired["minus_control"], "interval": paired["minus_control_interval"]}
        base = f"{(added_to or {}).get(label)}:{recipe}"
        if base in scores.accuracy:
            on = summary(scores, name, base)
            if on["examples"]:
                entry.update(on=base.partition(":")[0], minus_on=on["minus_control"],
                             minus_on_interval=on["minus_control_interval"])
        for oracle in ("keys", "values"):
            swap = f"hybrid@{budget}+true-{oracle}"
            if recipe != f"hybrid@{budget}" or swap not in scores.accuracy:
                continue
            examples = scores.common(name, recipe, swap)
            published = normalized(scores, recipe, examples)
            gap = float(normalized(scores, swap, examples) - published)
            entry[f"{oracle}_gap_closed"] = float(normalized(scores, name, examples) - published) / gap if gap else None
        out.append(entry)
    return out


def trade_off(rows: dict[str, dict]) -> dict[str, dict[str, list[dict]]]:
    """Per budget, the points of continuation against pooled recall as the budget moves from the recent window to
    picked positions: ``index`` (the mapped middle dropped) and ``refresh`` (kept) from the window-only control (no
    picked position) up, ordered by the positions picked; ``hybrid`` (the mapped prefix, a recent window) alone. A
    lever's maps make series of their own (``label:refresh``): one line never joins two map sets."""
    def point(name: str, picked: int) -> dict | None:
        cont, recall = rows[name].get("continuation", {}), rows[name].get(RECALL, {})
        if not cont.get("examples") or not recall.get("examples"):
            return None
        return {"variant": name, "picked": picked, "continuation": cont["normalized"], "recall": recall["normalized"]}

    out: dict[str, dict[str, list[dict]]] = {}
    for name, row in rows.items():
        if "true-" in name or row.get("kind") not in ("index", "refresh", "hybrid"):
            continue
        picked = int(name.rsplit("/p", 1)[1]) if "/p" in name else 0
        found = point(name, picked)
        if found is not None:
            family = row["kind"] if row.get("maps", "published") == "published" else f"{row['maps']}:{row['kind']}"
            out.setdefault(str(row["budget"]), {}).setdefault(family, []).append(found)
    for budget, series in out.items():
        window = f"window@{budget}"
        start = point(window, 0) if window in rows else None
        for family in series:
            if family.rpartition(":")[2] in ("index", "refresh"):
                series[family] = ([start] if start else []) + sorted(series[family], key=lambda p: p["picked"])
    return out


def plot_trade_off(payload: dict, path) -> None:
    """One panel per direction: continuation against recall, a line per budget and recipe family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions = [d for d in payload["directions"] if payload["directions"][d]["trade_off"]]
    if not directions:
        return
    fig, axes = plt.subplots(1, len(directions), figsize=(6.5 * len(directions), 6.5), squeeze=False)
    for ax, direction in zip(axes[0], directions):
        budgets = sorted(payload["directions"][direction]["trade_off"].items(), key=lambda item: int(item[0]))
        map_sets = sorted({family.rpartition(":")[0] for _, series in budgets for family in series})
        markers = dict(zip(map_sets, "osDv^<>ph*"))  # one marker per map set, one line style per kind
        for color, (budget, series) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], budgets):
            for family, points in sorted(series.items()):
                maps, _, kind = family.rpartition(":")
                ax.plot([p["recall"] for p in points], [p["continuation"] for p in points], color=color,
                        linestyle={"index": "-", "refresh": "--", "hybrid": "none"}[kind],
                        marker=markers.get(maps, "x"), label=f"{family} @{budget}")
        ax.set(xlabel="far-fact recall (normalized)", ylabel="continuation (normalized)",
               title=f"{payload['directions'][direction]['pair']} ({payload['role']}, {payload['context']} tokens)")
        # under the panel: inside, a legend of every budget and family hides the title and the points
        ax.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def held_folder(facts: dict) -> Path | None:
    """The folder a run recorded for a map set (`recipes.map_facts`), where it still holds the weights the run
    recorded (their fingerprint); None where none was recorded, or it holds other weights (fitted again) or none."""
    if not facts.get("folder"):
        return None
    folder = ROOT / facts["folder"]  # as the run was given it: relative to the repository root (or absolute)
    held = (folder / WEIGHTS_NAME).is_file() and map_fingerprint(folder) == facts["fingerprint"]
    return folder if held else None


def maps_gone(labels: set[str], facts: dict[str, dict]) -> frozenset[str]:
    """The map sets among ``labels`` whose weights no folder holds any more: none recorded (runs before map facts), or
    the recorded folder holds other weights (fitted again) or none (`held_folder`)."""
    return frozenset(label for label in labels if label not in facts or held_folder(facts[label]) is None)


def latest_map_facts(runs: list[dict], direction: str, current: dict[str, str] | None = None) -> dict[str, dict]:
    """Each map set's facts in ``direction`` (`recipes.map_facts`) as the latest run that used it recorded them (older
    runs recorded none); with ``current`` (label -> the fingerprint its records hold), only a run of those maps counts
    (a run that stopped before its first record may have held others)."""
    out = {}
    for run in runs:
        for label, by_direction in run.get("map_sets", {}).items():
            facts = by_direction.get(direction)
            if facts is not None and (current is None or label not in current
                                      or facts.get("fingerprint") == current[label]):
                out[label] = facts
    return out


def refit_cell(entry: dict, task: str) -> str:
    """One task's cell of the refit table: previous -> current normalized, their difference [interval] (examples)."""
    if task not in entry:
        return "-"
    t = entry[task]
    return (f"{t['previous']:.3f} -> {t['current']:.3f}: {t['difference']:+.3f} "
            f"[{t['interval'][0]:+.3f}, {t['interval'][1]:+.3f}] ({t['examples']})")


def report(role: str, context: int) -> dict:
    """Write the tables of the role's records at ``context``; returns the payload."""
    path = records_path(role, context)
    records = read_records(path)
    every = [run for run in read_records(path.with_name("runs.jsonl"))
             if run.get("role") == role and run.get("context") == context]
    live = {r.get("run") for r in records}  # the budgets: of runs that measured something here
    runs = [run for run in every if run.get("run") in live]
    # the plan and the maps' facts: of any run (one that found everything measured adds no record, yet says what a
    # complete run scores and where the maps lie now)
    planned = {d: planned_examples(every, d) for d in siblings.DIRECTIONS}
    meta = {r["variant"]: {"kind": r["kind"], "compute": r["compute"], "budget": r["budget"], "maps": r["maps"]}
            for r in records}
    payload, lines = {"role": role, "context": context, "directions": {}}, []
    lines += [f"# Sibling recipes at {context} tokens ({role} texts)", "",
              "Normalized retention [95% interval, files resampled]; minus the window-only control at equal target "
              "compute, paired on the same examples. Compute: context tokens the target runs (probe counted once).", ""]
    for direction in siblings.DIRECTIONS:
        tasks = group(records, direction)
        if "continuation" not in tasks:
            continue
        budget = recipe_budget(records, runs, direction)
        rows: dict[str, dict] = {}
        for task, scores in tasks.items():
            for variant in scores.accuracy:
                info = meta[variant]
                rows.setdefault(variant, dict(info))[task] = summary(scores, variant,
                                                                     control_of(variant, info["compute"]))
        fingerprints = current_maps(records, direction)
        facts = latest_map_facts(every, direction, fingerprints)
        choice = None
        if role == "selection":
            levers_compete = any(row.get("maps", "published") != "published" for row in rows.values())
            choice = choose_default(rows, budget, {label: f["multiply_adds_per_token"] for label, f in facts.items()},
                                    cost_limit(runs, direction) if levers_compete else None,
                                    maps_gone({row.get("maps", "published") for row in rows.values()}, facts),
                                    planned[direction])
        # the default these texts choose (selection) or report (final: the one the selection texts chose, on the
        # very maps they chose it on)
        if choice and choice["waiting"]:
            raise RecordError(f"{direction}: the default cannot be chosen while {', '.join(choice['waiting'])} "
                              "are scored on fewer examples than the control or the run planned; finish `python -m "
                              "benchmarks.recipes run --role selection` first (the selection report on disk is left as "
                              "it was)")
        if choice and choice["gone_best"]:
            raise RecordError(f"{direction}: {choice['gone_best']} is the best candidate, but no folder holds the maps "
                              "its rows were measured on (fitted again since, or not on this machine): fit them again "
                              "and measure its rows (`python -m benchmarks.recipes run --role selection`); the "
                              "selection report on disk is left as it was")
        if choice and choice["default"]:
            choice["fingerprint"] = fingerprints.get(choice["maps"])
        default = choice["default"] if choice else chosen_defaults().get(direction)
        if default is not None and default not in rows:
            raise RecordError(f"the final records of {direction} hold no {default!r}, the default the selection texts "
                              "chose: run `python -m benchmarks.recipes run --role final` again")
        if role == "final" and default is not None:
            check_chosen_maps(direction, default, fingerprints.get(rows[default]["maps"]))
        levers = lever_gains(tasks["continuation"], budget,
                             {label: f["added_to"] for label, f in facts.items() if f.get("added_to")})
        for entry in levers:
            known = facts.get(entry["lever"])
            entry["map"] = None if known is None else {k: known[k] for k in
                                                       ("parameters", "multiply_adds_per_token", "options", "distilled")}
        refitted = refit_differences(records, direction)
        # the weights the default was measured with: a card publishes only those (`scripts.publish`)
        default_map = fingerprints.get(rows[default]["maps"]) if default is not None else None
        payload["directions"][direction] = {"budget": budget, "rows": rows, "choice": choice, "default": default,
                                            "default_map": default_map, "planned": planned[direction],
                                            "pair": siblings.pair_name(direction), "trade_off": trade_off(rows),
                                            "levers": levers, "refits": refitted}
        order = sorted(rows, key=lambda v: (rows[v]["compute"], v))
        for task in ["continuation", RECALL, *sorted(t for t in tasks if t.startswith("recall-"))]:
            if task not in tasks:
                continue
            cells = []
            for v in order:
                s = rows[v].get(task, {})
                if not s.get("examples"):
                    continue
                vs = (f"{s['minus_control']:+.3f} [{s['minus_control_interval'][0]:+.3f}, "
                      f"{s['minus_control_interval'][1]:+.3f}]") if "control" in s else "-"
                cells.append([v, rows[v]["compute"], f"{s['examples']} ({s['files']})",
                              f"{s['normalized']:.3f} [{s['interval'][0]:.2f}, {s['interval'][1]:.2f}]",
                              f"{s['kl']:.3f}", vs])
            lines += [f"## {siblings.pair_name(direction)}, {task} (budget {budget})", "",
                      table(["variant", "compute", "examples (files)", "normalized", "KL", "minus window-only"], cells),
                      ""]
        if levers:
            share = lambda v: "-" if v is None else f"{v:+.2f}"  # noqa: E731
            size = lambda m: "-" if m is None else f"{m['parameters']:,} / {m['multiply_adds_per_token']:,}"  # noqa: E731
            cells = [[e["lever"], e["recipe"], e["examples"], f"{e['normalized']:.3f}",
                      f"{e['minus_published']:+.3f} [{e['interval'][0]:+.3f}, {e['interval'][1]:+.3f}]",
                      f"{share(e.get('keys_gap_closed'))} / {share(e.get('values_gap_closed'))}",
                      f"{e['on']}: {e['minus_on']:+.3f} [{e['minus_on_interval'][0]:+.3f}, "
                      f"{e['minus_on_interval'][1]:+.3f}]" if "on" in e else "-", size(e["map"])]
                     for e in levers]
            lines += [f"## {siblings.pair_name(direction)}, levers (continuation)", "",
                      "Each lever's maps against the published maps on the same recipe and examples (paired); for the "
                      "hybrid, the share of the gap to the target's own keys / values in the mapped prefix it closes; "
                      "a lever added to another's maps (distillation, nonlinear heads) also against those.",
                      "", table(["lever", "recipe", "examples", "normalized", "minus the published maps",
                                 "oracle gap closed: keys / values", "minus the maps it adds to",
                                 "map parameters / multiply-adds per token"], cells), ""]
        if refitted:
            cells = [[e["maps"], e["variant"], f"{e['previous']} -> {e['current']}", refit_cell(e, "continuation"),
                      refit_cell(e, RECALL)] for e in refitted]
            lines += [f"## {siblings.pair_name(direction)}, maps fitted again", "",
                      "A lever's maps fitted a second time with the same options and calibration texts, each recipe "
                      "measured with both fits on the same examples: the current fit minus the previous one, normalized "
                      "[95% interval, files resampled] (examples). Only the current fit counts in the tables above; "
                      "this says how far a row moves when nothing but the fit is redone.", "",
                      table(["maps", "recipe", "fingerprints", "continuation", "recall (pooled)"], cells), ""]
        if choice:
            limit = choice["cost_limit"]
            cells = [[name, "{} / {}".format(*v["examples"]), f"{v['continuation']:.3f}",
                      f"{v['minus_control']:+.3f} [{v['interval'][0]:+.3f}, {v['interval'][1]:+.3f}]",
                      f"{v['recall']:.3f}",
                      "-" if v["multiply_adds_per_token"] is None else f"{v['multiply_adds_per_token']:,}",
                      "yes" if v["qualifies"] else "no"]
                     for name, v in sorted(choice["candidates"].items(), key=lambda kv: -kv[1]["continuation"])]
            lines += [f"## {siblings.pair_name(direction)}, the default", "",
                      *([note, ""] if (note := budget_note(runs, direction)) else []),
                      f"Candidates at the budget, scored on every example the window-only control was and the run "
                      "planned (continuation / recall examples): continuation interval against the control not below "
                      f"zero (its upper end at or above zero), pooled recall >= {RECALL_FLOOR}"
                      + ("" if limit is None else f", maps within {limit:,} multiply-adds per token (the least of "
                         f"the target's prefill per token at {TTFT_LENGTH} tokens over the {TTFT_GOAL}x TTFT goal and "
                         "the maps the budget's TTFT sweep timed)") + ".", "",
                      table(["recipe", "examples", "continuation", "minus window-only", "recall",
                             "map multiply-adds per token", "qualifies"], cells), "",
                      f"Default earned: **{choice['default']}**" if choice["default"] else "No recipe qualifies.", ""]
        elif default:
            lines += [f"Default reported (chosen on the selection texts): **{default}**", ""]
    commits = sorted({r["commit"] for r in records if r.get("commit")})
    stem = report_stem(role, context)
    plot_trade_off(payload, RESULTS / f"{stem}.png")
    lines += [f"![continuation against recall]({stem}.png): per budget, from the window-only control (no picked "
              "position) to more picked positions and fewer recent ones; `index` drops the mapped middle, `refresh` "
              "keeps it, `hybrid` keeps the mapped prefix and a recent window.", ""]
    save(stem, {**payload, "records": str(path.relative_to(RESULTS.parent.parent)),
                                                "record_commits": commits, "runs": every},
         "\n".join(lines), data={"examples": sorted({r["example"] for r in records})})
    return payload
