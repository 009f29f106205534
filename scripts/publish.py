"""Regenerate the published maps and their figures: calibrate, measure the quality gate, evaluate, time, and write
``hub_cards/*`` and the results files of its stages. This is the only code that writes hub_cards/. Two inputs come
from benchmarks it does not run: a sibling default on a lever's maps takes them from ``runs/levers/<label>``
(`benchmarks.lever_maps`), and the recipe columns of the README from the final texts' records
(`benchmarks.recipes`); the serving and vLLM benchmarks write their own tables' results files.

    python -m scripts.publish                      # everything (several hours on 2 CPU cores)
    python -m scripts.publish --only siblings      # one family: siblings (Qwen2.5-Coder 0.5B <-> 1.5B) or adapters
    python -m scripts.publish --only siblings --stages capture scaling   # some stages

Long stages resume: calibration checkpoints its statistics and every stage keeps what it produced under
``--workdir`` (runs/publish), so a run started again continues where it stopped. Figures are copied into the
cards and the README only from the results files the stages wrote (with their provenance).

This script only orchestrates: the measurements are the benchmarks' (`benchmarks.scaling`, `gates`, `budget`,
`levers`, `siblings`, `ttft`, `nonlinear`, `adapters`, `storage`, `gate_correlation`, `serve_load`, and the
`recipes` reports it reads). Every stage declares what it needs (`Stage`: the fixture models it loads, the results
files and workdir artifacts it reads); before anything runs, what the chosen stages need and neither exists nor is
made by an earlier chosen stage is listed with the stage that makes it, and the run stops there (exit status 2).
"""

from __future__ import annotations

import argparse
import itertools
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from benchmarks import (
    adapters,
    budget,
    gate_correlation,
    gates,
    lever_maps,
    levers,
    nonlinear,
    recipes,
    scaling,
    serve_load,
    siblings,
    storage,
    ttft,
)
from benchmarks.adapters import BLEND_FILES, PREFIX
from benchmarks.adapters import CALIBRATION_FILES as ADAPTER_FILES
from benchmarks.common import (ADAPTERS, LARGE, RESULTS, ROOT, SMALL, SMOLLM, map_fingerprint, map_fingerprints,
                               read_results, save, start_run)
from benchmarks.recipe_budget import TTFT_GOALS
from benchmarks.recipe_report import held_folder
from benchmarks.scaling import SCALES
from benchmarks.tasks import continuation_examples
from peft_kvcache import AdapterMaps, KVMap
from peft_kvcache._files import atomic_write
from peft_kvcache.calibration.blend import choose_adapter_blends
from peft_kvcache.calibration.rank import DEFAULT_RANK_GRID, choose_adapter_ranks
from peft_kvcache.calibration.loop import calibrate_adapters
from peft_kvcache.calibration.sinks import conversation_starts, ship_target_sinks
from peft_kvcache.errors import RecordError
from peft_kvcache.lab.corpus import stdlib_texts, token_ids
from peft_kvcache.modeling.fixtures import fixture_available, load_model
from peft_kvcache.maps.adapter_maps import folder_name
from peft_kvcache.maps.config import GateRecord, QualityRecord, Refresh
from peft_kvcache.maps.records import from_json
from peft_kvcache.maps.storage import WEIGHTS_NAME, load_config
from peft_kvcache.modeling.adapters import adapter_active
from peft_kvcache.modeling.capture import run_with_cache
from scripts import figures

logger = logging.getLogger("publish")
HUB_CARDS = figures.HUB_CARDS
# Sizes of the evaluation stages are what one publish run fits in about an hour and a half on 2 CPU cores (a
# 1.5B forward over 1k tokens takes ~20 s); every table states its example counts. The goal sizes (32
# continuation files, 24 recall cases per depth, budgets up to 256, 2048-token contexts, 8k TTFT) are the next run.
# the budget curve: context -> (budgets K, continuation files, recall cases per kind and depth); it chooses the recipe
BUDGET_PLAN = {1024: ([0, 16, 32, 64, 128], 6, 1)}
# source-layer levers (all 24/28 source layers: a 3k-7k-feature ridge per target layer, too slow for this run)
LEVER_TOP_K, LEVER_FILES, LEVER_RECALL = {"top1": 1, "top4": 4}, 6, 1
NONLINEAR_FILES, NONLINEAR_RECALL = 24, 4  # MLP rows from the first 24 of a map's own calibration files
FINAL_CONTEXT, FINAL_FILES, FINAL_RECALL = 1024, 12, 2  # the goal table (recall cases per kind and depth)
TTFT_LENGTHS, TTFT_REPEATS = (2048, 4096, 8192), 5  # the sibling defaults: TTFT >= 10x at 2k and >= 30x at 8k
ADAPTER_CONTEXT, ADAPTER_CONTINUATION, ADAPTER_EXAMPLES = 512, 64, 48  # the adapter maps' retention (both ways)
ADAPTER_TTFT_LENGTHS = (1024, 2048, 4096)
# bytes: a map's weights file larger than this stays out of git (.gitignore names it; it belongs on the Hub)
GIT_WEIGHTS_LIMIT = 20 * 10**6


class Publisher:
    """The stages of one publish run; each keeps its output under ``workdir`` and is skipped when it is there."""

    def __init__(self, workdir: Path, scales: tuple[int, ...] = SCALES, progress: bool = True):
        self.workdir, self.scales, self.progress = workdir, scales, progress
        self._siblings = self._adapters = None

    # ----- siblings -----

    def sibling_models(self):
        if self._siblings is None:
            self._siblings = siblings.load_pair()
        return self._siblings

    def scale_folder(self, scale: int, direction: str) -> Path:
        return scaling.scale_folder(self.workdir / "siblings", scale, direction)

    def scale_maps(self) -> dict[str, dict[int, KVMap]]:
        """Every scale's map, per direction (what `capture` fitted)."""
        return {d: {s: KVMap.from_pretrained(self.scale_folder(s, d)) for s in self.scales} for d in siblings.DIRECTIONS}

    def lever_folder(self, label: str, direction: str) -> Path:
        return levers.lever_folder(self.workdir / "siblings" / "levers", label, direction)

    def artifacts(self) -> dict[str, list[Path]]:
        """The workdir artifacts (and published folders) stages make and read, by name (`Stage`)."""
        return {"sibling maps": [self.scale_folder(s, d) for s in self.scales for d in siblings.DIRECTIONS],
                "chosen sibling maps": [self.chosen_folder(d) for d in siblings.DIRECTIONS],
                "adapter maps": [self.adapter_folder() / folder_name(PREFIX, a, r) for a in ADAPTERS
                                 for r in (False, True)],
                "published sibling maps": [HUB_CARDS / siblings.pair_name(d) for d in siblings.DIRECTIONS],
                "published adapter maps": [HUB_CARDS / folder_name(PREFIX, a, r) for a in ADAPTERS for r in (False, True)]}

    def paths(self, item: str) -> list[Path]:
        """Where a stage's need (or product) ``item`` lies: an artifact's folders, or a results file."""
        return self.artifacts().get(item) or [RESULTS / f"{item}.json"]

    def capture(self) -> None:
        """One pass of both Qwen models over the first max(SCALES) calibration files; both directions fitted at
        every scale of the data-scaling curve (nested prefixes of the same files)."""
        fitted = [self.scale_folder(s, d) for s in self.scales for d in siblings.DIRECTIONS]
        _refuse_fitted_otherwise({folder: lambda c: c.calibration.options != siblings.CONFIG for folder in fitted},
                                 "with other calibration options")
        if all(f.is_dir() for f in fitted):
            logger.info("capture: every scale is fitted already")
            return
        models, tokenizer = self.sibling_models()
        texts = siblings.calibration_texts(tokenizer, max(self.scales), siblings.CONFIG)
        vocab = models["small"].get_input_embeddings().weight.shape[0]

        def on_scale(scale, run):
            for direction in siblings.DIRECTIONS:
                folder = self.scale_folder(scale, direction)
                if not folder.is_dir():
                    siblings.fit_direction(run, direction, texts, scale, siblings.CONFIG, vocab).save_pretrained(
                        folder, chart=False)
                    logger.info("fitted %s on %d files", folder.name, scale)

        siblings.capture(models, texts, list(self.scales), siblings.CONFIG, on_scale,
                         checkpoint_root=self.workdir / "siblings" / "checkpoints", progress=self.progress)


    def scaling(self) -> None:
        """The data-scaling curve (`benchmarks.scaling`); it chooses the scale of the published maps."""
        models, tokenizer = self.sibling_models()
        scaling.run(models, tokenizer, self.scale_maps(), progress=self.progress)

    # the published sibling maps: the chosen scale, its gate, its recipe

    def chosen_folder(self, direction: str) -> Path:
        """The map fitted on the scale the curve chose, or on a machine that fitted none the published one (its weights
        as stored: what users load)."""
        published = HUB_CARDS / siblings.pair_name(direction)
        measured = measured_folder(direction)
        if measured is not None:  # the final texts measured the default on the weights this folder holds
            return measured
        label = default_maps(direction)
        if label != "published":  # a lever's maps earned the default
            folder = lever_maps.LEVERS / label / siblings.pair_name(direction)
            if not folder.is_dir():
                raise RecordError(f"the final texts report the {direction} default on the {label!r} maps and "
                                  f"{folder} holds none: fit them with `python -m benchmarks.lever_maps --label "
                                  f"{label}` and the options the selection report records for them")
            return folder
        if not (RESULTS / "sibling-scaling.json").is_file():  # nothing chosen yet (a stage needing it says so)
            return published
        folder = self.scale_folder(read_results("sibling-scaling")["curve"][direction]["chosen_files"], direction)
        return folder if folder.is_dir() else published

    def chosen_map(self, direction: str, with_recipe: bool = True) -> KVMap:
        """The chosen map (`chosen_folder`) with its default recipe (`default_recipe`)."""
        folder = self.chosen_folder(direction)
        if folder.parent == HUB_CARDS:
            logger.info("no fitted sibling maps in %s: using the published %s", self.workdir, folder.name)
        kv_map = KVMap.from_pretrained(folder)
        if with_recipe:
            kv_map.config.refresh = default_recipe(direction)
        return kv_map

    def gate(self) -> None:
        """The quality gate of every scale's map (`benchmarks.gates`); the published maps carry theirs."""
        models, tokenizer = self.sibling_models()
        gates.run_siblings(models, tokenizer, self.scale_maps(), skip=max(self.scales), progress=self.progress)

    def lever_gate(self) -> None:
        """The quality gate of the maps a calibration lever publishes where its maps earned a direction's default
        (`default_maps`); the capture's maps carry the gate stage's."""
        models, tokenizer = self.sibling_models()
        levers = {d: (label, self.chosen_folder(d)) for d in siblings.DIRECTIONS
                  if (label := default_maps(d)) != "published"}
        gates.run_lever_defaults(models, tokenizer, levers, progress=self.progress)

    def sibling_gate(self, direction: str) -> GateRecord:
        """The gate a sibling card carries: of the chosen maps, measured by the gate stage (the capture's maps, at the
        chosen scale) or the lever_gate stage (a lever's maps, the same weights as the chosen folder holds)."""
        label = default_maps(direction)
        if label == "published":
            scale = str(read_results("sibling-scaling")["curve"][direction]["chosen_files"])
            return from_json(GateRecord, read_results("sibling-gates")["gates"][direction][scale], "sibling-gates.json")
        try:
            measured = read_results("sibling-lever-gates")
        except FileNotFoundError:  # the stage never ran: refused below, as any gate of other maps
            measured = {}
        fingerprint = measured.get("fingerprints", {}).get(direction, {}).get(label)
        folder = self.chosen_folder(direction)
        if fingerprint not in map_fingerprints(folder):  # the same weights under either header order count
            raise RecordError(f"sibling-lever-gates.json holds no gate of the {label!r} maps now in {folder} "
                              f"({direction}): run the lever_gate stage again")
        return from_json(GateRecord, measured["gates"][direction][label], "sibling-lever-gates.json")

    def recipe(self) -> None:
        """The refresh budget curve on the selection texts; it chooses the recipe each published map records."""
        models, tokenizer = self.sibling_models()
        maps = {d: self.chosen_map(d, with_recipe=False) for d in siblings.DIRECTIONS}
        budget.run(models, tokenizer, maps, BUDGET_PLAN, progress=self.progress)

    def levers(self) -> None:
        """Levers against the published recipe on the selection texts (`benchmarks.levers`): other source-layer
        counts fitted from the same statistics as the published maps, other ways of choosing refreshed positions."""
        _refuse_fitted_otherwise({self.lever_folder(label, d): lambda c, k=top_k: c.calibration.options != replace(
            siblings.CONFIG, top_k=min(k, c.source_layout.num_layers)) for label, top_k in LEVER_TOP_K.items()
            for d in siblings.DIRECTIONS}, "with other calibration options")
        models, tokenizer = self.sibling_models()
        scale = {d: read_results("sibling-scaling")["curve"][d]["chosen_files"] for d in siblings.DIRECTIONS}
        if not all(self.lever_folder(label, d).is_dir() for label in LEVER_TOP_K for d in siblings.DIRECTIONS):
            texts = siblings.calibration_texts(tokenizer, max(self.scales), siblings.CONFIG)
            vocab = models["small"].get_input_embeddings().weight.shape[0]

            def on_scale(files, run):
                for direction in siblings.DIRECTIONS:
                    if files != scale[direction]:
                        continue
                    for label, top_k in LEVER_TOP_K.items():
                        layers = run.sides[siblings.DIRECTIONS[direction][0]].layout.num_layers
                        config = replace(siblings.CONFIG, top_k=min(top_k, layers))
                        siblings.fit_direction(run, direction, texts, files, config, vocab).save_pretrained(
                            self.lever_folder(label, direction), chart=False)

            scales = [s for s in self.scales if s <= max(scale.values())]
            siblings.capture(models, texts, scales, siblings.CONFIG, on_scale,
                             checkpoint_root=self.workdir / "siblings" / "checkpoints", progress=self.progress)
        maps = {d: {"top2": self.chosen_map(d, with_recipe=False),
                    **{label: KVMap.from_pretrained(self.lever_folder(label, d)) for label in LEVER_TOP_K}} for d in siblings.DIRECTIONS}
        policy = {d: plain_refresh(self.chosen_map(d).config.refresh) or Refresh(64, budget.PROBE, budget.SPAN)
                  for d in siblings.DIRECTIONS}
        levers.run(models, tokenizer, maps, policy, FINAL_CONTEXT, LEVER_FILES, LEVER_RECALL, self.progress)

    def nonlinear(self) -> None:
        """Nonlinear heads against the linear sibling maps they extend, trained on the maps' own calibration texts
        and scored on selection texts (`benchmarks.nonlinear`)."""
        results = []
        models, tokenizer = self.sibling_models()
        task_sets = siblings.tasks(tokenizer, FINAL_CONTEXT, "selection", LEVER_FILES, NONLINEAR_RECALL)
        for direction in siblings.DIRECTIONS:
            source, target = (models[n] for n in siblings.DIRECTIONS[direction])
            kv_map, name = self.chosen_map(direction), siblings.pair_name(direction)
            results.append(nonlinear.skipped(name, kv_map) or nonlinear.compare(
                name, source, target, kv_map, stdlib_texts("calibration", NONLINEAR_FILES), tokenizer, task_sets,
                FINAL_CONTEXT, plain_refresh(kv_map.config.refresh), self.progress))
        save("nonlinear", {"options": nonlinear.NONLINEAR, "results": results}, nonlinear.markdown(results))

    def adapter_nonlinear(self) -> None:
        """Nonlinear heads against the linear base -> adapter maps they extend (`benchmarks.nonlinear`): MLPs
        trained on the maps' own calibration texts, both scored on held-out continuations. Its own stage: it loads
        only the small model, where the sibling stage needs both Qwen models."""
        model, tokenizer = self.adapter_model()
        base, _ = load_model(SMOLLM)
        held = stdlib_texts("calibration", 16, ADAPTER_FILES + BLEND_FILES + gates.FILES)
        examples, names = continuation_examples(tokenizer, held, 512, 64, 16)
        adapter_tasks = {"continuation": (examples, 64, names)}
        texts = {n: token_ids(tokenizer, t, 512) for n, t in stdlib_texts("calibration", NONLINEAR_FILES).items()}
        results = []
        for adapter, reverse, kv_map in self.adapter_maps().all():
            if not reverse:
                model.set_adapter(adapter)
                results.append(nonlinear.compare(folder_name(PREFIX, adapter, False), base, model, kv_map, texts,
                                                 tokenizer, adapter_tasks, 512, None, self.progress))
        save("adapter-nonlinear", {"options": nonlinear.NONLINEAR, "results": results}, nonlinear.markdown(results))

    def evaluate(self) -> None:
        """The goal table of the published maps (with their recipe) on the "final" held-out texts."""
        models, tokenizer = self.sibling_models()
        task_sets = siblings.tasks(tokenizer, FINAL_CONTEXT, "final", FINAL_FILES, FINAL_RECALL)
        results = {}
        for direction in siblings.DIRECTIONS:
            kv_map = self.chosen_map(direction)
            refresh = [r] if (r := plain_refresh(kv_map.config.refresh)) else []
            results[siblings.pair_name(direction)] = siblings.evaluate_map(models, direction, kv_map, task_sets,
                                                                          FINAL_CONTEXT, refresh, self.progress)
        save("siblings", {"context": FINAL_CONTEXT, "results": results}, siblings.markdown(results),
             data={name: names for name, (_, _, names) in task_sets.items()})

    def ttft(self) -> None:
        """TTFT of both published maps (plain, cold and warm, and with the recipe) vs the target's prefill."""
        models, _ = self.sibling_models()
        for direction in siblings.DIRECTIONS:
            source, target = (models[n] for n in siblings.DIRECTIONS[direction])
            ttft.run(siblings.pair_name(direction), lambda ids, s=source: run_with_cache(s, ids), target,
                     self.chosen_map(direction), TTFT_LENGTHS, TTFT_REPEATS, torch.device("cpu"), torch.float32,
                     maps=default_maps(direction), goals=TTFT_GOALS)

    def sibling_cards(self) -> None:
        """Write hub_cards/<pair> for both directions: the chosen map, its gate, its recipe, the storage dtype the
        storage stage chose, and figures copied from the results files that cite them."""
        for direction in siblings.DIRECTIONS:  # both checked before either card is written
            self.check_final_maps(direction)
        dtypes = read_results("storage-dtype")["choice"]
        for direction in siblings.DIRECTIONS:
            name = siblings.pair_name(direction)
            kv_map = self.chosen_map(direction)
            kv_map.config.quality = QualityRecord(gate=self.sibling_gate(direction),
                                                  figures=sibling_figures(direction, kv_map.config.refresh))
            _publish(kv_map, name, dtypes[name])

    def check_final_maps(self, direction: str) -> None:
        """Refuse (`RecordError`) a card whose default's figures on the final texts are not what it would publish: a
        report of another default than the selection texts chose, one of other weights than the folder holds
        (`chosen_folder`: a lever's maps fitted again since, say), or one whose default ran on fewer examples than its
        window-only control (a final run stopped halfway: its figures would stand beside the control's over more)."""
        folder = self.chosen_folder(direction)
        held = map_fingerprint(folder) if (folder / WEIGHTS_NAME).is_file() else None
        for context, report in figures.final_recipe_reports(direction).items():
            stem, default = report["stem"], report["default"]
            run = (f"`python -m benchmarks.recipes run --role final --context {context}` with the same maps, then its "
                   "report")
            problem = figures.final_report_problem(direction, report)
            if problem:
                raise RecordError(f"{stem}.json ({direction}): {problem}: run {run} before publishing the card")
            if held is None or report["default_map"] != held:
                raise RecordError(
                    f"{stem}.json reports the {direction} default {default!r} on maps "
                    f"{report['default_map'] or '(not recorded)'}; {folder} holds {held or 'no weights'}: measure "
                    f"them ({run}) before publishing their card")

    def storage(self) -> None:
        """Whether each published map stores its weights in bfloat16 (`benchmarks.storage`): both sibling maps and
        the base -> adapter maps."""
        models, tokenizer = self.sibling_models()
        sibling_maps = {d: self.chosen_map(d, with_recipe=False) for d in siblings.DIRECTIONS}
        model, adapter_tokenizer = self.adapter_model()
        base, _ = load_model(SMOLLM)
        storage.run(itertools.chain(storage.sibling_cases(models, tokenizer, sibling_maps),  # each case sets its
                                    storage.adapter_cases(model, base, adapter_tokenizer, self.adapter_maps())),  # adapter
                    self.progress)

    # ----- adapters -----

    def adapter_model(self):
        if self._adapters is None:
            self._adapters = adapters.load_smollm2(ADAPTERS + ("shout_alora",))
        return self._adapters

    def adapter_folder(self) -> Path:
        """Where the adapter maps the stages read lie: the ones this pipeline fitted (its workdir), or, on a machine
        that fitted none, the published ones (their weights as stored: what users load)."""
        fitted = self.workdir / "adapters"
        return fitted if fitted.is_dir() else HUB_CARDS

    def adapter_maps(self) -> AdapterMaps:
        folder = self.adapter_folder()
        if folder == HUB_CARDS:
            logger.info("no fitted adapter maps in %s: using the published ones in %s", self.workdir, HUB_CARDS)
        return AdapterMaps.from_pretrained(folder, self.adapter_model()[0], ADAPTERS)

    def calibrate_adapters(self) -> None:
        """The base <-> adapter maps: the first 512 tokens of 128 calibration-split files and 8 chat-formatted
        calibration-split docstring prompts, fitted at the full correction and at each residual rank of
        `DEFAULT_RANK_GRID`; on 12 further files, each map's rank (`choose_adapter_ranks`: the smallest the held-out KL
        cannot tell from the full correction), then its blend toward its source cache."""
        fitted = [self.workdir / "adapters" / folder_name(PREFIX, a, r) for a in ADAPTERS for r in (0, 1)]
        description = adapters.calibration_description()
        _refuse_fitted_otherwise({folder: lambda c: c.calibration.data.description != description for folder in fitted},
                                 "on other data")
        if all(f.is_dir() for f in fitted):
            return
        model, tokenizer = self.adapter_model()
        data, description = adapters.calibration_data(tokenizer)
        candidates = {rank: calibrate_adapters(model, data, adapters=list(ADAPTERS), description=description,
                                               base_spec=SMOLLM, adapter_paths={a: f"adapters/{a}" for a in ADAPTERS},
                                               residual_rank=rank, progress=self.progress,
                                               checkpoint_dir=self.workdir / "adapters-checkpoint")
                      for rank in (0, *DEFAULT_RANK_GRID)}  # one capture: every rank is fitted from its statistics
        blend_texts = stdlib_texts("calibration", BLEND_FILES, ADAPTER_FILES)
        sequences = [token_ids(tokenizer, t, 512 + 64) for t in blend_texts.values()]
        maps = choose_adapter_ranks(candidates, model, sequences, continuation=64, progress=self.progress)
        maps = choose_adapter_blends(maps, model, sequences, continuation=64, progress=self.progress)
        maps.save_pretrained(self.workdir / "adapters", PREFIX)

    def adapter_gate(self) -> None:
        """The quality gate of the four adapter maps (`benchmarks.gates`), on calibration-split files after the fit's
        and the blend's."""
        model, tokenizer = self.adapter_model()
        base, _ = load_model(SMOLLM)
        gates.run_adapters(model, base, tokenizer, self.adapter_maps(), skip=ADAPTER_FILES + BLEND_FILES,
                           progress=self.progress)

    def adapter_evaluate(self) -> None:
        model, tokenizer = self.adapter_model()
        options = argparse.Namespace(examples=ADAPTER_EXAMPLES, context=ADAPTER_CONTEXT,
                                     continuation=ADAPTER_CONTINUATION, task_examples=34, history_tokens=1024,
                                     turns=8, skip=[])
        results = adapters.run(model, tokenizer, self.adapter_maps(), options)
        save(adapters.results_stem(False), results, adapters.markdown(results), data=results.pop("data"))

    def adapter_reverse(self) -> None:
        """The adapter -> base maps on `adapter_evaluate`'s held-out texts: the base continuing from the adapter's
        mapped cache against reusing it as is."""
        model, tokenizer = self.adapter_model()
        base, _ = load_model(SMOLLM)
        examples, names = adapters.held_out_examples(tokenizer, ADAPTER_CONTEXT, ADAPTER_CONTINUATION,
                                                     ADAPTER_EXAMPLES)
        results = {"model": SMOLLM, "retention": adapters.retention(
            model, base, ADAPTERS, self.adapter_maps(), examples, ADAPTER_CONTEXT, ADAPTER_CONTINUATION, reverse=True)}
        save(adapters.results_stem(True), results, adapters.markdown(results, reverse=True), data={"continuation": names})

    def adapter_ttft(self) -> None:
        model, tokenizer = self.adapter_model()
        maps = self.adapter_maps()
        for adapter in ADAPTERS:
            def base_cache(ids):
                with adapter_active(model, None):
                    return run_with_cache(model, ids)
            with adapter_active(model, adapter):
                ttft.run(folder_name(PREFIX, adapter, False), base_cache, model, maps.to_adapter[adapter],
                         ADAPTER_TTFT_LENGTHS, TTFT_REPEATS, torch.device("cpu"), torch.float32,
                         vocab_high=tokenizer.vocab_size)

    def adapter_cards(self) -> None:
        dtypes = read_results("storage-dtype")["choice"]
        records = read_results("adapter-gates")["gates"]
        for adapter, reverse, kv_map in self.adapter_maps().all():
            name = folder_name(PREFIX, adapter, reverse)
            measured = (figures.adapter_figures(adapter, reverse=True) if reverse else
                        {**figures.adapter_figures(adapter), **figures.ttft_figures(f"ttft-{name}")})
            kv_map.config.quality = QualityRecord(gate=from_json(GateRecord, records[name], "adapter-gates.json"),
                                                  figures=measured)
            _publish(kv_map, name, dtypes.get(folder_name(PREFIX, adapter, False), "float32"))


    def adapter_sinks(self) -> None:
        """Ship each published adapter map's target sink for the conversation starts of SmolLM2's chat template and
        BOS (`peft_kvcache.calibration.sinks`): a serving engine maps a switch from its first request on. Weights and
        figures are unchanged."""
        model, tokenizer = self.adapter_model()
        for adapter in ADAPTERS:
            for reverse in (False, True):
                name = folder_name(PREFIX, adapter, reverse)
                kv_map = KVMap.from_pretrained(HUB_CARDS / name)
                with adapter_active(model, None if reverse else adapter):
                    shipped = ship_target_sinks(kv_map, model, conversation_starts(tokenizer, kv_map.config.sink_tokens))
                shipped.save_pretrained(HUB_CARDS / name, repo_id=f"hub_cards/{name}", overwrite=True)
                logger.info("shipped %d target sink(s) in %s", len(shipped.config.sinks), name)

    def render_cards(self) -> None:
        """Render every published card again from its own config.json (after a change of the card's template or of
        the code paths its snippet names): config and weights are written back as they are."""
        for folder in sorted(p for p in HUB_CARDS.iterdir() if (p / "config.json").is_file()):
            kv_map = KVMap.from_pretrained(folder)
            kv_map.save_pretrained(folder, repo_id=f"hub_cards/{folder.name}", overwrite=True)
            logger.info("rendered the card of %s", folder.name)

    # ----- summary -----

    def gate_correlation(self) -> None:
        """How well the gate predicts measured retention over every current map (`benchmarks.gate_correlation`)."""
        gate_correlation.from_results_files()

    def serve_load(self) -> None:
        """The chat server's load benchmark on the published adapter maps (`benchmarks.serve_load`)."""
        serve_load.main(["--threads", str(torch.get_num_threads())])

    def readme(self) -> None:
        """Regenerate the README's tables of measured figures from the results files."""
        path = ROOT / "README.md"
        text = path.read_text()
        for begin, end, render in figures.README_BLOCKS:
            start, stop = text.index(begin) + len(begin), text.index(end)
            text = text[:start] + "\n" + render() + "\n" + text[stop:]
        atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def default_maps(direction: str) -> str:
    """The maps the final texts report the default on: ``published`` (the capture's fit) or a calibration lever's
    label (`benchmarks.lever_maps`), as the selection texts chose them."""
    default = figures.reported_default(direction)
    return recipes.parse_recipe(default)[0] if default else "published"


def measured_folder(direction: str) -> Path | None:
    """The folder a final run read the reported default's maps from (its run's record), where it still holds the very
    weights the final report measured (``default_map``): what a card publishes, whichever maps the default runs on
    (a default on the base maps ran on the capture's folder the run was given, not on `hub_cards`). None where no
    final report recorded one, or no folder holds those weights any more."""
    label = default_maps(direction)
    for report in figures.final_recipe_reports(direction).values():
        for run in reversed(read_results(report["stem"]).get("runs", [])):
            facts = run.get("map_sets", {}).get(label, {}).get(direction) or {}
            folder = held_folder(facts) if facts.get("fingerprint") == report["default_map"] else None
            if folder is not None:
                return folder
    return None


def default_recipe(direction: str) -> Refresh | None:
    """A sibling map's default recipe: the one the final texts report (chosen on the selection texts,
    `benchmarks.recipes`, on the maps `default_maps` names) once a final report exists, else the budget curve's
    (`benchmarks.budget`)."""
    default = figures.reported_default(direction)
    if default:
        return recipes.parse_recipe(default)[1]
    if not (RESULTS / "sibling-budget.json").is_file():
        return None
    k = read_results("sibling-budget")["recommended"][direction]
    return Refresh(k, budget.PROBE, budget.SPAN) if k else None


def plain_refresh(recipe: Refresh | None) -> Refresh | None:
    """``recipe`` if it is a plain refresh (the mapped middle kept, no recent window beyond the probe): what the
    retention stages (evaluate, levers, nonlinear) measure; the recipes benchmark reports the others."""
    return recipe if recipe is not None and recipe.mapped_middle and not recipe.recent_tokens else None


def sibling_figures(direction: str, recipe: Refresh | None) -> dict:
    """A sibling card's figures: the plain switch (and the recipe the evaluate stage measured, until the final
    texts report the default recipe), TTFT and the budget curve. The plain switch and the budget curve ran on the
    capture's maps: a card whose weights are a lever's (`default_maps`) carries only what ran on those."""
    reported = figures.recipe_figures(direction)
    own = default_maps(direction) == "published"
    plain = figures.task_figures("siblings", f"results/{siblings.pair_name(direction)}", None if reported else recipe)
    default = figures.reported_default(direction)
    return {**(plain if own else {}), **reported,
            **figures.ttft_figures(f"ttft-{siblings.pair_name(direction)}", recipe=default),
            **(figures.budget_figures(direction) if own else {})}


def _publish(kv_map: KVMap, name: str, dtype: str) -> None:
    """Save a map into hub_cards/ (weights in ``dtype``); its card loads it from there."""
    kv_map.with_weights_dtype(getattr(torch, dtype)).save_pretrained(HUB_CARDS / name, repo_id=f"hub_cards/{name}",
                                                                     overwrite=True)
    logger.info("published %s (%s)", name, dtype)
    size = (HUB_CARDS / name / WEIGHTS_NAME).stat().st_size
    if size > GIT_WEIGHTS_LIMIT:
        logger.warning("hub_cards/%s/%s is %s bytes, over the %s kept in git: .gitignore must name it (the Hub "
                       "holds it)", name, WEIGHTS_NAME, f"{size:,}", f"{GIT_WEIGHTS_LIMIT:,}")


# ----- the stages and what each needs -----

QWEN, SMOL = (SMALL, LARGE), (SMOLLM,)
SIBLING_TTFT = tuple(f"ttft-{siblings.pair_name(d)}" for d in siblings.DIRECTIONS)
ADAPTER_TTFT = tuple(f"ttft-{folder_name(PREFIX, a, False)}" for a in ADAPTERS)
ADAPTER_RETENTION = (adapters.results_stem(False), adapters.results_stem(True))


@dataclass(frozen=True)
class Stage:
    """One stage of a publish run (the `Publisher` method of that name) and what it stands on: the fixture models
    it loads, what it reads (``needs``) and what it writes (``makes``), each a results file (its stem under
    benchmarks/results/) or a workdir artifact (a name of `Publisher.artifacts`)."""

    family: str
    name: str
    models: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    makes: tuple[str, ...] = ()


CHOSEN = ("sibling-scaling", "chosen sibling maps")  # what `Publisher.chosen_map` reads
RECIPE = (*CHOSEN, "sibling-budget")  # ... with the recipe the budget stage chose
STAGES = (
    Stage("siblings", "capture", QWEN, makes=("sibling maps",)),
    Stage("siblings", "scaling", QWEN, ("sibling maps",), ("sibling-scaling",)),
    Stage("siblings", "gate", QWEN, ("sibling maps",), ("sibling-gates",)),
    Stage("siblings", "lever_gate", QWEN, CHOSEN, ("sibling-lever-gates",)),
    Stage("siblings", "recipe", QWEN, CHOSEN, ("sibling-budget",)),
    Stage("siblings", "levers", QWEN, CHOSEN, ("sibling-levers",)),
    Stage("siblings", "evaluate", QWEN, RECIPE, ("siblings",)),
    Stage("siblings", "ttft", QWEN, RECIPE, SIBLING_TTFT),
    Stage("nonlinear", "nonlinear", QWEN, RECIPE, ("nonlinear",)),
    Stage("nonlinear", "adapter_nonlinear", SMOL, ("adapter maps",), ("adapter-nonlinear",)),
    Stage("adapters", "calibrate_adapters", SMOL, makes=("adapter maps",)),
    Stage("adapters", "adapter_gate", SMOL, ("adapter maps",), ("adapter-gates",)),
    Stage("adapters", "adapter_evaluate", SMOL, ("adapter maps",), (adapters.results_stem(False),)),
    Stage("adapters", "adapter_reverse", SMOL, ("adapter maps",), (adapters.results_stem(True),)),
    Stage("adapters", "adapter_ttft", SMOL, ("adapter maps",), ADAPTER_TTFT),
    Stage("cards", "storage", QWEN + SMOL, (*CHOSEN, "adapter maps"), ("storage-dtype",)),
    Stage("cards", "sibling_cards", (), (*RECIPE, "sibling-gates", "sibling-lever-gates", "siblings", *SIBLING_TTFT,
                                         "storage-dtype"),
          ("published sibling maps",)),
    Stage("cards", "adapter_cards", (), ("adapter maps", "adapter-gates", *ADAPTER_RETENTION, *ADAPTER_TTFT,
                                         "storage-dtype"), ("published adapter maps",)),
    Stage("cards", "gate_correlation", (), ("sibling-gates", "sibling-scaling", "adapter-gates", *ADAPTER_RETENTION),
          ("gate-correlation",)),
    Stage("cards", "serve_load", SMOL, makes=("serve-load",)),  # maps: the published ones, else fitted there
    Stage("cards", "readme", (), ("siblings", *ADAPTER_RETENTION, *SIBLING_TTFT, *ADAPTER_TTFT, "serve-load",
                                  "published sibling maps")),
    Stage("cards", "adapter_sinks", SMOL, ("published adapter maps",)),
    Stage("cards", "render_cards"),
)
FAMILIES = tuple(dict.fromkeys(stage.family for stage in STAGES))
MAKERS = {item: stage.name for stage in STAGES for item in stage.makes}


def unmet_needs(stages: list[Stage], publisher: Publisher) -> list[str]:
    """One line per stage of ``stages`` (in run order) that needs what neither exists now nor is made by an
    earlier stage of ``stages``: the missing models, results files and artifacts, each with what makes it."""
    coming, lines = set(), []
    for stage in stages:
        fetch = [m for m in stage.models if not fixture_available(m)]
        missing = [f"the fixtures {', '.join(fetch)} (python -m peft_kvcache.modeling.fixtures {' '.join(fetch)})"] if fetch else []
        for item in stage.needs:
            absent = [] if item in coming else [p for p in publisher.paths(item) if not p.exists()]
            if absent:
                where = _shown(absent[0]) + (f" and {len(absent) - 1} more" if len(absent) > 1 else "")
                missing.append(f"{item} ({where}; made by the stage {MAKERS.get(item, 'capture')})")
        if missing:
            lines.append(f"{stage.name} needs " + "; ".join(missing))
        coming.update(stage.makes)
    return lines


def _refuse_fitted_otherwise(fitted_otherwise: dict, how: str) -> None:
    """A stage resumes on the folders it fitted before, so one fitted otherwise (``how``: with other options, on other
    data) would be published as what this stage fits: refused. ``fitted_otherwise``: per folder, a test of its
    config."""
    for folder, differs in fitted_otherwise.items():
        if folder.is_dir() and differs(load_config(folder)):
            raise SystemExit(f"{_shown(folder)} was fitted {how} than this stage fits: remove it (and the folders "
                             "fitted beside it) or pass another --workdir")


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main() -> None:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=FAMILIES, nargs="+", default=list(FAMILIES))
    parser.add_argument("--stages", nargs="+", default=None, choices=[stage.name for stage in STAGES], metavar="STAGE",
                        help="run only these stages (default: all): " + ", ".join(stage.name for stage in STAGES))
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "publish")
    parser.add_argument("--scales", type=int, nargs="+", default=list(SCALES),
                        help="calibration files of the data-scaling curve (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    publisher = Publisher(args.workdir, tuple(args.scales), progress=not args.no_progress)
    chosen = [stage for stage in STAGES if stage.family in args.only and (args.stages is None or stage.name in args.stages)]
    unmet = unmet_needs(chosen, publisher)
    if unmet:
        parser.exit(2, "publish: nothing ran; the stages chosen need what is not there:\n  " + "\n  ".join(unmet) + "\n")
    torch.set_num_threads(args.threads)
    for stage in chosen:
        logger.info("== %s: %s", stage.family, stage.name)
        getattr(publisher, stage.name)()


if __name__ == "__main__":
    main()
