"""Whether a published map may store its weights in bfloat16: the plain switch's KL with float32 and with bfloat16
weights on the same held-out examples, paired; bfloat16 where the 95% interval of the difference stays within
`TOLERANCE` of the float32 KL. Both variants multiply in float32 (`score`), whatever the CPU: where maps multiply in
bfloat16 (`peft_kvcache.maps.compute`) both would round their weights alike and compare a map with itself. Cases:
both sibling maps (selection texts) and the base -> adapter maps (calibration-split files after the fit's and the
blend's).

    python -m benchmarks.storage --maps hub_cards

Writes benchmarks/results/storage-dtype.json/.md (the cards' storage dtype is read from it).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from peft_kvcache import AdapterMaps, KVMap
from peft_kvcache.lab.corpus import stdlib_texts
from peft_kvcache import load_model
from peft_kvcache.maps.adapter_maps import folder_name
from peft_kvcache.maps.config import weights_dtype

from . import adapters, scaling, siblings
from .common import ADAPTERS, ROOT, SMOLLM, matmuls_in, save, start_run, table
from .tasks import continuation_examples

FILES, CONTEXT = 4, scaling.CONTEXT  # the sibling maps' examples: selection texts
# the adapter maps' examples: 8 of calibration-split files 144..159, after the fit's (0..127) and the blend's
ADAPTER_FILES, ADAPTER_SKIP, ADAPTER_EXAMPLES, ADAPTER_CONTEXT = 16, adapters.CALIBRATION_FILES + 16, 8, 512
CONTINUATION = 64
TOLERANCE = 0.01  # share of the float32 KL a bfloat16 difference may reach

Case = tuple[str, tuple]  # (map name, (source, target, map, examples, context))


def sibling_cases(models: dict, tokenizer, maps: dict[str, KVMap], files: int = FILES,
                  context: int = CONTEXT) -> Iterator[Case]:
    """Both sibling maps ``maps[direction]`` on the first ``files`` selection-role continuation texts."""
    examples = siblings.tasks(tokenizer, context, "selection", files, 0)["continuation"][0]
    for direction, kv_map in maps.items():
        source, target = (models[n] for n in siblings.DIRECTIONS[direction])
        yield siblings.pair_name(direction), (source, target, kv_map, examples, context)


def adapter_cases(model, base, tokenizer, maps: AdapterMaps, skip: int = ADAPTER_SKIP) -> Iterator[Case]:
    """The base -> adapter maps on calibration-split files ``skip ..`` (no fit's); each case sets its adapter on
    ``model`` as it is produced, so consume them one at a time."""
    texts = stdlib_texts("calibration", ADAPTER_FILES, skip)
    examples = continuation_examples(tokenizer, texts, ADAPTER_CONTEXT, CONTINUATION, ADAPTER_EXAMPLES)[0]
    for adapter, reverse, kv_map in maps.all():
        if not reverse:
            model.set_adapter(adapter)
            yield folder_name(adapters.PREFIX, adapter, False), (base, model, kv_map, examples, ADAPTER_CONTEXT)


def score(source, target, kv_map: KVMap, examples, context: int, progress: bool = True):
    """The plain switch of ``kv_map`` with its weights as stored (``float32``, where the fit is at hand) and rounded to
    bfloat16 (``bfloat16``), both multiplied in float32 so that only the stored rounding differs."""
    variants = {"float32": kv_map, "bfloat16": kv_map.with_weights_dtype(torch.bfloat16)}
    with matmuls_in("float32"):
        return siblings.score_maps(source, target, variants, examples, context, CONTINUATION, progress)


def run(cases: Iterable[Case], progress: bool = True) -> dict:
    """Score every case in float32 and bfloat16 and choose the dtype; writes ``storage-dtype``. Returns
    ``{"maps": {name: rows, difference, choice}, "choice": {name: dtype}}``."""
    choice, out = {}, {}
    for name, case in cases:
        report = score(*case, progress=progress)
        diff = report.paired_difference("bfloat16", "float32", metric="kl")
        base = next(r["kl"] for r in report.rows() if r["variant"] == "float32")
        choice[name] = "bfloat16" if max(abs(diff["low"]), abs(diff["high"])) < TOLERANCE * base else "float32"
        out[name] = {"rows": report.rows(), "kl_bfloat16_minus_float32": diff, "choice": choice[name],
                     "weights_read_as": weights_dtype(case[2].tensors)}
    results = {"maps": out, "choice": choice, "multiplied_in": "float32"}
    save("storage-dtype", results, markdown(results))
    return results


def markdown(results: dict) -> str:
    rows, vacuous = [], []
    for name, o in results["maps"].items():
        diff, read_as = o["kl_bfloat16_minus_float32"], o.get("weights_read_as", "-")  # older files lack it
        rows.append([name, read_as, f"{next(r['kl'] for r in o['rows'] if r['variant'] == 'float32'):.5f}",
                     f"{diff['difference']:+.6f} [{diff['low']:+.6f}, {diff['high']:+.6f}]", o["choice"]])
        vacuous += [name] if read_as == "bfloat16" else []
    text = "# Storing map weights in bfloat16\n\n"
    if results.get("multiplied_in"):  # older files compared in the CPU's matmul dtype
        text += f"Both variants multiply in {results['multiplied_in']}: only the stored weights' rounding differs.\n\n"
    text += table(
        ["map", "weights read as", "KL float32", "KL bfloat16 - float32 [95% CI]", "stored as"], rows)
    if vacuous:  # the "float32" variant holds the same bfloat16 values: the row cannot tell what rounding costs
        text += (f"\n\n{', '.join(vacuous)}: read from files already stored in bfloat16 (no float32 fit at hand), so "
                 "both variants hold the same values and the difference says nothing about rounding; the dtype stands "
                 "on the check of the float32 fit that was stored so.\n")
    return text


def main() -> None:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maps", type=Path, default=ROOT / "hub_cards", help="folder holding the map folders")
    parser.add_argument("--families", nargs="+", choices=["siblings", "adapters"], default=["siblings", "adapters"],
                        help="the maps compared (the results file holds only these)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = []
    if "siblings" in args.families:
        models, tokenizer = siblings.load_pair()
        maps = {d: KVMap.from_pretrained(args.maps / siblings.pair_name(d)) for d in siblings.DIRECTIONS}
        cases.append(sibling_cases(models, tokenizer, maps))
    if "adapters" in args.families:
        model, tokenizer = adapters.load_smollm2()
        base, _ = load_model(SMOLLM)
        cases.append(adapter_cases(model, base, tokenizer, AdapterMaps.from_pretrained(args.maps, model,
                                                                                       ADAPTERS)))
    run(itertools.chain(*cases))


if __name__ == "__main__":
    main()
