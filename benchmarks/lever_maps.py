"""Sibling maps fitted as the published ones but for one calibration lever, for the recipes benchmark to compare
(`benchmarks.recipes run --lever LABEL=FOLDER`): the same calibration files (the scale the data-scaling curve chose)
and options (`siblings.CONFIG`) with the lever's changes, both directions from one capture of the pair.

    python -m benchmarks.lever_maps --label attention --attention-weighting 0.5
    python -m benchmarks.lever_maps --label l2048 --max-length 2048
    python -m benchmarks.lever_maps --label joint --joint-kinds
    python -m benchmarks.lever_maps --label distill --distill --on capture-top2   # the capture's fit, distilled
    python -m benchmarks.lever_maps --label basis512-distill --distill --on basis512   # a lever's maps, distilled
    python -m benchmarks.lever_maps --label nonlinear --nonlinear --on top4     # a lever's maps with nonlinear heads
    python -m benchmarks.lever_maps --label top4-bonus1 --bonus 1 --on top4     # ... with a 1-nat attention bonus
    python -m benchmarks.lever_maps --label top4-bonus2 --bonus 2 --on top4     # the kept query moments: no pass
    python -m benchmarks.lever_maps --label top4-jensen --bonus jensen --on top4   # each head's own bonus
    python -m benchmarks.recipes run --maps runs/levers/capture-top2 --role selection --lever attention=runs/levers/attention

Writes ``runs/levers/<label>/<pair>`` (maps named as the published ones). The statistics are checkpointed under
``runs/levers/statistics/<the options that shape them>``, so a stopped capture resumes and levers that differ only in
how the maps are fitted from the statistics (``--top-k``) share one capture (the attention bonus keeps the target's
query moments under ``runs/levers/query-moments`` alike: every bonus size and map of a direction reads one set):

    python -m benchmarks.lever_maps --label top4 --top-k 4
    python -m benchmarks.lever_maps --label top8 --top-k 8     # no forward pass: top4's statistics
    python -m benchmarks.lever_maps --label all --top-k 28     # every source layer (24 going up, 28 down)
    python -m benchmarks.lever_maps --label basis256 --top-k 28 --basis-rank 256   # all through one shared basis
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import replace
from pathlib import Path

import torch

from peft_kvcache import KVMap
from peft_kvcache._files import atomic_write
from peft_kvcache.calibration.bonus import QueryMoments, add_attention_bonus, target_query_moments
from peft_kvcache.calibration.distill import distill_map
from peft_kvcache.calibration.loop import statistics_options
from peft_kvcache.calibration.nonlinear import fit_nonlinear_heads
from peft_kvcache.errors import RecordError
from peft_kvcache.lab.provenance import provenance
from peft_kvcache.maps.config import CalibrationConfig
from peft_kvcache.maps.storage import WEIGHTS_NAME
from peft_kvcache.lab.corpus import stdlib_texts

from . import siblings
from .common import ROOT, map_fingerprint, read_results, start_run

LEVERS = ROOT / "runs" / "levers"


def fit(label: str, changes: dict, files: int, progress: bool = True) -> Path:
    """Both directions' maps with ``changes`` to `siblings.CONFIG` (fields of `CalibrationConfig`), fitted on the first
    ``files`` calibration files into ``runs/levers/<label>``; maps already there are kept."""
    folder = LEVERS / label
    folders = {d: folder / siblings.pair_name(d) for d in siblings.DIRECTIONS}
    config = replace(siblings.CONFIG, **changes)
    config.validate()
    if all(f.is_dir() for f in folders.values()):
        for f in folders.values():
            fitted = KVMap.from_pretrained(f).config
            layers = fitted.source_layout.num_layers
            if (fitted.calibration.options != for_source(config, layers)
                    or len(fitted.calibration.data.names()) != files):
                raise RecordError(f"{f} holds a map fitted on {len(fitted.calibration.data.names())} files with other "
                                  f"options ({fitted.calibration.options}); remove it or choose another label")
        return folder
    models, tokenizer = siblings.load_pair()
    texts = siblings.calibration_texts(tokenizer, files, config)
    vocab = models["small"].get_input_embeddings().weight.shape[0]
    configs = {d: for_source(config, models[siblings.DIRECTIONS[d][0]].config.num_hidden_layers)
               for d in siblings.DIRECTIONS}

    def on_scale(scale, run):
        for direction, out in folders.items():
            siblings.fit_direction(run, direction, texts, scale, configs[direction], vocab).save_pretrained(
                out, chart=False)
            write_fitted(out)

    siblings.capture(models, texts, [files], config, on_scale, checkpoint_root=statistics_folder(config),
                     progress=progress)
    return folder


# What can be added to a published map after its fit: name -> function(map, source, target, texts, tokenizer, **options)
BONUS_FILES = 24  # the first calibration files the bonus reads the target's queries over (some 90k per KV head)


def attention_bonus(kv_map, source, target, texts, tokenizer, progress: bool = True, **options):
    """`add_attention_bonus` as an addition, over the first `BONUS_FILES` of the map's calibration files (it reads the
    target's queries; ``source`` runs for ``bonus="jensen"`` only, whose residuals are the map's own); the query moments
    are kept (`kept_query_moments`)."""
    first = dict(list(texts.items())[:BONUS_FILES])
    read = {name: options[name] for name in ("max_distance", "draws", "seed") if name in options}
    moments = kept_query_moments(kv_map, target, first, tokenizer, progress, **read)
    if options.get("bonus") == "jensen":
        return add_attention_bonus(kv_map, target, first, tokenizer, moments=moments, source_model=source,
                                   progress=progress, **options)
    return add_attention_bonus(kv_map, target, moments=moments, **options)


def kept_query_moments(kv_map, target, texts: dict, tokenizer, progress: bool = True, **read) -> QueryMoments:
    """`target_query_moments` over ``texts``, read once per target, files, chunking and ``read`` options (kept in
    ``runs/levers/query-moments``): both defaults' maps of a direction share them."""
    calibration = kv_map.config.calibration.options  # the fields that cut the texts into the chunks the passes read
    chunking = {name: getattr(calibration, name) for name in ("max_length", "chunks_per_text", "sink_tokens",
                                                           "heldout_fraction")}
    key = json.dumps({"target": kv_map.config.target_fingerprint, "files": sorted(texts), **chunking, **read},
                     sort_keys=True)
    path = LEVERS / "query-moments" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"
    if path.is_file():
        return QueryMoments.load(path)
    moments = target_query_moments(kv_map, target, texts, tokenizer, progress=progress, **read)
    path.parent.mkdir(parents=True, exist_ok=True)
    moments.save(path)
    return moments


ADDITIONS = {"distill": distill_map, "nonlinear": fit_nonlinear_heads, "bonus": attention_bonus}


def bonus_size(value: str) -> float | str:
    """``--bonus``: a number of nats, or ``jensen``."""
    if value == "jensen":
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of nats or 'jensen', got {value!r}") from None


def add_to_maps(label: str, addition: str, options: dict, files: int, on: str, progress: bool = True) -> Path:
    """Both maps of the lever ``on`` (``runs/levers/<on>``; ``capture-top2``: the capture's fit, what the recipes
    benchmark calls the published maps) with ``addition`` (`ADDITIONS`: distillation, nonlinear heads, the attention
    bonus) fitted on their own calibration files (the first ``files``: their held-out texts stay held out) into
    ``runs/levers/<label>``. A direction already done from the same maps (their weights' fingerprint) with these
    options is kept (``lever.json`` beside it says what was done), so a stopped run resumes with the next direction."""
    folder, base = LEVERS / label, LEVERS / on
    if folder == base:
        raise RecordError(f"--label {label} would write over the maps it adds to: choose another label")
    todo = {}  # both directions checked before any model loads
    for direction in siblings.DIRECTIONS:
        out = folder / siblings.pair_name(direction)
        if not (base / out.name / WEIGHTS_NAME).is_file():
            raise RecordError(f"{base / out.name} holds no map: fit the {on!r} lever first")
        what = {"addition": addition, "options": options, "files": files, "on": on,
                "base": map_fingerprint(base / out.name)}
        if out.is_dir():
            done = json.loads((out / "lever.json").read_text()) if (out / "lever.json").is_file() else None
            if done != what:
                raise RecordError(f"{out} holds a map made otherwise ({done}, not {what}); remove it or choose "
                                  "another label")
            continue
        fitted = KVMap.from_pretrained(base / out.name)
        if len(fitted.config.calibration.data.names()) != files:
            raise RecordError(f"the {on} {direction} map was fitted on "
                              f"{len(fitted.config.calibration.data.names())} files, not {files}: pass --files")
        if addition == "nonlinear" and fitted.config.basis_rank:
            raise RecordError(f"the {on} {direction} map reads a shared basis: nonlinear heads need each layer's own "
                              "weights (add them to a lever fitted without --basis-rank)")
        todo[direction] = (out, what, fitted)
    models = tokenizer = None
    for direction, (out, what, fitted) in todo.items():
        if models is None:
            models, tokenizer = siblings.load_pair()
        source, target = (models[name] for name in siblings.DIRECTIONS[direction])
        kv_map = ADDITIONS[addition](fitted, source, target, stdlib_texts("calibration", files), tokenizer,
                                     progress=progress, **options)
        kv_map.save_pretrained(out, chart=False)  # lever.json last: a folder without it is not done
        write_fitted(out)
        atomic_write(out / "lever.json", lambda tmp: Path(tmp).write_text(json.dumps(what, indent=1)))
    return folder


FITTED_NAME = "fitted.json"  # beside a lever's map: the machine that fitted it (its weights follow the CPU's kernels)


def write_fitted(folder: Path) -> None:
    """Say beside a lever's map which machine fitted it (`provenance`: CPU model and vector extensions, threads,
    versions): the same fit on AVX-512 and AVX2 machines gave maps that differ at rounding, so a fingerprint's
    records belong to one kind of machine's fit."""
    atomic_write(folder / FITTED_NAME, lambda tmp: Path(tmp).write_text(json.dumps(provenance(), indent=1)))


def fitted_on(folder: Path) -> dict | None:
    """The CPU and vector extensions ``write_fitted`` recorded for ``folder``'s map (None for maps fitted before)."""
    path = folder / FITTED_NAME
    if not path.is_file():
        return None
    facts = json.loads(path.read_text())
    return {"cpu": facts.get("cpu"), "cpu_features": facts.get("cpu_features")}


def for_source(config: CalibrationConfig, layers: int) -> CalibrationConfig:
    """``config`` for a source of ``layers`` layers: a ``top_k`` above its candidate inputs means all of them
    (`--top-k 28`: the 0.5B's 24 layers going up, the 1.5B's 28 going down; with ``joint_kinds`` twice as many)."""
    return replace(config, top_k=min(config.top_k, config.candidate_inputs(layers)))


def statistics_folder(config) -> Path:
    """Where a lever's statistics are checkpointed: one folder per set of options that shape them (a checkpoint also
    checks the texts' digest before it resumes)."""
    shaping = statistics_options(config)
    return LEVERS / "statistics" / ("-".join(f"{k}={v}" for k, v in sorted(shaping.items())) or "default")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="the lever's name (its folder under runs/levers)")
    parser.add_argument("--attention-weighting", type=float, help="CalibrationConfig.attention_weighting")
    parser.add_argument("--max-length", type=int, help="CalibrationConfig.max_length (tokens per calibration chunk)")
    parser.add_argument("--top-k", type=int, help="CalibrationConfig.top_k (source layers per target layer)")
    parser.add_argument("--basis-rank", type=int, help="CalibrationConfig.basis_rank (with --top-k 28: all source "
                        "layers through one shared basis of this rank)")
    parser.add_argument("--joint-kinds", action="store_true", default=None,
                        help="CalibrationConfig.joint_kinds (each kind from the source's keys and values together)")
    parser.add_argument("--distill", action="store_true",
                        help="distill a lever's maps (--on; peft_kvcache.calibration.distill) instead of fitting new "
                             "ones")
    parser.add_argument("--nonlinear", action="store_true",
                        help="add nonlinear heads to a lever's maps (--on; peft_kvcache.calibration.nonlinear)")
    parser.add_argument("--bonus", type=bonus_size, metavar="NATS",
                        help="add an attention bonus of NATS to a lever's maps' keys, or 'jensen' (each head's own: "
                             "half the variance of its logits' residual) (--on; peft_kvcache.calibration.bonus)")
    parser.add_argument("--bonus-distance", type=int, default=4096,
                        help="--bonus: the query-key distances its offset serves")
    parser.add_argument("--on", metavar="LABEL",
                        help="--distill / --nonlinear / --bonus: the lever's maps to add to (runs/levers/LABEL; "
                             "capture-top2: the capture's fit)")
    parser.add_argument("--rank", type=int, default=8, help="--distill: the correction's rank")
    parser.add_argument("--steps", type=int, default=100, help="--distill: Adam steps")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="--distill: Adam's learning rate")
    parser.add_argument("--files", type=int, help="calibration files (default: the published maps' scale)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    start_run()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    changes = {name: value for name, value in (("attention_weighting", args.attention_weighting),
                                               ("max_length", args.max_length), ("top_k", args.top_k),
                                               ("basis_rank", args.basis_rank), ("joint_kinds", args.joint_kinds))
               if value is not None}
    scales = {row["chosen_files"] for row in read_results("sibling-scaling")["curve"].values()}
    if args.files is None and len(scales) != 1:  # both directions come from one capture, at one scale
        raise RecordError(f"the published maps were fitted on different scales {sorted(scales)}: pass --files")
    files = args.files or scales.pop()
    additions = {"distill": {"rank": args.rank, "steps": args.steps, "learning_rate": args.learning_rate}
                 } if args.distill else {}
    additions |= {"nonlinear": {}} if args.nonlinear else {}
    additions |= {"bonus": {"bonus": args.bonus, "max_distance": args.bonus_distance}} if args.bonus is not None else {}
    if additions:
        if changes or len(additions) > 1 or args.on is None:
            raise RecordError("--distill, --nonlinear and --bonus each add to a lever's maps: pass one, with --on "
                              "LABEL and no calibration options")
        (addition, options), = additions.items()
        print(add_to_maps(args.label, addition, options, files, args.on))
    else:
        if args.on is not None:
            raise RecordError("--on names the maps --distill, --nonlinear or --bonus add to; a fit takes no --on")
        print(fit(args.label, changes, files))


if __name__ == "__main__":
    main()
