"""Whether a published map may store its weights in 16 bits: the plain switch's KL with float32 weights and with them
rounded to each of `CANDIDATES` on the same held-out examples, paired; the first candidate whose 95% interval of the
difference stays within `TOLERANCE` of the float32 KL, else float32. bfloat16 comes first (float32's range); float16
keeps three more bits of each weight where its range holds them all. Every variant multiplies in float32 (`score`),
whatever the CPU: where maps multiply in bfloat16 (`peft_kvcache.maps.compute`) all would round their weights alike
and compare a map with itself. Cases:
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
from peft_kvcache.maps.config import is_weight, weights_dtype

from . import adapters, scaling, siblings
from .common import ADAPTERS, ROOT, SMOLLM, matmuls_in, save, start_run, table
from .tasks import continuation_examples

FILES, CONTEXT = 4, scaling.CONTEXT  # the sibling maps' examples: selection texts
# the adapter maps' examples: 8 of calibration-split files 144..159, after the fit's (0..127) and the blend's
ADAPTER_FILES, ADAPTER_SKIP, ADAPTER_EXAMPLES, ADAPTER_CONTEXT = 16, adapters.CALIBRATION_FILES + 16, 8, 512
CONTINUATION = 64
TOLERANCE = 0.01  # share of the float32 KL a 16-bit variant's difference may reach
CANDIDATES = ("bfloat16", "float16")  # the storage dtypes tried, preferred first

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
    each candidate dtype its range holds (a weight float16 cannot hold would be infinite: that variant is left out),
    all multiplied in float32 so that only the stored rounding differs."""
    variants = {"float32": kv_map}
    largest = max(float(t.abs().max()) for key, t in kv_map.tensors.items() if is_weight(key))
    for name in CANDIDATES:
        dtype = getattr(torch, name)
        if largest < torch.finfo(dtype).max:
            variants[name] = kv_map.with_weights_dtype(dtype)
    with matmuls_in("float32"):
        return siblings.score_maps(source, target, variants, examples, context, CONTINUATION, progress)


def choose(float32_kl: float, differences: dict[str, dict]) -> str:
    """The first of `CANDIDATES` scored whose paired KL difference's interval stays within `TOLERANCE` of
    ``float32_kl``, else ``float32``."""
    within = [name for name in CANDIDATES if name in differences
              and max(abs(differences[name]["low"]), abs(differences[name]["high"])) < TOLERANCE * float32_kl]
    return within[0] if within else "float32"


def run(cases: Iterable[Case], progress: bool = True) -> dict:
    """Score every case in float32 and each candidate dtype and choose the dtype; writes ``storage-dtype``. Returns
    ``{"maps": {name: rows, differences, choice}, "choice": {name: dtype}}``."""
    choice, out = {}, {}
    for name, case in cases:
        report = score(*case, progress=progress)
        scored = {r["variant"] for r in report.rows()}
        differences = {d: report.paired_difference(d, "float32", metric="kl") for d in CANDIDATES if d in scored}
        base = next(r["kl"] for r in report.rows() if r["variant"] == "float32")
        choice[name] = choose(base, differences)
        out[name] = {"rows": report.rows(), "kl_minus_float32": differences, "choice": choice[name],
                     "weights_read_as": weights_dtype(case[2].tensors)}
    results = {"maps": out, "choice": choice, "multiplied_in": "float32"}
    save("storage-dtype", results, markdown(results))
    return results


def markdown(results: dict) -> str:
    rows, vacuous = [], []
    for name, o in results["maps"].items():
        read_as = o.get("weights_read_as", "-")  # older files lack it, and tried bfloat16 alone
        differences = o.get("kl_minus_float32") or {"bfloat16": o["kl_bfloat16_minus_float32"]}
        cells = [f"{d['difference']:+.6f} [{d['low']:+.6f}, {d['high']:+.6f}]" if d else "-"
                 for d in (differences.get(dtype) for dtype in CANDIDATES)]
        rows.append([name, read_as, f"{next(r['kl'] for r in o['rows'] if r['variant'] == 'float32'):.5f}", *cells,
                     o["choice"]])
        vacuous += [name] if read_as == "bfloat16" else []
    text = "# Storing map weights in 16 bits\n\n"
    if results.get("multiplied_in"):  # older files compared in the CPU's matmul dtype
        text += f"Every variant multiplies in {results['multiplied_in']}: only the stored weights' rounding differs.\n\n"
    text += table(["map", "weights read as", "KL float32", *(f"KL {name} - float32 [95% CI]" for name in CANDIDATES),
                   "stored as"], rows)
    if vacuous:  # the "float32" variant holds the same bfloat16 values: the row cannot tell what rounding costs
        text += (f"\n\n{', '.join(vacuous)}: read from files already stored in bfloat16 (no float32 fit at hand), so "
                 "every variant holds the same values (float16 holds bfloat16's within its range) and the differences "
                 "say nothing about rounding; the dtype stands on the check of the float32 fit that was stored so.\n")
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
