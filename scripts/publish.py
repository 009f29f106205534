"""Regenerate every published map and figure: calibrate, measure the quality gate, evaluate, time, and write
``hub_cards/*`` and ``benchmarks/results/*``. This is the only code that writes hub_cards/.

    python -m scripts.publish                      # everything (several hours on 2 CPU cores)
    python -m scripts.publish --only siblings      # one family: siblings (Qwen2.5-Coder 0.5B <-> 1.5B) or adapters
    python -m scripts.publish --only siblings --stages capture scaling   # some stages

Long stages resume: calibration checkpoints its statistics and every stage keeps what it produced under
``--workdir`` (runs/publish), so a run started again continues where it stopped. Figures are copied into the
cards and the README only from the results files the stages wrote (with their provenance).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks import adapters, budget, levers, nonlinear, serve_load, siblings, ttft
from benchmarks.adapters import PREFIX
from benchmarks.common import ADAPTERS, RESULTS, ROOT, SMOLLM, save, table
from benchmarks.tasks import continuation_examples
from peft_kvcache import AdapterMaps, KVMap
from peft_kvcache.calibration.blend import choose_adapter_blends
from peft_kvcache.calibration.gate import measure_quality
from peft_kvcache.calibration.loop import calibrate_adapters
from peft_kvcache.lab.corpus import corpus_description, docstring_chat, functions_with_docstrings, stdlib_texts
from peft_kvcache.lab.fixtures import load_model
from peft_kvcache.lab.provenance import lookup
from peft_kvcache.maps.adapter_maps import folder_name
from peft_kvcache.maps.config import (
    CalibrationConfig,
    DataRecord,
    GateRecord,
    QualityRecord,
    Refresh,
    TextRecord,
    from_json,
    to_json,
)
from peft_kvcache.modeling.adapters import adapter_active
from peft_kvcache.modeling.capture import run_with_cache
from scripts import figures

logger = logging.getLogger("publish")
HUB_CARDS = figures.HUB_CARDS
SCALES = (8, 16, 32, 64, 128)  # calibration files of the data-scaling curve; the published maps use one of them
SIBLING_CONFIG = CalibrationConfig(top_k=2, max_length=512, chunks_per_text=1)
MIN_PUBLISHED_FILES = 64  # the published sibling maps are fitted on at least this many distinct files
SCALING_CONTEXT, SCALING_FILES = 1024, 16  # the selection texts that choose the scale
GATE_FILES, GATE_TOKENS = 8, 512 + 16  # the gate's texts: calibration-split files after those of any fit
# Sizes of the evaluation stages are what one publish run fits in about an hour and a half on 2 CPU cores (a
# 1.5B forward over 1k tokens takes ~20 s); every table states its example counts. The goal sizes (32
# continuation files, 24 recall cases per depth, budgets up to 256, 2048-token contexts, 8k TTFT) are the next run.
# the budget curve: context -> (budgets K, continuation files, recall cases per kind and depth); it chooses the recipe
BUDGET_PLAN = {1024: ([0, 16, 32, 64, 128], 6, 1)}
# source-layer levers (all 24/28 source layers: a 3k-7k-feature ridge per target layer, too slow for this run)
LEVER_TOP_K, LEVER_FILES, LEVER_RECALL = {"top1": 1, "top4": 4}, 6, 1
NONLINEAR_FILES, NONLINEAR_RECALL = 24, 4  # MLP rows from the first 24 of a map's own calibration files
FINAL_CONTEXT, FINAL_FILES, FINAL_RECALL = 1024, 12, 2  # the goal table (recall cases per kind and depth)
TTFT_LENGTHS, TTFT_REPEATS = (512, 2048), 5
STORAGE_FILES = 4  # selection texts on which float32 and bfloat16 weights are compared
ADAPTER_FILES, ADAPTER_CHATS, BLEND_FILES = 128, 8, 12  # the adapter maps' calibration and blend texts
ADAPTER_CONTEXT, ADAPTER_CONTINUATION, ADAPTER_EXAMPLES = 512, 64, 48  # the adapter maps' retention (both ways)
ADAPTER_TTFT_LENGTHS = (1024, 4096)


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
        return self.workdir / "siblings" / f"files-{scale}" / siblings.pair_name(direction)

    def capture(self) -> None:
        """One pass of both Qwen models over the first max(SCALES) calibration files; both directions fitted at
        every scale of the data-scaling curve (nested prefixes of the same files)."""
        if all(self.scale_folder(s, d).is_dir() for s in self.scales for d in siblings.DIRECTIONS):
            logger.info("capture: every scale is fitted already")
            return
        models, tokenizer = self.sibling_models()
        texts = siblings.calibration_texts(tokenizer, max(self.scales), SIBLING_CONFIG)
        vocab = models["small"].get_input_embeddings().weight.shape[0]

        def on_scale(scale, run):
            for direction in siblings.DIRECTIONS:
                folder = self.scale_folder(scale, direction)
                if not folder.is_dir():
                    siblings.fit_direction(run, direction, texts, scale, SIBLING_CONFIG, vocab).save_pretrained(
                        folder, chart=False)
                    logger.info("fitted %s on %d files", folder.name, scale)

        siblings.capture(models, texts, list(self.scales), SIBLING_CONFIG, on_scale,
                         checkpoint_root=self.workdir / "siblings" / "checkpoints", progress=self.progress)


    def scaling(self) -> None:
        """The data-scaling curve: held-out R^2 and the plain switch's retention of the maps fitted on every
        scale, scored on the "selection" texts (never the published figures' texts); the published maps take the
        scale with the lowest KL among those of at least 64 files."""
        models, tokenizer = self.sibling_models()
        sets = siblings.tasks(tokenizer, SCALING_CONTEXT, "selection", SCALING_FILES, 0)
        examples, continuation, names = sets["continuation"]
        curve, lines = {}, []
        for direction in siblings.DIRECTIONS:
            maps = {f"{s} files": KVMap.from_pretrained(self.scale_folder(s, direction)) for s in self.scales}
            source, target = (models[n] for n in siblings.DIRECTIONS[direction])
            report = siblings.score_maps(source, target, maps, examples, SCALING_CONTEXT, continuation, self.progress)
            rows = {row["variant"]: row for row in report.rows()}
            points = []
            for scale, (label, kv_map) in zip(self.scales, maps.items()):
                c = kv_map.config
                points.append({"files": scale, "train_tokens": c.calibration.train_tokens,
                               "heldout_tokens": c.calibration.heldout_tokens,
                               "key_r2": _mean(c.key_r2), "value_r2": _mean(c.value_r2), **rows[label]})
            eligible = [p for p in points if p["files"] >= MIN_PUBLISHED_FILES] or points
            chosen = min(eligible, key=lambda p: p["kl"])["files"]
            curve[direction] = {"map": siblings.pair_name(direction), "points": points, "chosen_files": chosen,
                                "full": rows["full"], "no_context": rows["no_context"]}
            lines += [f"## {siblings.pair_name(direction)}", "", table(
                ["files", "train / held-out tokens", "held-out R² keys / values", "normalized [95% CI]", "KL"],
                [[p["files"], f"{p['train_tokens']:,} / {p['heldout_tokens']:,}", f"{p['key_r2']:.3f} / {p['value_r2']:.3f}",
                  f"{p['normalized_retention']:.3f} [{p['normalized_low']:.2f}, {p['normalized_high']:.2f}]",
                  f"{p['kl']:.4f}"] for p in points]), "", f"Published: the {chosen}-file map (lowest KL among maps "
                  f"of at least {MIN_PUBLISHED_FILES} files).", ""]
        header = (f"# Sibling maps: the data-scaling curve\n\nNested calibration sets (the first N calibration-split stdlib "
                  f"files, the first {SIBLING_CONFIG.max_length} tokens of each, every {round(1 / SIBLING_CONFIG.heldout_fraction)}th "
                  f"file held out whole); the plain switch scored on {len(examples)} selection-role evaluation files, "
                  f"context {SCALING_CONTEXT}, continuation {continuation}.\n\n")
        save("sibling-scaling", {"context": SCALING_CONTEXT, "curve": curve}, header + "\n".join(lines),
             data={"selection_continuation": names})
        _plot_scaling(curve, RESULTS / "sibling-scaling.png")


    # the published sibling maps: the chosen scale, its gate, its recipe

    def chosen_map(self, direction: str, with_recipe: bool = True) -> KVMap:
        """The map fitted on the scale the curve chose, with the recommended refresh (once the budget stage ran)."""
        scaling = figures.results("sibling-scaling")["curve"][direction]
        kv_map = KVMap.from_pretrained(self.scale_folder(scaling["chosen_files"], direction))
        if with_recipe and (RESULTS / "sibling-budget.json").is_file():
            k = figures.results("sibling-budget")["recommended"][direction]
            kv_map.config.refresh = Refresh(k, budget.PROBE, budget.SPAN) if k else None
        return kv_map

    def gate(self) -> None:
        """The quality gate of every scale's map, on calibration-split files no fit saw (never scored for
        retention); the published maps carry theirs."""
        models, tokenizer = self.sibling_models()
        texts = stdlib_texts("calibration", GATE_FILES, max(SCALES))
        sequences = [tokenizer(t, add_special_tokens=False, return_tensors="pt").input_ids[0, :GATE_TOKENS]
                     for t in texts.values()]
        data = DataRecord(corpus_description("calibration") + f"; files {max(SCALES)}..{max(SCALES) + GATE_FILES - 1}",
                          [TextRecord(name, GATE_TOKENS, "gate") for name in texts])
        gates = {}
        for direction in siblings.DIRECTIONS:
            source, target = (models[n] for n in siblings.DIRECTIONS[direction])
            for scale in self.scales:
                kv_map = KVMap.from_pretrained(self.scale_folder(scale, direction))
                record = measure_quality(kv_map, source, target, sequences, data=data, progress=self.progress)
                gates.setdefault(direction, {})[str(scale)] = to_json(record)
        lines = [table(["map", *[f"{s} files" for s in self.scales]],
                       [[siblings.pair_name(d), *[f"{g[str(s)]['predicted_retention']:.3f}" for s in self.scales]]
                        for d, g in gates.items()])]
        save("sibling-gates", {"gates": gates}, "# Quality gate of the sibling maps\n\n" + "\n".join(lines),
             data={"gate": list(texts)})

    def recipe(self) -> None:
        """The refresh budget curve on the selection texts; it chooses the recipe each published map records."""
        models, tokenizer = self.sibling_models()
        maps = {d: self.chosen_map(d, with_recipe=False) for d in siblings.DIRECTIONS}
        budget.run(models, tokenizer, maps, BUDGET_PLAN, progress=self.progress)

    def levers(self) -> None:
        """Levers against the published recipe on the selection texts (`benchmarks.levers`): other source-layer
        counts fitted from the same statistics as the published maps, other ways of choosing refreshed positions."""
        models, tokenizer = self.sibling_models()
        scale = {d: figures.results("sibling-scaling")["curve"][d]["chosen_files"] for d in siblings.DIRECTIONS}
        folder = lambda label, d: self.workdir / "siblings" / "levers" / label / siblings.pair_name(d)  # noqa: E731
        if not all(folder(label, d).is_dir() for label in LEVER_TOP_K for d in siblings.DIRECTIONS):
            texts = siblings.calibration_texts(tokenizer, max(self.scales), SIBLING_CONFIG)
            vocab = models["small"].get_input_embeddings().weight.shape[0]

            def on_scale(files, run):
                for direction in siblings.DIRECTIONS:
                    if files != scale[direction]:
                        continue
                    for label, top_k in LEVER_TOP_K.items():
                        layers = run.sides[siblings.DIRECTIONS[direction][0]].layout.num_layers
                        config = replace(SIBLING_CONFIG, top_k=min(top_k, layers))
                        siblings.fit_direction(run, direction, texts, files, config, vocab).save_pretrained(
                            folder(label, direction), chart=False)

            scales = [s for s in self.scales if s <= max(scale.values())]
            siblings.capture(models, texts, scales, SIBLING_CONFIG, on_scale,
                             checkpoint_root=self.workdir / "siblings" / "checkpoints", progress=self.progress)
        maps = {d: {"top2": self.chosen_map(d, with_recipe=False),
                    **{label: KVMap.from_pretrained(folder(label, d)) for label in LEVER_TOP_K}} for d in siblings.DIRECTIONS}
        policy = {d: self.chosen_map(d).config.refresh or Refresh(64, budget.PROBE, budget.SPAN)
                  for d in siblings.DIRECTIONS}
        levers.run(models, tokenizer, maps, policy, FINAL_CONTEXT, LEVER_FILES, LEVER_RECALL, self.progress)

    def nonlinear(self) -> None:
        """Nonlinear heads against the linear maps they extend, trained on the maps' own calibration texts
        (`benchmarks.nonlinear`): both sibling maps (selection texts) and the base -> adapter maps."""
        results = []
        models, tokenizer = self.sibling_models()
        task_sets = siblings.tasks(tokenizer, FINAL_CONTEXT, "selection", LEVER_FILES, NONLINEAR_RECALL)
        for direction in siblings.DIRECTIONS:
            source, target = (models[n] for n in siblings.DIRECTIONS[direction])
            kv_map = self.chosen_map(direction)
            results.append(nonlinear.compare(siblings.pair_name(direction), source, target, kv_map,
                                             stdlib_texts("calibration", NONLINEAR_FILES), tokenizer, task_sets,
                                             FINAL_CONTEXT, kv_map.config.refresh, self.progress))
        model, tokenizer = self.adapter_model()
        base, _ = load_model(SMOLLM)
        held = stdlib_texts("calibration", 16, ADAPTER_FILES + BLEND_FILES + GATE_FILES)
        examples, names = continuation_examples(tokenizer, held, 512, 64, 16)
        adapter_tasks = {"continuation": (examples, 64, names)}
        texts = {n: tokenizer(t, add_special_tokens=False, return_tensors="pt").input_ids[0, :512]
                 for n, t in stdlib_texts("calibration", NONLINEAR_FILES).items()}
        for adapter, reverse, kv_map in self.adapter_maps().all():
            if not reverse:
                model.set_adapter(adapter)
                results.append(nonlinear.compare(folder_name(PREFIX, adapter, False), base, model, kv_map, texts,
                                                 tokenizer, adapter_tasks, 512, None, self.progress))
        save("nonlinear", {"options": nonlinear.NONLINEAR, "results": results}, nonlinear.markdown(results))

    def evaluate(self) -> None:
        """The goal table of the published maps (with their recipe) on the "final" held-out texts."""
        models, tokenizer = self.sibling_models()
        task_sets = siblings.tasks(tokenizer, FINAL_CONTEXT, "final", FINAL_FILES, FINAL_RECALL)
        results = {}
        for direction in siblings.DIRECTIONS:
            kv_map = self.chosen_map(direction)
            refresh = [kv_map.config.refresh] if kv_map.config.refresh else []
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
                     self.chosen_map(direction), TTFT_LENGTHS, TTFT_REPEATS, torch.device("cpu"), torch.float32)


    def sibling_cards(self) -> None:
        """Write hub_cards/<pair> for both directions: the chosen map, its gate, its recipe, the storage dtype the
        storage stage chose, and figures copied from the results files that cite them."""
        storage = figures.results("storage-dtype")["choice"]
        for direction in siblings.DIRECTIONS:
            name = siblings.pair_name(direction)
            kv_map = self.chosen_map(direction)
            scale = str(figures.results("sibling-scaling")["curve"][direction]["chosen_files"])
            kv_map.config.quality = QualityRecord(
                gate=from_json(GateRecord, figures.results("sibling-gates")["gates"][direction][scale], "sibling-gates.json"),
                figures={**figures.task_figures("siblings", f"results/{name}", kv_map.config.refresh),
                         **figures.ttft_figures(f"ttft-{name}"), **figures.budget_figures(direction)})
            _publish(kv_map, name, storage[name])

    def storage(self) -> None:
        """Whether the published maps may store their weights in bfloat16: the plain switch's KL with float32 and
        with bfloat16 weights on the selection texts, paired; bfloat16 where the difference is under 1%."""
        choice, out = {}, {}
        for name, (source, target, kv_map, examples, context) in self._storage_cases():
            variants = {"float32": kv_map, "bfloat16": kv_map.with_weights_dtype(torch.bfloat16)}
            report = siblings.score_maps(source, target, variants, examples, context, 64, self.progress)
            diff = report.paired_difference("bfloat16", "float32", metric="kl")
            base = next(r["kl"] for r in report.rows() if r["variant"] == "float32")
            choice[name] = "bfloat16" if max(abs(diff["low"]), abs(diff["high"])) < 0.01 * base else "float32"
            out[name] = {"rows": report.rows(), "kl_bfloat16_minus_float32": diff, "choice": choice[name]}
        lines = [table(["map", "KL float32", "KL bfloat16 - float32 [95% CI]", "stored as"],
                       [[n, f"{next(r['kl'] for r in o['rows'] if r['variant'] == 'float32'):.5f}",
                         f"{o['kl_bfloat16_minus_float32']['difference']:+.6f} [{o['kl_bfloat16_minus_float32']['low']:+.6f}, "
                         f"{o['kl_bfloat16_minus_float32']['high']:+.6f}]", o["choice"]] for n, o in out.items()])]
        save("storage-dtype", {"maps": out, "choice": choice}, "# Storing map weights in bfloat16\n\n" + "\n".join(lines))

    def _storage_cases(self):
        models, tokenizer = self.sibling_models()
        examples = siblings.tasks(tokenizer, SCALING_CONTEXT, "selection", STORAGE_FILES, 0)["continuation"][0]
        for direction in siblings.DIRECTIONS:
            source, target = (models[n] for n in siblings.DIRECTIONS[direction])
            yield siblings.pair_name(direction), (source, target, self.chosen_map(direction, False), examples,
                                                  SCALING_CONTEXT)
        model, tokenizer = self.adapter_model()
        base, _ = load_model(SMOLLM)
        examples = continuation_examples(tokenizer, stdlib_texts("calibration", 16, ADAPTER_FILES + 16), 512, 64, 8)[0]
        for adapter, reverse, kv_map in self.adapter_maps().all():
            if not reverse:
                model.set_adapter(adapter)
                yield folder_name(PREFIX, adapter, False), (base, model, kv_map, examples, 512)

    # ----- adapters -----

    def adapter_model(self):
        if self._adapters is None:
            self._adapters = adapters.load_smollm2(ADAPTERS + ("shout_alora",))
        return self._adapters

    def adapter_maps(self) -> AdapterMaps:
        return AdapterMaps.from_pretrained(self.workdir / "adapters", PREFIX, ADAPTERS)

    def calibrate_adapters(self) -> None:
        """The base <-> adapter maps: the first 512 tokens of 128 calibration-split files and 8 chat-formatted
        calibration-split docstring prompts; each map's blend toward its source cache chosen on 12 further files."""
        if all((self.workdir / "adapters" / folder_name(PREFIX, a, r)).is_dir() for a in ADAPTERS for r in (0, 1)):
            return
        model, tokenizer = self.adapter_model()
        files = stdlib_texts("calibration", ADAPTER_FILES)
        data = {name: tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0, :512]
                for name, text in files.items()}
        for i, (code, doc) in enumerate(functions_with_docstrings("calibration", 400)[-ADAPTER_CHATS:]):
            data[f"chat:docstring-prompt-{i}"] = docstring_chat(tokenizer, code, doc)[0]
        maps = calibrate_adapters(model, data, adapters=list(ADAPTERS), description=(
            f"{corpus_description('calibration', ADAPTER_FILES)}; the first 512 tokens of each; plus {ADAPTER_CHATS} "
            "chat-formatted docstring prompts of calibration-split functions"), base_spec=SMOLLM,
            adapter_paths={a: f"adapters/{a}" for a in ADAPTERS}, progress=self.progress,
            checkpoint_dir=self.workdir / "adapters-checkpoint")
        blend_texts = stdlib_texts("calibration", BLEND_FILES, ADAPTER_FILES)
        sequences = [tokenizer(t, add_special_tokens=False, return_tensors="pt").input_ids[0, :512 + 64]
                     for t in blend_texts.values()]
        maps = choose_adapter_blends(maps, model, sequences, continuation=64, progress=self.progress)
        maps.save_pretrained(self.workdir / "adapters", PREFIX)

    def adapter_gate(self) -> None:
        """The quality gate of the four adapter maps, on calibration-split files after the fit's and the blend's."""
        model, tokenizer = self.adapter_model()
        texts = stdlib_texts("calibration", GATE_FILES, ADAPTER_FILES + BLEND_FILES)
        sequences = [tokenizer(t, add_special_tokens=False, return_tensors="pt").input_ids[0, :GATE_TOKENS]
                     for t in texts.values()]
        data = DataRecord("calibration-split files after the fit's and the blend's",
                          [TextRecord(name, GATE_TOKENS, "gate") for name in texts])
        base, _ = load_model(SMOLLM)
        gates = {}
        for adapter, reverse, kv_map in self.adapter_maps().all():
            model.set_adapter(adapter)  # the adapter's side is the PeftModel, the base's side a plain copy
            source, target = (model, base) if reverse else (base, model)
            gates[folder_name(PREFIX, adapter, reverse)] = to_json(measure_quality(
                kv_map, source, target, sequences, data=data, progress=self.progress))
        save("adapter-gates", {"gates": gates}, "# Quality gate of the adapter maps\n\n" + table(
            ["map", "predicted retention"], [[n, f"{g['predicted_retention']:.3f}"] for n, g in gates.items()]),
             data={"gate": list(texts)})

    def adapter_evaluate(self) -> None:
        model, tokenizer = self.adapter_model()
        options = argparse.Namespace(examples=ADAPTER_EXAMPLES, context=ADAPTER_CONTEXT,
                                     continuation=ADAPTER_CONTINUATION, task_examples=34, history_tokens=1024,
                                     turns=8, skip=[])
        results = adapters.run(model, tokenizer, self.adapter_maps(), options)
        save(figures.adapter_results(False), results, adapters.markdown(results), data=results.pop("data"))

    def adapter_reverse(self) -> None:
        """The adapter -> base maps on `adapter_evaluate`'s held-out texts: the base continuing from the adapter's
        mapped cache against reusing it as is."""
        model, tokenizer = self.adapter_model()
        base, _ = load_model(SMOLLM)
        examples, names = adapters.held_out_examples(tokenizer, ADAPTER_CONTEXT, ADAPTER_CONTINUATION,
                                                     ADAPTER_EXAMPLES)
        results = {"model": SMOLLM, "retention": adapters.retention(
            model, base, ADAPTERS, self.adapter_maps(), examples, ADAPTER_CONTEXT, ADAPTER_CONTINUATION, reverse=True)}
        save(figures.adapter_results(True), results, adapters.markdown(results, reverse=True), data={"continuation": names})

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
        storage = figures.results("storage-dtype")["choice"]
        gates = figures.results("adapter-gates")["gates"]
        for adapter, reverse, kv_map in self.adapter_maps().all():
            name = folder_name(PREFIX, adapter, reverse)
            measured = (figures.adapter_figures(adapter, reverse=True) if reverse else
                        {**figures.adapter_figures(adapter), **figures.ttft_figures(f"ttft-{name}")})
            kv_map.config.quality = QualityRecord(gate=from_json(GateRecord, gates[name], "adapter-gates.json"),
                                                  figures=measured)
            _publish(kv_map, name, storage.get(folder_name(PREFIX, adapter, False), "float32"))


    def render_cards(self) -> None:
        """Render every published card again from its own config.json (after a change of the card's template or of
        the code paths its snippet names): config and weights are written back as they are."""
        for folder in sorted(p for p in HUB_CARDS.iterdir() if (p / "config.json").is_file()):
            kv_map = KVMap.from_pretrained(folder)
            kv_map.save_pretrained(folder, repo_id=f"hub_cards/{folder.name}", overwrite=True)
            logger.info("rendered the card of %s", folder.name)

    # ----- summary -----

    def gate_correlation(self) -> None:
        """How well the gate predicts measured retention, over every current map with both: the gate on its own
        texts, the retention on texts disjoint from them (the sibling maps of every scale on the selection texts,
        the base -> adapter maps on the final texts); Pearson r with a Fisher-z 95% interval."""
        points = []
        gates, curve = figures.results("sibling-gates")["gates"], figures.results("sibling-scaling")["curve"]
        for direction, entry in curve.items():
            for p in entry["points"]:
                points.append({"map": f"{entry['map']} ({p['files']} files)", "measured_on": "sibling-scaling.json",
                               "predicted": gates[direction][str(p["files"])]["predicted_retention"],
                               "measured": p["normalized_retention"]})
        adapter_gates = figures.results("adapter-gates")["gates"]
        for adapter, reverse in ((a, r) for a in ADAPTERS for r in (False, True)):
            stem = figures.adapter_results(reverse)
            points.append({"map": folder_name(PREFIX, adapter, reverse), "measured_on": f"{stem}.json",
                           "predicted": adapter_gates[folder_name(PREFIX, adapter, reverse)]["predicted_retention"],
                           "measured": lookup(figures.results(stem),
                                              f"retention/{adapter}/rows/variant=mapped@1/normalized_retention")})
        r, low, high = figures.pearson_interval([p["predicted"] for p in points], [p["measured"] for p in points])
        save("gate-correlation", {"pearson_r": r, "low": low, "high": high, "maps": len(points), "points": points},
             f"# The quality gate against measured retention\n\nPearson r = {r:.3f} [{low:.3f}, {high:.3f}] over "
             f"{len(points)} distinct maps (gate texts disjoint from the retention texts).\n\n" + table(
                 ["map", "predicted", "measured", "measured in"],
                 [[p["map"], f"{p['predicted']:.3f}", f"{p['measured']:.3f}", p["measured_on"]] for p in points]))

    def serve_load(self) -> None:
        """The chat server's load benchmark on the published adapter maps (`benchmarks.serve_load`)."""
        serve_load.main(["--threads", str(torch.get_num_threads())])

    def readme(self) -> None:
        """Regenerate the README's tables of measured figures from the results files."""
        path = ROOT / "README.md"
        text = path.read_text()
        for (begin, end), render in (((figures.README_BEGIN, figures.README_END), figures.readme_table),
                                     ((figures.SERVE_BEGIN, figures.SERVE_END), figures.serve_table)):
            start, stop = text.index(begin) + len(begin), text.index(end)
            text = text[:start] + "\n" + render() + "\n" + text[stop:]
        path.write_text(text)


def _publish(kv_map: KVMap, name: str, dtype: str) -> None:
    """Save a map into hub_cards/ (weights in ``dtype``); its card loads it from there."""
    kv_map.with_weights_dtype(getattr(torch, dtype)).save_pretrained(HUB_CARDS / name, repo_id=f"hub_cards/{name}",
                                                                     overwrite=True)
    logger.info("published %s (%s)", name, dtype)


def _mean(rows: list[list[float]]) -> float:
    values = [v for row in rows for v in row]
    return sum(values) / len(values)


def _plot_scaling(curve: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for direction, entry in curve.items():
        files = [p["files"] for p in entry["points"]]
        left.plot(files, [p["key_r2"] for p in entry["points"]], marker="o", label=f"{direction}: keys")
        left.plot(files, [p["value_r2"] for p in entry["points"]], marker="s", ls="--", label=f"{direction}: values")
        right.plot(files, [p["kl"] for p in entry["points"]], marker="o", label=entry["map"])
    left.set(xscale="log", xlabel="calibration files", ylabel="held-out R² (mean)", title="fit")
    right.set(xscale="log", xlabel="calibration files", ylabel="KL(full ‖ mapped)", title="plain switch, selection texts")
    left.legend(fontsize="small")
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


STAGES = {"siblings": ("capture", "scaling", "gate", "recipe", "levers", "evaluate", "ttft"),
          "nonlinear": ("nonlinear",),
          "adapters": ("calibrate_adapters", "adapter_gate", "adapter_evaluate", "adapter_reverse", "adapter_ttft"),
          "cards": ("storage", "sibling_cards", "adapter_cards", "gate_correlation", "serve_load", "readme",
                    "render_cards")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=list(STAGES), nargs="+", default=list(STAGES))
    parser.add_argument("--stages", nargs="+", default=None, help="run only these stages (default: all)")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "publish")
    parser.add_argument("--scales", type=int, nargs="+", default=list(SCALES),
                        help="calibration files of the data-scaling curve (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    publisher = Publisher(args.workdir, tuple(args.scales), progress=not args.no_progress)
    for family in args.only:
        for stage in STAGES[family]:
            if args.stages is None or stage in args.stages:
                logger.info("== %s: %s", family, stage)
                getattr(publisher, stage)()


if __name__ == "__main__":
    main()
