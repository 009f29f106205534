"""Recipes after a sibling switch, example by example, resumable: what the target computes itself beside the mapped
context (a recent window, positions its probe's attention picks, the mapped middle kept or dropped), at a budget of
context tokens, against the window-only control at equal target compute, with the oracle swaps (the target's own
keys, or values, in place of the mapped middle) as standing diagnostics.

Every (example, direction, variant) result is appended to ``benchmarks/results/sibling-recipes/<role>-<context>.jsonl``
as soon as it is computed (one JSON line: the example and a digest of its tokens, the variant, its target compute, the
map's fingerprint, dtype, commit and run), so a run stops anywhere and the next one computes only what is missing,
however many sessions it takes. ``report`` makes the tables from whatever is there: normalized retention and paired
differences with 95% intervals from a bootstrap that resamples whole files (windows of one file move together).
The models' full passes over each example, most of its time, are kept under ``runs/passes`` (`benchmarks.pass_store`),
so a lever or variant added later computes only itself; kept while the folder holds under ``--passes-limit`` and the
disk keeps ``--passes-free`` (the lever fits write their captures to the same disk).

Target compute counts the context tokens the target runs (the probe pass counted once, the sink not counted: every
variant has the target's own sink, but ``no_context``, the floor, which is the last context token alone). At a
budget B: ``window@B`` keeps the sink and the last B tokens and nothing else; ``hybrid@B`` is the mapped prefix with
the last B computed by the target; ``refresh@B/pP`` runs the last 16 tokens (the probe) on the mapped cache,
recomputes the P positions its last token attends to most (spans of 8) and the last ``B - 16 - P`` tokens (the probe
included) exactly: ``refresh@B/p(B-32)`` is the published recipe; ``index@B/pP`` is the same with the mapped middle
dropped (the map used only to choose positions).

``--maps`` names the run's base maps (the records call them ``published``: the rows without a label); each
``--lever LABEL=FOLDER`` adds a lever's maps, whose rows are named ``LABEL:recipe``. The recorded runs took as base
maps the capture's top-2 fit, kept in ``runs/levers/capture-top2`` since the levers' maps replaced it in
``hub_cards/`` (a run on other base maps would start the unlabelled rows over); git holds them at 009d39d
(``git show 009d39d:hub_cards/<pair>/model.safetensors``, the same bytes). Records are keyed by the maps' fingerprint:
a lever's maps fitted again to the same values (same data and CPU arithmetic) keep their rows (a run first gives
records of an older writer's file of the same weights the file's fingerprint: `recipe_records.rekey`); maps fitted
to other values start those rows over:

    python -m benchmarks.recipes run --maps runs/levers/capture-top2 --role selection --context 2048 \
        --lever basis512=runs/levers/basis512 --lever top4=runs/levers/top4
    python -m benchmarks.recipes report --role selection --context 2048

Examples are rebuilt from the texts at every run and checked against the records' digests: after a fix to how a
task's examples are built, ``supersede`` moves that task's records aside (to ``<role>-<context>.superseded.jsonl``,
each with the reason) and the next run measures the task again:

    python -m benchmarks.recipes supersede --role final --context 2048 --task recall-prose --reason "..."

Selection texts choose the default recipes (the full grid of variants); final texts report them
(`benchmarks.siblings.ROLES`): there a run measures the controls, the hybrid, today's refresh and the default the
selection report chose per direction (`chosen_defaults`), with the oracle swaps, and each lever's hybrid, refresh
and default (a plain switch on the base maps only); a default on a lever's maps needs that lever given:

    python -m benchmarks.recipes run --maps runs/levers/capture-top2 --role final --context 4096 \
        --lever basis512=runs/levers/basis512 --lever top4=runs/levers/top4
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from peft_kvcache import KVMap, MappedCache
from peft_kvcache._files import atomic_write
from peft_kvcache.calibration.retention import cached_logits, token_kl, window_logits
from peft_kvcache.errors import RecordError
from peft_kvcache.lab.provenance import code_state, provenance
from peft_kvcache.maps.config import CalibrationConfig, parameter_count
from peft_kvcache.maps.recipe import Refresh
from peft_kvcache.modeling.capture import CapturedKV
from peft_kvcache.modeling.identity import cached_fingerprint
from peft_kvcache.runtime.refresh import attention_scores, refresh_positions, select_spans

from . import lever_maps, siblings
from .common import RESULTS, ROOT, map_fingerprint
from .pass_store import PassStore
from .recipe_budget import direction_budget
from .recipe_examples import Example, examples
from .recipe_records import append, drop_partial_line, read_records, record_key, records_path, rekey

logger = logging.getLogger(__name__)

PASSES = ROOT / "runs" / "passes"  # the models' full passes over the examples (benchmarks.pass_store), not in git
PROBE, SPAN = 16, 8
SELECTION_CONTEXT = 2048  # the context the selection texts choose the defaults at (the final texts report 2k and 4k)


# ----- variants -----


@dataclass(frozen=True)
class Variant:
    """One way to give the target the switched context. ``kind``: ``full`` (its own prefill), ``no_context`` (the
    last context token only), ``window`` (sink + last ``budget`` tokens), ``hybrid`` (mapped prefix + last
    ``budget`` computed; ``oracle`` "keys", "values" or "keys+values": the target's own in the mapped prefix), ``refresh`` / ``index``
    (the probe picks ``picked`` positions; the middle mapped / dropped), ``plain`` (mapped, the last token
    computed). ``maps``: the map set it uses (``published`` or a lever's label)."""

    kind: str
    budget: int = 0
    picked: int = 0
    oracle: str | None = None
    maps: str = "published"

    @property
    def name(self) -> str:
        base = {"full": "full", "no_context": "no_context", "plain": "plain", "window": f"window@{self.budget}",
                "hybrid": f"hybrid@{self.budget}", "refresh": f"refresh@{self.budget}/p{self.picked}",
                "index": f"index@{self.budget}/p{self.picked}"}[self.kind]
        base += f"+true-{self.oracle}" if self.oracle else ""
        return base if self.maps == "published" or self.kind in ("full", "no_context", "window") else \
            f"{self.maps}:{base}"

    @classmethod
    def recipe(cls, name: str) -> "Variant":
        """The variant of a library recipe name (``hybrid@B``, ``refresh@B/pP``, ``index@B/pP``: `Refresh.named`),
        on a lever's maps if the name says so (``label:recipe``)."""
        label, policy = parse_recipe(name)
        kind = "hybrid" if not policy.tokens else "refresh" if policy.mapped_middle else "index"
        return cls(kind, policy.compute, policy.tokens, maps=label)

    @property
    def compute(self) -> int:
        """Context tokens the target computes (the sink aside)."""
        return {"full": 0, "no_context": 1, "plain": 1}.get(self.kind, self.budget)

    @property
    def uses_map(self) -> bool:
        return self.kind in ("hybrid", "refresh", "index", "plain")

    @property
    def recent(self) -> int:
        """The last context tokens a refresh / index variant computes exactly (its probe among them)."""
        return self.budget - PROBE - self.picked


def parse_recipe(name: str) -> tuple[str, Refresh]:
    """A default's name, ``label:recipe`` (on a lever's maps) or ``recipe`` (on the published ones): the maps' label
    and the library recipe (`Refresh.named`)."""
    label, _, recipe = name.rpartition(":")
    return label or "published", Refresh.named(recipe, PROBE, SPAN)


def variants_for(budget: int, levers: tuple[str, ...] = (), final: bool = False,
                 chosen: str | None = None) -> list[Variant]:
    """The standing variants at a direction's budget B (its published recipe's target compute): controls, the
    oracle swaps, and on selection texts the trade-off between a recent window and picked positions at B (middle
    mapped and dropped) and the curve as the budget grows (B/2, 2B); on ``final`` texts only what reports the
    default: the hybrid, today's refresh and ``chosen`` (the default the selection texts chose, if any) at B. Then
    each lever's map set on the hybrid, today's refresh and ``chosen`` at B: on final texts only the chosen default's
    maps (the selection texts compare the levers; every lever on the final texts would multiply their cost)."""
    out = [Variant("full"), Variant("no_context"), Variant("plain")]
    if final:
        levers = tuple(label for label in levers if chosen is not None and label == Variant.recipe(chosen).maps)
        out += [Variant("window", budget), Variant("hybrid", budget), Variant("refresh", budget, budget - 2 * PROBE)]
        out += [Variant.recipe(chosen)] if chosen is not None else []
    else:
        picks = sorted({0, budget // 8, budget // 4, budget // 2, budget - 2 * PROBE} - {0})
        for b in (budget, budget // 2, 2 * budget):
            out += [Variant("window", b), Variant("hybrid", b)]
            for p in (picks if b == budget else [b // 4, b - 2 * PROBE]):
                if 0 < p <= b - 2 * PROBE:  # the probe's 16 tokens are the least a recent window holds
                    out += [Variant("refresh", b, p), Variant("index", b, p)]
    out += [Variant("hybrid", budget, oracle="keys"), Variant("hybrid", budget, oracle="values")]
    for label in levers:  # the hybrid (whose oracle gaps a lever closes) and today's refresh, at the budget
        out += [Variant("hybrid", budget, maps=label), Variant("refresh", budget, budget - 2 * PROBE, maps=label)]
        if chosen is not None:
            out.append(replace(Variant.recipe(chosen), maps=label))
    return list(dict.fromkeys(out))


# ----- scoring one example -----


class ExampleRun:
    """What the variants of one example and direction share: the target's full prefill (its continuation logits and
    its own KV, for the oracle swaps), the source's cache of the context, and the mapped context per map set."""

    def __init__(self, example: Example, target, own: CapturedKV, full: torch.Tensor, source_kv: CapturedKV,
                 maps: dict[str, KVMap]):
        self.example, self.target, self.own, self.full, self.source_kv = example, target, own, full, source_kv
        self.maps, self._mapped = maps, {}
        self.context = example.ids.numel() - example.continuation
        self.labels = example.ids[self.context:]

    def mapped(self, label: str) -> MappedCache:
        """A copy of the context mapped by the ``label`` maps (the target's own sink in place), mapped once."""
        if label not in self._mapped:
            self._mapped[label] = MappedCache.from_source(self.source_kv, self.maps[label], self.target,
                                                          input_ids=self.example.ids[None, :self.context],
                                                          refresh_tokens=0, verify_models=False)
        return self._mapped[label].copy()

    def sink(self, variant: Variant) -> int:
        return self.maps[variant.maps].config.sink_tokens

    @torch.no_grad()
    def logits(self, variant: Variant) -> torch.Tensor:
        """``[M, vocab]`` continuation logits of ``variant``."""
        ids, context, target = self.example.ids, self.context, self.target
        kind, sink = variant.kind, self.sink(variant)
        if kind == "full":
            return self.full
        if kind == "no_context":
            return window_logits(target, ids, context, 1, 0)
        if kind == "window":
            return window_logits(target, ids, context, variant.budget, sink)
        if kind in ("plain", "hybrid"):
            computed = 1 if kind == "plain" else variant.budget
            cache = self.mapped(variant.maps)
            cache.truncate(context - computed)
            for field in variant.oracle.split("+") if variant.oracle else ():  # "keys", "values" or both
                for layer, states in zip(cache.layers, getattr(self.own, field)):
                    setattr(layer, field, states[:, :, :context - computed].to(layer.keys.dtype))
            return cached_logits(target, cache, ids, context, computed)
        start = context - PROBE
        cache = self.mapped(variant.maps)
        cache.truncate(start)
        positions = self.picked(variant, cache)
        if kind == "index":
            return window_logits(target, ids, context, variant.recent, sink, also=positions)
        recent = torch.arange(context - variant.recent, start)
        refresh_positions(target, cache, ids[None, :start], torch.cat([positions, recent]),
                          append_ids=ids[None, start:context])
        cache.truncate(context - 1)  # the last context token's logits predict the first label: the target redoes it
        return cached_logits(target, cache, ids, context, 1)

    def picked(self, variant: Variant, cache: MappedCache) -> torch.Tensor:
        """The ``variant.picked`` positions (spans, past the sink, before its recent window) the probe's last token
        attends to most on ``cache``, the mapped context up to the probe (left as it was)."""
        start = cache.get_seq_length()
        scores = attention_scores(self.target, cache, self.example.ids[None, start:self.context])
        return select_spans(scores[: self.context - variant.recent], variant.picked, SPAN, first=self.sink(variant))

    @torch.no_grad()
    def score(self, variant: Variant) -> dict:
        logits = self.logits(variant)
        return {"correct": int((logits.argmax(-1) == self.labels).sum()),
                "kl": float(token_kl(self.full, logits).mean()),
                "agree": int((logits.argmax(-1) == self.full.argmax(-1)).sum())}


# ----- records -----


def report_stem(role: str, context: int) -> str:
    """The results stem of a role's report at ``context`` (`benchmarks.recipe_report`)."""
    return f"sibling-recipes-{role}-{context}"


def chosen_defaults(context: int = SELECTION_CONTEXT) -> dict[str, str]:
    """The default recipe the selection texts chose per direction (``benchmarks.recipe_report``'s choice at
    ``context``); a direction where none qualified is absent. Refuses (`RecordError`) when no report exists."""
    path = RESULTS / f"{report_stem('selection', context)}.json"
    if not path.is_file():
        raise RecordError(f"no {path.name}: the final texts report the defaults the selection texts chose; run "
                          f"`python -m benchmarks.recipes report --role selection --context {context}` first")
    directions = json.loads(path.read_text())["directions"]
    return {d: row["choice"]["default"] for d, row in directions.items() if (row.get("choice") or {}).get("default")}


def selection_choice(direction: str, context: int = SELECTION_CONTEXT) -> dict | None:
    """The selection report's choice for ``direction`` at ``context`` (``default``, ``maps``, ``fingerprint``...;
    empty where it chose nothing), None where no selection report exists."""
    path = RESULTS / f"{report_stem('selection', context)}.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())["directions"].get(direction, {}).get("choice") or {}


def check_chosen_maps(direction: str, default: str, fingerprint: str | None, context: int = SELECTION_CONTEXT) -> None:
    """Refuse (`RecordError`) final texts that would report ``default`` on other maps (``fingerprint``) than the ones
    the selection texts chose it on (reports written before choices recorded their maps pass)."""
    choice = selection_choice(direction, context) or {}
    chosen = choice.get("fingerprint")
    if chosen is not None and choice.get("default") == default and fingerprint != chosen:
        raise RecordError(f"{direction}: the selection texts chose {default!r} on maps {chosen}, the final texts run "
                          f"{fingerprint}: fit the maps as they were (or choose again on the selection texts)")


def budget_sources(role: str, directions) -> dict[str, dict]:
    """Where each direction's budget comes from: on selection texts its TTFT sweep (`recipe_budget.direction_budget`),
    on final texts the selection report's (the default was chosen at that budget; its controls run at the same)."""
    if role != "final":
        return {d: {**direction_budget(d), "from": "the TTFT sweep"} for d in directions}
    chosen_defaults()  # refuses without a selection report
    report = json.loads((RESULTS / f"{report_stem('selection', SELECTION_CONTEXT)}.json").read_text())["directions"]
    return {d: {"budget": report[d]["budget"], "from": "the selection report"} for d in directions if d in report}


def supersede(role: str, context: int, task: str, reason: str) -> int:
    """Move every record of the tasks whose name starts with ``task`` from the role's records to
    ``<role>-<context>.superseded.jsonl``, each with ``superseded: reason`` (what was measured on examples built
    otherwise stays on record, apart; the next run measures the task again). Both files are replaced atomically, the
    archive first and without a line twice, so a stop between them loses nothing and a second call completes the
    first; never while a run appends to the same records (what it appends meanwhile would be lost). The role's report
    at ``context`` is removed with them (it counted them: a default chosen or a figure read from it would rest on
    examples built otherwise) until ``report`` writes it again from the records left. Returns how many records
    moved."""
    if not task or not reason:
        raise RecordError("supersede needs a task (a prefix of the tasks' names, e.g. recall-prose) and a reason")
    path = records_path(role, context)
    records = read_records(path)
    moved = [r for r in records if r["task"].startswith(task)]
    if not moved:
        return 0
    for suffix in (".json", ".md", ".png"):  # first: a stop between the writes below must not leave it behind
        (RESULTS / f"{report_stem(role, context)}{suffix}").unlink(missing_ok=True)
    archive = path.with_name(f"{role}-{context}.superseded.jsonl")
    lines = archive.read_text().splitlines(keepends=True) if archive.exists() else []
    lines += [line for line in (json.dumps({**r, "superseded": reason}) + "\n" for r in moved) if line not in lines]
    atomic_write(archive, lambda tmp: Path(tmp).write_text("".join(lines)))
    kept = "".join(json.dumps(r) + "\n" for r in records if not r["task"].startswith(task))
    atomic_write(path, lambda tmp: Path(tmp).write_text(kept))
    return len(moved)


# ----- the run -----


def check_same_setup(runs_path: Path, role: str, context: int, setup: dict, live_runs: set[str]) -> None:
    """Refuse (`RecordError`) a run whose models (their fingerprints) or probe and span differ from what an earlier run
    of the role at ``context`` recorded, where records of that run remain (``live_runs``: the run ids the records
    hold): rows without a map (the references, the controls) and recipe names would be read as the same measurement.
    Runs before these were recorded pass."""
    if not runs_path.exists():
        return
    for line in runs_path.read_text().splitlines():
        try:
            earlier = json.loads(line)
        except json.JSONDecodeError:
            continue
        if earlier.get("role") != role or earlier.get("context") != context or earlier.get("run") not in live_runs:
            continue
        for key, value in setup.items():
            if key in earlier and earlier[key] != value:
                raise RecordError(f"the {role} records at {context} were measured with {key} {earlier[key]}, this run "
                                  f"has {value}: records must not mix; move them aside first (`python -m "
                                  f"benchmarks.recipes supersede --role {role} --context {context} --task continuation`"
                                  ", then `--task recall`)")


@torch.no_grad()
def map_facts(folder: Path, kv_map: KVMap, fingerprint: str) -> dict:
    """What a run records about one map it uses: where it is, what it is (its records' ``map``), its size and cost, and
    how it was fitted where that differs from the defaults (the lever)."""
    config = kv_map.config
    options = {f.name: getattr(config.calibration.options, f.name) for f in fields(CalibrationConfig)
               if getattr(config.calibration.options, f.name) != getattr(CalibrationConfig(), f.name)}
    added = folder / "lever.json"  # a lever added to another's maps (benchmarks.lever_maps --on) says which
    fitted = lever_maps.fitted_on(folder)
    return {"folder": str(folder), "fingerprint": fingerprint, "parameters": parameter_count(config),
            **({"fitted_on": fitted} if fitted else {}),
            "multiply_adds_per_token": kv_map.multiply_adds_per_token, "options": options,
            "distilled": config.distillation is not None and config.distillation.kept,
            **({"added_to": json.loads(added.read_text())["on"]} if added.is_file() else {})}


def run(models: dict, tokenizer, map_sets: dict[str, dict[str, Path]], role: str, context: int, windows: int,
        per_file: int, recall_cases: int, directions: tuple[str, ...] = ("up", "down"), only: tuple[str, ...] = (),
        progress: bool = True, records: Path | None = None, budgets: dict[str, dict] | None = None,
        passes: PassStore | None = None) -> Path:
    """Compute every missing (example, direction, variant) of the role at ``context`` and append it.
    ``map_sets[label][direction]``: the map folder (``published`` required). ``only``: variant name substrings (any).
    ``budgets[direction]``: where the target budget its recipes are compared at comes from (`budget_sources`; its
    ``budget`` absent or None: the published map's recipe's), recorded with the run. ``passes``: where the models'
    full passes are kept between runs (`PassStore`; None: computed every time)."""
    passes = passes or PassStore(None)
    chosen = chosen_defaults() if role == "final" else {}
    if role == "final":  # the final texts report a default: a direction where none was chosen has nothing to report
        unchosen = [d for d in directions if d not in chosen]
        if unchosen:
            logger.warning("the selection texts chose no default for %s: the final texts measure %s only",
                           ", ".join(unchosen), ", ".join(chosen) or "nothing")
        directions = tuple(d for d in directions if d in chosen)
        if not directions:
            raise RecordError("the selection texts chose no default in any direction asked for: the final texts have "
                              "nothing to report (see the selection report's candidates)")
    missing = {Variant.recipe(name).maps for d, name in chosen.items() if d in directions} - set(map_sets)
    if missing:
        raise RecordError(f"the selection texts chose defaults on the {sorted(missing)} maps: pass each as "
                          "--lever LABEL=FOLDER (benchmarks.lever_maps fits them)")
    path = records or records_path(role, context)
    drop_partial_line(path)
    drop_partial_line(path.with_name("runs.jsonl"))  # this run's line must not join a torn one
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    commit = code_state()["commit"]
    rekey([folders[d] for folders in map_sets.values() for d in directions], path.parent)
    maps = {d: {label: KVMap.from_pretrained(folders[d]) for label, folders in map_sets.items()} for d in directions}
    prints = {d: {label: map_fingerprint(folders[d]) for label, folders in map_sets.items()} for d in directions}
    sources = {d: dict((budgets or {}).get(d) or {}) for d in directions}
    for d, source in sources.items():
        if source.get("budget") is None:
            missed = " (no swept budget meets the TTFT goals)" if source else ""
            source.update(budget=maps[d]["published"].config.refresh.compute, **{"from": "the published recipe" + missed})
    budgets = {d: source["budget"] for d, source in sources.items()}
    for d, name in chosen.items():
        if d in directions:
            check_chosen_maps(d, name, prints[d][Variant.recipe(name).maps])
    setup = {"models": {size: cached_fingerprint(model) for size, model in sorted(models.items())},
             "probe": PROBE, "span": SPAN}
    check_same_setup(path.with_name("runs.jsonl"), role, context, setup, {r.get("run") for r in read_records(path)})
    items = examples(tokenizer, role, context, windows, per_file, recall_cases)
    earlier = read_records(path)
    digests = {r["example"]: r["digest"] for r in earlier if "digest" in r}  # records before digests carry none
    for example in items:  # before any model runs
        if digests.get(example.id, example.digest) != example.digest:
            raise RecordError(f"{path.name} holds records of {example.id} on other tokens than this run builds (the "
                              "corpus, the tokenizer or the recall construction changed): records of other texts must "
                              "not mix; write them to a new records file")
    # what a complete run scores: a report counts a variant complete only on every planned example (a run stopped
    # halfway leaves the default and its control equally short)
    planned = dict(Counter(example.task for example in items))
    append(path.with_name("runs.jsonl"), {"run": run_id, "role": role, "context": context, "budgets": budgets,
                                          "budget_sources": sources, "planned": planned, **setup,
                                          **provenance(),
                                          "map_sets": {label: {d: map_facts(folders[d], maps[d][label], prints[d][label])
                                                               for d in directions}
                                                       for label, folders in map_sets.items()}})
    levers = tuple(label for label in map_sets if label != "published")
    plan = {}
    for d in directions:
        plan[d] = [v for v in variants_for(budgets[d], levers, role == "final", chosen.get(d))
                   if not only or any(text in v.name for text in only) or v.kind in ("full", "no_context")]
    dtype = str(next(models["large"].parameters()).dtype).removeprefix("torch.")
    done = {record_key(r["example"], r["direction"], r["variant"], r["map"], r["dtype"]) for r in earlier}

    def fingerprint(d: str, v: Variant) -> str | None:
        return prints[d][v.maps] if v.uses_map else None

    for example in tqdm(items, desc=f"{role} @{context}", disable=not progress):
        todo = {d: [v for v in plan[d] if record_key(example.id, d, v.name, fingerprint(d, v), dtype) not in done]
                for d in directions}
        if not any(todo.values()):
            continue
        # one pass of each model serves both directions: the target's prefill of one, the source's cache of the other
        computed = {size: passes.full_pass(models[size], example.ids, example.continuation)
                    for size in ("small", "large")}
        for d in directions:
            if not todo[d]:
                continue
            source, target = siblings.DIRECTIONS[d]
            full, own = computed[target]
            source_kv = computed[source][1].prefix(example.ids.numel() - example.continuation)
            state = ExampleRun(example, models[target], own, full, source_kv, maps[d])
            for v in todo[d]:
                started = time.perf_counter()
                scores = state.score(v)
                append(path, {"example": example.id, "digest": example.digest, "file": example.file,
                              "task": example.task, "direction": d,
                              "context": context, "variant": v.name, **{k: val for k, val in asdict(v).items()},
                              "compute": v.compute, "map": fingerprint(d, v), "dtype": dtype, "commit": commit,
                              "run": run_id, "tokens": example.continuation, **scores,
                              "seconds": round(time.perf_counter() - started, 3)})
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("run", help="compute what is missing and append it")
    go.add_argument("--maps", type=Path, required=True, help="folder holding the two published maps (pair_name)")
    go.add_argument("--lever", action="append", default=[], metavar="LABEL=FOLDER",
                    help="a lever's map set: FOLDER holds its two maps, named as the published ones")
    go.add_argument("--windows", type=int, default=48, help="continuation windows")
    go.add_argument("--per-file", type=int, default=2, help="continuation windows per file at most")
    go.add_argument("--recall-cases", type=int, default=8, help="recall examples per kind and depth")
    go.add_argument("--directions", nargs="+", default=["up", "down"], choices=list(siblings.DIRECTIONS))
    go.add_argument("--only", action="append", default=[],
                    help="only variants whose name holds this text; repeat for several (full and no_context always)")
    go.add_argument("--passes", type=Path, default=PASSES,
                    help="where the models' full passes are kept between runs (both models' continuation logits "
                         "and caches per example: hundreds of MB each at 2,048 tokens; benchmarks.pass_store)")
    go.add_argument("--passes-limit", type=float, default=30, metavar="GIB",
                    help="keep passes while the folder holds less than this")
    go.add_argument("--passes-free", type=float, default=16, metavar="GIB",
                    help="keep passes only while their disk keeps this much free (the lever fits write captures)")
    go.add_argument("--no-passes", action="store_true", help="compute every pass, keep none")
    go.add_argument("--threads", type=int, default=2)
    gone = sub.add_parser("supersede", help="move a task's records aside after a fix to how its examples are built")
    gone.add_argument("--task", required=True, help="a prefix of the tasks' names (recall-prose: every depth)")
    gone.add_argument("--reason", required=True, help="what changed in the examples (kept with each record moved)")
    for p in (go, sub.add_parser("report", help="tables from the records (benchmarks.recipe_report)"), gone):
        p.add_argument("--role", choices=list(siblings.ROLES), required=True)
        p.add_argument("--context", type=int, default=2048)
    args = parser.parse_args(argv)
    if args.command == "supersede":
        moved = supersede(args.role, args.context, args.task, args.reason)
        print(f"{moved} records of {args.task}* moved to {records_path(args.role, args.context).stem}.superseded.jsonl"
              + (f"; {report_stem(args.role, args.context)} removed: run `report` again" if moved else ""))
        return
    if args.command == "report":
        from .recipe_report import report

        report(args.role, args.context)
        return
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    code_state()
    map_sets = {"published": {d: args.maps / siblings.pair_name(d) for d in siblings.DIRECTIONS}}
    for spec in args.lever:
        label, _, folder = spec.partition("=")
        map_sets[label] = {d: Path(folder) / siblings.pair_name(d) for d in siblings.DIRECTIONS}
    budgets = budget_sources(args.role, args.directions)  # before any model loads: refuses without a sweep
    models, tokenizer = siblings.load_pair()
    run(models, tokenizer, map_sets, args.role, args.context, args.windows, args.per_file, args.recall_cases,
        tuple(args.directions), tuple(args.only), budgets=budgets,
        passes=PassStore(None if args.no_passes else args.passes, int(args.passes_limit * 2**30),
                         int(args.passes_free * 2**30)))


if __name__ == "__main__":
    main()
