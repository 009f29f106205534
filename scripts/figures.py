"""The figures of the published maps and the README: each one read by code from a results file under
benchmarks/results/, cited by file and key (`peft_kvcache.maps.config.Figure`)."""

from __future__ import annotations

from benchmarks import siblings
from benchmarks.adapters import PREFIX, results_stem
from benchmarks.common import ADAPTERS, RESULTS, ROOT, table
from benchmarks.common import read_results as results
from benchmarks.recipe_budget import TTFT_GOALS, budget_over_runs
from benchmarks.recipe_scores import RECALL
from benchmarks.recipes import SELECTION_CONTEXT, parse_recipe, report_stem, selection_choice
from benchmarks.tp_shards import markdown as tp_markdown
from benchmarks.vllm_report import markdown as vllm_markdown
from benchmarks.vllm_switch_cost import markdown as switch_cost_markdown
from peft_kvcache.lab.provenance import key_of, lookup
from peft_kvcache.maps.adapter_maps import folder_name
from peft_kvcache.maps.config import Figure, Refresh
from peft_kvcache.maps.storage import load_config
from scripts.vllm_targets import load_targets, switch_cost_targets

HUB_CARDS = ROOT / "hub_cards"
README_BEGIN, README_END = "<!-- figures:begin (scripts/publish.py writes this table) -->", "<!-- figures:end -->"
SERVE_BEGIN, SERVE_END = "<!-- serve-figures:begin (scripts/publish.py writes this table) -->", "<!-- serve-figures:end -->"
VLLM_BEGIN, VLLM_END = "<!-- vllm-figures:begin (scripts/publish.py writes this table) -->", "<!-- vllm-figures:end -->"
SWITCH_BEGIN, SWITCH_END = ("<!-- vllm-switch-cost:begin (scripts/publish.py writes this table) -->",
                            "<!-- vllm-switch-cost:end -->")
TP_BEGIN, TP_END = "<!-- tp-shards:begin (scripts/publish.py writes this table) -->", "<!-- tp-shards:end -->"
CALIBRATE_BEGIN, CALIBRATE_END = "<!-- calibrate-time:begin (scripts/publish.py writes this line) -->", "<!-- calibrate-time:end -->"
SERVERS = {"a": "(a) this server", "a'": "(a') this server, base cache kept by reverse maps",
           "b": "(b) prefix reuse keyed by adapter (vLLM, SGLang today)", "c": "(c) no prefix reuse"}


def figure(stem: str, key: str) -> Figure:
    return Figure(lookup(results(stem), key), f"benchmarks/results/{stem}.json", key)


def task_figures(stem: str, prefix: str, refresh: Refresh | None) -> dict[str, Figure]:
    """Normalized retention and KL of the plain switch, of the recipe and of their window controls, per task."""
    variants = {"mapped@1": "plain", "window@1": "window_control_plain"}
    if refresh is not None:
        variants[f"mapped@{refresh.probe_tokens}+r{refresh.tokens}"] = "recipe"
        variants[f"window@{2 * refresh.probe_tokens + refresh.tokens}"] = "window_control_recipe"
    figures = {}
    for task in results(stem)[prefix.split("/")[0]][prefix.split("/")[1]]:
        for variant, label in variants.items():
            for metric in ("normalized_retention", "kl"):
                figures[f"{task}.{label}.{metric}"] = figure(stem, f"{prefix}/{task}/rows/variant={variant}/{metric}")
    return figures


FINAL_CONTEXTS = (2048, 4096)  # the contexts the final texts report the sibling maps' default recipes at
PLAIN_ON_BASE_MAPS = " (base maps)"  # a plain switch the final run measured on its base maps, not the default's


def final_recipe_reports(direction: str) -> dict[int, dict]:
    """The final-text reports of the sibling recipes (`benchmarks.recipe_report`) that report a default for
    ``direction``, by context: ``{context: {"stem", "default", "rows", "default_map", "planned"}}``
    (``default_map``: the fingerprint of the maps the default ran on; ``planned``: the examples per task its run set
    out to score; each None in a report written before reports recorded it)."""
    out = {}
    for context in FINAL_CONTEXTS:
        stem = report_stem("final", context)
        if (RESULTS / f"{stem}.json").is_file():
            report = results(stem)["directions"].get(direction, {})
            if report.get("default"):
                out[context] = {"stem": stem, "default": report["default"], "rows": report["rows"],
                                "default_map": report.get("default_map"), "planned": report.get("planned")}
    return out


def final_report_problem(direction: str, report: dict) -> str | None:
    """Why a final report (`final_recipe_reports`) of ``direction`` no longer stands for the default, from the results
    files alone, or None: it reports another default than the selection texts chose, or its default ran on other maps
    than they chose it on (or on maps it did not record, where they recorded theirs), or on fewer examples than its
    window-only control or its run planned (a final run stopped halfway; a report that records no plan cannot say)."""
    choice = selection_choice(direction)
    if choice is None:
        return (f"no {report_stem('selection', SELECTION_CONTEXT)}.json says which default the selection texts chose "
                f"(`python -m benchmarks.recipes report --role selection --context {SELECTION_CONTEXT}` writes it)")
    default = report["default"]
    if choice.get("default") != default:
        return f"it reports {default!r}; the selection texts chose {choice.get('default')!r}"
    if choice.get("fingerprint") is not None and report["default_map"] != choice["fingerprint"]:
        return (f"its {default!r} ran on maps {report['default_map'] or '(not recorded)'}; the selection texts chose it "
                f"on {choice['fingerprint']}")
    if report["planned"] is None:
        return ("it records no planned examples (written before final runs recorded their plan): whether its run "
                "scored every example is unknown")
    for task, have, control, planned in final_example_counts(report):
        if have < control:
            return f"its {default!r} ran on {have} {task} examples, its window-only control on {control}"
        if have < planned:
            return f"its {default!r} ran on {have} {task} examples of the {planned} its run planned"
    return None


def reported_default(direction: str) -> str | None:
    """The default recipe the final texts report for ``direction`` (the smallest context's report), None before any
    final report."""
    reported = final_recipe_reports(direction)
    return reported[min(reported)]["default"] if reported else None


def recipe_figures(direction: str) -> dict[str, Figure]:
    """The default recipe on the final texts, per context reported: continuation (normalized retention and minus
    the window-only control at equal target compute, each with its 95% interval), recall pooled and per kind and
    depth, and the control's continuation and pooled recall."""
    figures = {}
    for context, report in final_recipe_reports(direction).items():
        stem, default, rows = report["stem"], report["default"], report["rows"]
        control = f"window@{rows[default]['compute']}"
        at = lambda *parts: figure(stem, key_of("directions", direction, "rows", *parts))  # noqa: E731
        for task, summary in rows[default].items():
            if not isinstance(summary, dict) or not summary.get("examples"):
                continue
            name = f"final_{context}.{'recall' if task == RECALL else task}"
            figures[f"{name}.default.normalized"] = at(default, task, "normalized")
            if task in ("continuation", RECALL):
                figures[f"{name}.window_control.normalized"] = at(control, task, "normalized")
            if task == "continuation":
                figures[f"{name}.default.minus_window_control"] = at(default, task, "minus_control")
                for i, end in enumerate(("low", "high")):
                    figures[f"{name}.default.normalized_{end}"] = at(default, task, "interval", str(i))
                    figures[f"{name}.default.minus_window_control_{end}"] = at(default, task, "minus_control_interval",
                                                                                str(i))
    return figures


def timed_maps(payload: dict, recipe: str | None) -> bool:
    """Whether a TTFT results file timed the maps ``recipe`` runs on (any, for no recipe: an adapter map's)."""
    return recipe is None or payload.get("maps", "published") == parse_recipe(recipe)[0]


def ttft_figures(stem: str, recipe: str | None = None) -> dict[str, Figure]:
    """A TTFT results file's speedups per context; ``recipe`` (a default recipe's name): none where the file timed
    other maps than the recipe's, and the recipe's speedup only where the row timed that recipe (a row of another,
    stale since the default changed, is left off)."""
    payload = results(stem)
    if not timed_maps(payload, recipe):
        return {}
    speedups = {f"ttft.speedup_{kind}_{row['context']}": figure(stem, f"rows/context={row['context']}/speedup_{kind}")
                for row in payload["rows"] for kind in ("cold", "warm", "recipe") if f"speedup_{kind}" in row
                and not (kind == "recipe" and recipe is not None and row.get("recipe_name") != recipe)}
    # the goals the run recorded, beside the speedups they judge: a card shows a missed goal as plainly as a met one
    goals = {f"ttft.goal_speedup_{context}": figure(stem, f"goals/{context}") for context in payload.get("goals", {})}
    return {**speedups, **goals}


def final_example_counts(report: dict) -> list[tuple[str, int, int, int]]:
    """A final report's (`final_recipe_reports`) examples per task: ``(task, the default's, its window-only control's,
    its run's planned)`` for continuation and pooled recall."""
    rows, planned = report["rows"], report.get("planned") or {}
    default, control = rows[report["default"]], rows.get(f"window@{rows[report['default']]['compute']}", {})
    return [(task, default.get(task, {}).get("examples", 0), control.get(task, {}).get("examples", 0),
             planned.get(task, 0)) for task in ("continuation", RECALL)]


def budget_figures(direction: str, context: int = 1024) -> dict[str, Figure]:
    """The refresh budget curve (selection texts): per budget K, continuation and recall retention and speedup."""
    rows = results("sibling-budget")["summary"][direction][str(context)]
    return {f"budget_curve.K{row['budget']}.{metric}": figure(
                "sibling-budget", f"summary/{direction}/{context}/budget={row['budget']}/{metric}")
            for row in rows for metric in ("continuation", "recall", "speedup") if row[metric] is not None}


def adapter_figures(adapter: str, reverse: bool = False) -> dict[str, Figure]:
    """Continuation retention of the base -> ``adapter`` map against naive reuse, and its own task after a long chat;
    ``reverse``: continuation retention of the ``adapter`` -> base map (`adapters-reverse.json`)."""
    figures = {}
    for variant, label in (("mapped@1", "mapped"), ("naive@1", "naive_reuse")):
        for metric in ("normalized_retention", "kl"):
            figures[f"continuation.{label}.{metric}"] = figure(
                results_stem(reverse), f"retention/{adapter}/rows/variant={variant}/{metric}")
    if reverse:
        return figures
    for name, label in (("session: mapped history", "session_mapped"), ("session: base history reused as is",
                                                                         "session_naive_reuse")):
        figures[f"own_task_after_chat.{label}.loss_gain_share"] = figure(
            results_stem(False), f"task_history/{adapter}/gain_retention_in_loss/{name}")
    return figures


def readme_table() -> str:
    """The README's measured-figures table, every cell read from a results file (with the command that made it)."""
    rows = []
    fmt = lambda r: f"{r['normalized_retention']:.2f} [{r['normalized_low']:.2f}, {r['normalized_high']:.2f}]"  # noqa: E731
    evaluated = results("siblings")
    reports, withheld = {}, {}  # each file read once; the reports that no longer stand, with why
    for direction in siblings.DIRECTIONS:
        name = siblings.pair_name(direction)
        reports[name] = final_recipe_reports(direction)
        withheld[name] = {c: problem for c, r in reports[name].items()
                          if (problem := final_report_problem(direction, r))}
    shown = {name: {c: r for c, r in reported.items() if c not in withheld[name]} for name, reported in reports.items()}
    for name, tasks in evaluated["results"].items():
        if reports[name]:  # the default recipe, on the final texts of the recipes benchmark (none that no longer stands)
            rows += _recipe_rows(name, shown[name])
            continue
        recipe = load_config(HUB_CARDS / name).refresh
        variant = f"mapped@{recipe.probe_tokens}+r{recipe.tokens}" if recipe else "mapped@1"
        control = f"window@{2 * recipe.probe_tokens + recipe.tokens}" if recipe else "window@1"
        ttft_rows = {r["context"]: r for r in results(f"ttft-{name}")["rows"]}
        for task, report in tasks.items():
            by = {r["variant"]: r for r in report["rows"]}
            speed = (", ".join(f"{r['speedup_cold']:.0f}x / {r['speedup_recipe']:.0f}x at {c}" if "speedup_recipe" in r
                               else f"{r['speedup_cold']:.0f}x at {c}" for c, r in ttft_rows.items())
                     if task == "continuation" else "")
            rows.append([name, f"{task} ({report['examples']})", fmt(by["mapped@1"]), fmt(by[variant]), fmt(by[control]),
                         f"{by['mapped@1']['kl']:.3f} / {by[variant]['kl']:.3f}", speed])
    naive = []  # per adapter map: (name, its retention, naive reuse's, its KL, naive reuse's)
    for adapter, reverse in ((a, r) for a in ADAPTERS for r in (False, True)):
        retention = results(results_stem(reverse))["retention"][adapter]
        by = {r["variant"]: r for r in retention["rows"]}
        naive.append((folder_name(PREFIX, adapter, reverse), by["mapped@1"]["normalized_retention"],
                      by["naive@1"]["normalized_retention"], by["mapped@1"]["kl"], by["naive@1"]["kl"]))
        speed = "-" if reverse else " / ".join(  # the reverse switch is not timed on its own
            f"{r['speedup_cold']:.0f}x at {r['context']}" for r in results(f"ttft-{folder_name(PREFIX, adapter, False)}")["rows"])
        rows.append([folder_name(PREFIX, adapter, reverse), f"continuation ({retention['examples']})",
                     fmt(by["mapped@1"]), "-", f"naive reuse {fmt(by['naive@1'])}",
                     f"{by['mapped@1']['kl']:.3f} (naive {by['naive@1']['kl']:.3f})", speed])
    recipes = any(shown.values())
    plain_on_base_maps = any(PLAIN_ON_BASE_MAPS in row[2] for row in rows)
    return table(["map", "task (examples)", "plain switch: normalized [95% CI]", "with the recipe", "control at equal "
                  "compute", "KL plain / recipe", "TTFT vs re-prefill, cold sink: plain / recipe"], rows) + (
        "\n\nFrom `benchmarks/results/siblings.json`, `adapters.json`, `adapters-reverse.json` and `ttft-*.json` (provenance "
        "inside), written by "
        "`python -m scripts.publish`" + (
            "; a sibling map's default recipe on the final texts from `sibling-recipes-final-<context>.json` "
            "(`python -m benchmarks.recipes`, the default chosen on the selection texts)." if recipes else ".") + (
            " A plain switch marked (base maps), and its KL, ran on the final run's base maps (its `--maps`), not on "
            "the maps the default recipe runs on, which that run did not switch plainly; the TTFT column times the "
            "default's own maps, plain and with the recipe." if plain_on_base_maps else "")
        + adapter_losses(naive)
        + "".join(f"\n\n{note}" for note in ttft_goal_notes(shown))
        + ("\n\nA sibling map's default recipe stays out of this table until a final report of it stands: one of the "
           "default the selection texts chose, on the maps they chose it on, measured on every example its run planned "
           "(`figures.final_report_problem`); each note below says what a report lacks." if any(withheld.values())
           else "")
        + "".join(f"\n\nNot shown: `{reports[name][context]['stem']}.json` for `{name}`: {problem}; it is measured "
                  f"again (`python -m benchmarks.recipes run --role final --context {context}`, then its report)."
                  for name, problems in withheld.items() for context, problem in problems.items()))


def adapter_losses(maps: list[tuple[str, float, float, float, float]]) -> str:
    """The sentence naming the adapter maps whose normalized retention naive reuse beat, and those whose KL it beat
    (``maps``: name, the map's retention, naive reuse's, the map's KL, naive reuse's)."""
    retention = [f"{name} ({ours:.3f} against {theirs:.3f})" for name, ours, theirs, _, _ in maps if theirs > ours]
    kl = [f"{name} ({ours:.3f} against {theirs:.3f})" for name, _, _, ours, theirs in maps if theirs < ours]
    said = [f"naive reuse kept more normalized retention than the map on {len(retention)} of {len(maps)} adapter "
            f"maps: {', '.join(retention)}" if retention else "",
            f"a lower KL than the map on {len(kl)} of {len(maps)}: {', '.join(kl)}" if kl else
            f"the map's KL is below naive reuse's on all {len(maps)}"]
    return "\n\nAdapter maps against naive reuse in this table: " + "; ".join(s for s in said if s) + "."


def ttft_goal_notes(reports: dict[str, dict]) -> list[str]:
    """One paragraph per sibling default whose TTFT speedup misses a goal (`benchmarks.recipe_budget.TTFT_GOALS`) in
    its TTFT table's run (``reports``: pair name -> its final reports, `final_recipe_reports`): the passes that make
    its time, and what its budget's TTFT sweep measured."""
    notes = []
    for direction in siblings.DIRECTIONS:
        name = siblings.pair_name(direction)
        if not reports.get(name):
            continue
        swept = results(f"ttft-{name}-sweep") if (RESULTS / f"ttft-{name}-sweep.json").is_file() else {"rows": []}
        sweep_rows = {r["context"]: r for r in swept["rows"]}
        first = reports[name][min(reports[name])]["default"]  # as `reported_default`, from the reports given
        timed = results(f"ttft-{name}")
        for row in timed["rows"]:
            default = reports[name].get(row["context"], {}).get("default", first)  # the report at the row's context
            goal = TTFT_GOALS.get(row["context"])
            if (goal is None or not timed_maps(timed, default) or row.get("recipe_name") != default
                    or row["speedup_recipe"] >= goal):
                continue
            passes = row["recipe_passes"]
            note = (f"Going {direction} (`{name}`), the default recipe `{row['recipe_name']}` runs "
                    f"{row['speedup_recipe']:.1f}x faster than the target's prefill at {row['context']} tokens in "
                    f"`ttft-{name}.json`, under the {goal}x goal (`benchmarks.recipe_budget.TTFT_GOALS`): its passes "
                    f"over the target's weights (probe / recompute / first token: {passes['probe']:.2f} / "
                    f"{passes['recompute']:.2f} / {passes['first_token']:.2f} s) make most of its "
                    f"{row['recipe']['median']:.2f} s, against a prefill of {row['full']['median']:.2f} s.")
            sweep_row = sweep_rows.get(row["context"], {})
            swept_recipe = sweep_row.get("recipes", {}).get(row["recipe_name"].rpartition(":")[2])
            if swept_recipe is not None:
                measured = (f"{swept_recipe['speedup']:.1f}x [{swept_recipe['speedup_min']:.1f}x, "
                            f"{swept_recipe['speedup_max']:.1f}x] against a prefill of "
                            f"{sweep_row['full']['median']:.2f} s")
                choice, runs = budget_over_runs(swept)
                if choice["budget"] is not None:
                    note += (f" The TTFT sweep that set its budget (`ttft-{name}-sweep.json`, on the {swept['maps']} "
                             f"maps) measured {measured}.")
                else:  # `recipe_budget.direction_budget`: the runs then keep the published recipe's budget
                    note += (f" Its TTFT sweep (`ttft-{name}-sweep.json`, on the {swept['maps']} maps) found no budget "
                             f"that meets every goal in each of its {len(runs)} run(s), so the recipes kept the "
                             f"published recipe's budget; its latest run measured this recipe at {measured}.")
            notes.append(note)
    return notes


def _recipe_rows(name: str, reported: dict[int, dict]) -> list[list[str]]:
    """README rows of a sibling map's default recipe per final context: continuation and pooled recall, the plain
    switch, the recipe (and minus the window-only control, paired), the control, and TTFT at that context."""
    fmt = lambda r: f"{r['normalized']:.2f} [{r['interval'][0]:.2f}, {r['interval'][1]:.2f}]"  # noqa: E731
    timed = results(f"ttft-{name}")
    out = []
    for context, report in reported.items():
        rows, default = report["rows"], report["default"]
        ttft = {r["context"]: r for r in timed["rows"]} if timed_maps(timed, default) else {}  # not other maps' times
        control = f"window@{rows[default]['compute']}"
        label = default.rpartition(":")[0]  # the maps the default runs on: a lever's, or the run's own
        own_plain = f"{label}:plain" if label else "plain"
        for task in ("continuation", RECALL):
            plain, recipe, window = (rows[v][task] for v in (own_plain if own_plain in rows else "plain", default,
                                                               control))
            marked = "" if own_plain in rows else PLAIN_ON_BASE_MAPS
            versus = (f"; {recipe['minus_control']:+.3f} [{recipe['minus_control_interval'][0]:+.3f}, "
                      f"{recipe['minus_control_interval'][1]:+.3f}] vs the control")
            speed = ttft.get(context, {})
            timed_recipe = speed.get("recipe_name") == default  # a TTFT row of another recipe is not this one's
            out.append([name, f"{task} at {context} ({recipe['examples']})", fmt(plain) + marked,
                        f"`{default}` {fmt(recipe)}{versus}", fmt(window), f"{plain['kl']:.3f} / {recipe['kl']:.3f}",
                        f"{speed['speedup_cold']:.0f}x" + (f" / {speed['speedup_recipe']:.0f}x" if timed_recipe else "")
                        if task == "continuation" and speed else ""])
    return out


def written_by(stem: str, module: str) -> str:
    """The line under a generated table naming its results file and the benchmark that wrote it."""
    return f"\n\nFrom `benchmarks/results/{stem}.json`, written by `python -m benchmarks.{module}`."


def serve_table() -> str:
    """The chat server's load benchmark (`benchmarks/results/serve-load.json`): TTFT, throughput and quality against
    no reuse, and the ratios."""
    data = results("serve-load")
    rows = []
    for key, label in SERVERS.items():
        if key not in data["summary"]:
            continue
        s, q = data["summary"][key], data["quality"].get(key)
        rows.append([label, f"{s['ttft_p50']:.2f} s", f"{s['ttft_p95']:.2f} s",
                     f"{s['compute_ttft_p50']:.2f} / {s['compute_ttft_p95']:.2f} s", f"{s['tokens_per_second']:.1f}",
                     f"{100 * s['cached_fraction']:.0f}%",
                     "-" if q is None else f"{q['first_token_kl_mean']:.3f} / {q['first_token_top1_agreement']:.2f} / "
                                           f"{q['reply_agreement']:.2f}"])
    ratios = [[name, *(f"{r[k]:.2f}" for k in ("ttft_p50", "ttft_p95", "compute_ttft_p50", "compute_ttft_p95",
                                                "tokens_per_second"))] for name, r in data["ratios"].items()]
    setup = data["setup"]
    return (f"{setup['conversations']} concurrent conversations x {setup['turns']} turns switching adapters, "
            f"{setup['max_tokens']} new tokens at most, greedy, streamed; maps: {setup['maps'].split(';')[0]}.\n\n"
            + table(["server", "TTFT p50", "TTFT p95", "compute TTFT p50 / p95", "tokens/s", "prompt cached",
                     "vs (c): first-token KL / same first token / same reply"], rows) + "\n\n"
            + table(["ratio", "TTFT p50", "TTFT p95", "compute p50", "compute p95", "throughput"], ratios)
            + serve_losses(data["ratios"]) + written_by("serve-load", "serve_load"))


SERVE_COSTS = {"ttft_p50": "TTFT p50", "ttft_p95": "TTFT p95", "compute_ttft_p50": "compute p50",
               "compute_ttft_p95": "compute p95"}


def serve_losses(ratios: dict[str, dict]) -> str:
    """The sentence naming every ratio of the load benchmark where this server does worse than the other (a time
    above 1, a throughput below 1), or none."""
    losses = []
    for name, r in ratios.items():
        worse = [f"{label} x{r[key]:.2f}" for key, label in SERVE_COSTS.items() if r[key] > 1]
        worse += [f"throughput x{r['tokens_per_second']:.2f}"] if r["tokens_per_second"] < 1 else []
        if worse:
            losses.append(f"{name}: {', '.join(worse)}")
    return ("\n\nWhere this server did worse in this run: " + "; ".join(losses) + ".") if losses else ""


def vllm_table() -> str:
    """The vLLM connector's load benchmark (`benchmarks/results/vllm-load.json`), its tables at the README's level,
    and where it stands against its targets."""
    data = results("vllm-load")
    return vllm_markdown(data, level=3) + load_targets(data) + written_by("vllm-load", "vllm_load")


def switch_cost_table() -> str:
    """What a switch costs the streams around it inside vLLM (`benchmarks/results/vllm-switch-cost.json`; with the
    same run at a smaller engine step where `vllm-switch-cost-step128.json` holds one)."""
    data = results("vllm-switch-cost")
    small_step = results(SMALL_STEP) if (RESULTS / f"{SMALL_STEP}.json").is_file() else None
    return (switch_cost_markdown(data, level=3) + switch_cost_targets(data, small_step)
            + written_by("vllm-switch-cost", "vllm_switch_cost")
            + (f" The smaller step's run: `benchmarks/results/{SMALL_STEP}.json`." if small_step else ""))


SMALL_STEP = "vllm-switch-cost-step128"


def tp_shards_table() -> str:
    """Gather against per-shard maps under tensor parallelism (`benchmarks/results/tp-shards.json`)."""
    text = tp_markdown(results("tp-shards")).split("\n", 2)[2]  # without its title
    return text + written_by("tp-shards", "tp_shards")


def calibrate_time_line() -> str:
    """How long the README's calibrate-adapters command took (`benchmarks/results/calibrate-time.json`)."""
    data = results("calibrate-time")
    minutes, seconds = divmod(round(data["seconds"]), 60)
    maps = data["maps"]

    def tokens(key: str) -> str:
        low, high = min(m[key] for m in maps), max(m[key] for m in maps)
        return f"{low:,}" if low == high else f"{low:,}-{high:,}"

    return (f"The `calibrate-adapters` command above took {minutes} min {seconds} s on {data['threads']} threads "
            f"({data['provenance']['cpu']}) for its {len(maps)} maps (both directions of each adapter, one pass of the "
            f"models), fitted on {tokens('train_tokens')} tokens each and checked on {tokens('heldout_tokens')} "
            "held-out tokens (`benchmarks/results/calibrate-time.json`, written by `python -m benchmarks.calibrate_time`).")


# The README's generated blocks: (begin marker, end marker, what renders the table between them).
README_BLOCKS = ((README_BEGIN, README_END, readme_table), (SERVE_BEGIN, SERVE_END, serve_table),
                 (VLLM_BEGIN, VLLM_END, vllm_table), (SWITCH_BEGIN, SWITCH_END, switch_cost_table),
                 (TP_BEGIN, TP_END, tp_shards_table),
                 (CALIBRATE_BEGIN, CALIBRATE_END, calibrate_time_line))
