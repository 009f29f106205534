"""The quality gate (`peft_kvcache.calibration.gate.measure_quality`: predicted retention from attention-output
cosines) of the maps `scripts/publish.py` ships, on calibration-split stdlib files that come after those of any
fit and are never scored for retention; the published maps carry their gate.

- siblings: the maps of every scale of the data-scaling curve (`benchmarks.scaling`), both directions, and the maps
  of a calibration lever (`benchmarks.lever_maps`) where they earned a direction's default (`scripts/publish.py`'s
  ``lever_gate`` stage; sibling-lever-gates.json/.md);
- adapters: the base <-> adapter maps of SmolLM2-135M-Instruct, both directions.

    python -m benchmarks.gates siblings --maps runs/publish/siblings --scales 8 16 32 64 128
    python -m benchmarks.gates adapters --maps runs/publish/adapters

Writes benchmarks/results/sibling-gates.json/.md or adapter-gates.json/.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from peft_kvcache import AdapterMaps, KVMap
from peft_kvcache.calibration.gate import measure_quality
from peft_kvcache.lab.corpus import corpus_description, stdlib_texts, token_ids
from peft_kvcache import load_model
from peft_kvcache.maps.adapter_maps import folder_name
from peft_kvcache.maps.config import DataRecord, TextRecord
from peft_kvcache.maps.records import to_json

from . import adapters, scaling, siblings
from .common import ADAPTERS, SMOLLM, map_fingerprint, save, start_run, table

FILES, TOKENS = 8, 512 + 16  # the gate's texts: calibration-split files, the first TOKENS tokens of each
SIBLING_SKIP = max(scaling.SCALES)  # no sibling fit reads beyond the first max(SCALES) calibration files
ADAPTER_SKIP = adapters.CALIBRATION_FILES + adapters.BLEND_FILES  # the adapter maps' fit and blend files
ADAPTER_DESCRIPTION = "calibration-split files after the fit's and the blend's"


def gate_texts(tokenizer, skip: int, files: int = FILES, tokens: int = TOKENS) -> tuple[dict[str, str], list[torch.Tensor]]:
    """Calibration-split files ``skip .. skip + files - 1`` and their first ``tokens`` token ids."""
    texts = stdlib_texts("calibration", files, skip)
    return texts, [token_ids(tokenizer, text, tokens) for text in texts.values()]


def run_siblings(models: dict, tokenizer, maps: dict[str, dict[int, KVMap]], skip: int = SIBLING_SKIP,
                 progress: bool = True) -> dict:
    """The gate of ``maps[direction][scale]``; writes ``sibling-gates``. Returns ``{"gates": {direction: {scale:
    record}}}``."""
    texts, gates = _sibling_gates(models, tokenizer, maps, skip, progress)
    results = {"gates": gates}
    save("sibling-gates", results, markdown_siblings(results), data={"gate": list(texts)})
    return results


def run_lever_defaults(models: dict, tokenizer, maps: dict[str, tuple[str, Path]], skip: int = SIBLING_SKIP,
                       progress: bool = True) -> dict:
    """The gate of each direction's default maps where a calibration lever's maps earned the default (``maps[direction]
    = (label, folder)``; the capture's maps carry `run_siblings`'s); writes ``sibling-lever-gates``, which records
    each map's fingerprint so that a card never carries the gate of other maps. Returns ``{"gates": {direction:
    {label: record}}, "fingerprints": {direction: {label: fingerprint}}}``."""
    loaded = {d: {label: KVMap.from_pretrained(folder)} for d, (label, folder) in maps.items()}
    texts, gates = _sibling_gates(models, tokenizer, loaded, skip, progress)
    results = {"gates": gates, "fingerprints": {d: {label: map_fingerprint(folder)} for d, (label, folder) in
                                                maps.items()}}
    rows = [[siblings.pair_name(d), label, f"{g['predicted_retention']:.3f}"]
            for d, by_label in gates.items() for label, g in by_label.items()]
    save("sibling-lever-gates", results, "# Quality gate of the sibling maps a calibration lever published\n\n" +
         (table(["map", "lever", "predicted retention"], rows) if rows else "No lever's maps earned a default."),
         data={"gate": list(texts)})
    return results


def _sibling_gates(models: dict, tokenizer, maps: dict[str, dict], skip: int,
                   progress: bool) -> tuple[dict[str, str], dict[str, dict[str, dict]]]:
    """The gate texts and ``{direction: {key: record}}`` of ``maps[direction][key]``."""
    texts, sequences = gate_texts(tokenizer, skip)
    data = gate_data(texts, skip)
    gates = {}
    for direction, by_key in maps.items():
        source, target = (models[n] for n in siblings.DIRECTIONS[direction])
        for key, kv_map in by_key.items():
            disjoint(texts, kv_map, f"{direction} {key}")
            record = measure_quality(kv_map, source, target, sequences, data=data, progress=progress)
            gates.setdefault(direction, {})[str(key)] = to_json(record)
    return texts, gates


def gate_data(texts: dict[str, str], skip: int) -> DataRecord:
    """What the gate measured on: ``texts`` (distinct files of the calibration split, from the ``skip``-th on)."""
    return DataRecord(corpus_description("calibration", len(texts)) + f"; files {skip}..{skip + len(texts) - 1}",
                      [TextRecord(name, TOKENS, "gate") for name in texts])


def disjoint(texts, kv_map: KVMap, label: str) -> None:
    """Refuse gate ``texts`` (file names) that a map was fitted on: its predicted retention would be measured on its
    own calibration text."""
    fitted = {text.name for text in kv_map.config.calibration.data.texts}
    overlap = sorted(fitted.intersection(texts))
    if overlap:
        raise SystemExit(f"the gate texts include {len(overlap)} file(s) map {label} was fitted on (e.g. "
                         f"{overlap[0]}): pass a skip past the files its calibration read")


def run_adapters(model, base, tokenizer, maps: AdapterMaps, skip: int = ADAPTER_SKIP,
                 description: str = ADAPTER_DESCRIPTION, progress: bool = True) -> dict:
    """The gate of every map of ``maps`` between ``base`` (a plain copy of the base model) and the adapters of
    ``model``; writes ``adapter-gates``. Returns ``{"gates": {map folder name: record}}``."""
    texts, sequences = gate_texts(tokenizer, skip)
    data = DataRecord(description, [TextRecord(name, TOKENS, "gate") for name in texts])
    gates = {}
    for adapter, reverse, kv_map in maps.all():
        disjoint(texts, kv_map, folder_name(adapters.PREFIX, adapter, reverse))
        model.set_adapter(adapter)  # the adapter's side is the PeftModel, the base's side a plain copy
        source, target = (model, base) if reverse else (base, model)
        gates[folder_name(adapters.PREFIX, adapter, reverse)] = to_json(measure_quality(
            kv_map, source, target, sequences, data=data, progress=progress))
    results = {"gates": gates}
    save("adapter-gates", results, markdown_adapters(results), data={"gate": list(texts)})
    return results


def markdown_siblings(results: dict) -> str:
    gates = results["gates"]
    scales = list(next(iter(gates.values())))
    return "# Quality gate of the sibling maps\n\n" + table(
        ["map", *[f"{s} files" for s in scales]],
        [[siblings.pair_name(d), *[f"{g[s]['predicted_retention']:.3f}" for s in scales]] for d, g in gates.items()])


def markdown_adapters(results: dict) -> str:
    return "# Quality gate of the adapter maps\n\n" + table(
        ["map", "predicted retention"], [[n, f"{g['predicted_retention']:.3f}"] for n, g in results["gates"].items()])


def main() -> None:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=["siblings", "adapters"])
    parser.add_argument("--maps", type=Path, required=True, help="siblings: the folder of files-<N>/<pair map> "
                        "folders; adapters: the folder of the adapter map folders")
    parser.add_argument("--scales", type=int, nargs="+", default=list(scaling.SCALES), help="siblings only")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.family == "siblings":
        maps = {d: {s: KVMap.from_pretrained(scaling.scale_folder(args.maps, s, d)) for s in args.scales}
                for d in siblings.DIRECTIONS}
        models, tokenizer = siblings.load_pair()
        run_siblings(models, tokenizer, maps)
    else:
        model, tokenizer = adapters.load_smollm2()
        base, _ = load_model(SMOLLM)
        run_adapters(model, base, tokenizer, AdapterMaps.from_pretrained(args.maps, model, ADAPTERS))


if __name__ == "__main__":
    main()
