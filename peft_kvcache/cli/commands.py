"""What each command of the command line runs (``run(args)`` returns the exit status)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import fields, replace
from pathlib import Path

from ..errors import CalibrationError, ModelLoadError
from ..maps.config import CalibrationConfig, ModelSpec
from ..modeling.layout import KVLayout
from .options import ADAPTER_DEFAULTS, CLIUsageError, parse_adapter_specs

BLEND_CONTINUATION = 64  # tokens scored per held-out text when choosing an adapter map's blend


def _load_model(option: str, spec: str, dtype: str):
    """``(model, tokenizer)`` for the model spec given to ``option``; a load failure names the option."""
    import torch

    from ..modeling.fixtures import load_model

    try:
        return load_model(spec, dtype=getattr(torch, dtype))
    except ModelLoadError as err:
        raise CLIUsageError(f"{option}: {err}") from None


def _config(args: argparse.Namespace, **defaults) -> CalibrationConfig:
    """The `CalibrationConfig` of the flags (one per field), checked before any model loads; errors name the flag."""
    from ..calibration.loop import resolve_config

    given = {f.name: getattr(args, f.name) for f in fields(CalibrationConfig) if getattr(args, f.name) is not None}
    try:
        return resolve_config(None, {**defaults, **given})
    except CalibrationError as err:
        name, _, problem = str(err).removeprefix("CalibrationConfig: ").partition(" ")
        raise CLIUsageError(f"--{name.replace('_', '-')} {problem}") from None


def _texts(args: argparse.Namespace, split: str) -> tuple[dict[str, str], str]:
    from ..lab.corpus import read_texts

    return read_texts(args.data, split, args.num_files, 32 if split == "calibration" else 20)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ..calibration.loop import calibrate, join_process_group
    from ..maps.card import inherited_license, summary_text
    from ..maps.storage import check_save_target

    config = _config(args)
    if int(os.environ.get("RANK", "0")) == 0:  # before hours of calibration; the rank that will save (it may
        check_save_target(args.output)           # finish a swap a crash left half done: one process at a time)
    rank, world = join_process_group()
    texts, description = _texts(args, "calibration")
    (source, tokenizer), (target, _) = (_load_model("--source", args.source, args.dtype),
                                        _load_model("--target", args.target, args.dtype))
    kv_map = calibrate(source, target, texts, tokenizer, config, description=description,
                       source_spec=ModelSpec(args.source), target_spec=ModelSpec(args.target),
                       progress=not args.no_progress and rank == 0, checkpoint_dir=args.checkpoint_dir,
                       checkpoint_every=args.checkpoint_every)
    kv_map.config.calibration.license = args.license or inherited_license(args.source, args.target)
    if rank == 0:
        kv_map.save_pretrained(args.output, repo_id=args.repo_id)
        print(f"saved {kv_map!r} to {args.output} ({world} process(es))\n{summary_text(kv_map.config, Path(args.output))}")
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0


def cmd_calibrate_adapters(args: argparse.Namespace) -> int:
    from ..calibration.blend import choose_adapter_blends
    from ..calibration.loop import calibrate_adapters
    from ..calibration.rank import choose_adapter_ranks
    from ..lab.corpus import token_sequences
    from ..maps.adapter_maps import default_prefix, folder_name
    from ..maps.storage import check_save_target
    from ..modeling.adapters import load_adapters

    config = _config(args, **ADAPTER_DEFAULTS)
    adapters = parse_adapter_specs(args.adapter)
    prefix = args.prefix or default_prefix(args.base)
    if Path(args.output).is_file():
        raise CLIUsageError(f"--output {args.output} is a file: it takes a folder, which will hold a folder per map")
    for name in adapters:  # every map folder, before any model loads
        for reverse in (False, True):
            check_save_target(Path(args.output) / folder_name(prefix, name, reverse))
    ranks = sorted(set(args.choose_rank or ()))
    if ranks and (not args.blend_files or config.residual_rank or ranks[0] < 1):
        raise CLIUsageError("--choose-rank needs --blend-files (the texts that choose), positive ranks and no "
                            "--residual-rank (every candidate is fitted from the same statistics)")
    texts, description = _texts(args, "calibration")
    if args.blend_files and args.blend_files >= len(texts):
        raise CLIUsageError(f"--blend-files {args.blend_files} leaves no calibration text of the {len(texts)} read")
    base, tokenizer = _load_model("--base", args.base, args.dtype)
    width = KVLayout.of(base).layer_width if ranks else 0
    if ranks and 2 * ranks[-1] >= width:  # a factored layer costs 2r multiply-adds per feature, a dense one the width
        raise CLIUsageError(f"--choose-rank {ranks[-1]}: a rank saves compute only below half the layer width "
                            f"({width}); pass ranks below {(width + 1) // 2}")
    model = load_adapters(base, adapters)
    names = list(texts)
    fit = {n: texts[n] for n in names[: len(names) - args.blend_files]}
    with tempfile.TemporaryDirectory(prefix="peft-kvcache-statistics-") as scratch:
        # every candidate rank is fitted from one capture: its statistics, checkpointed (a scratch folder if none)
        checkpoint_dir = args.checkpoint_dir or (scratch if ranks else None)
        candidates = {rank: calibrate_adapters(model, fit, tokenizer, config=replace(config, residual_rank=rank),
                                               reverse=not args.no_reverse, description=description,
                                               base_spec=args.base, adapter_paths=adapters,
                                               progress=not args.no_progress, checkpoint_dir=checkpoint_dir,
                                               checkpoint_every=args.checkpoint_every)
                      for rank in [0, *ranks]}
    maps = candidates[0]
    if args.blend_files:  # each map's rank and blend toward its source cache, chosen on text the fit did not see
        held = [texts[n] for n in names[len(fit):]]
        sequences = token_sequences(held, tokenizer, 2 * BLEND_CONTINUATION, config.max_length + BLEND_CONTINUATION)
        if len(sequences) < len(held):
            raise CLIUsageError(f"--blend-files: {len(held) - len(sequences)} held-out text(s) are shorter than "
                                f"{2 * BLEND_CONTINUATION} tokens")
        if ranks:
            maps = choose_adapter_ranks(candidates, model, sequences, continuation=BLEND_CONTINUATION,
                                        progress=not args.no_progress)
        maps = choose_adapter_blends(maps, model, sequences, continuation=BLEND_CONTINUATION,
                                     progress=not args.no_progress)
    for folder, (_, _, kv_map) in zip(maps.save_pretrained(args.output, prefix, args.repo_namespace), maps.all()):
        print(f"saved {kv_map!r} to {folder}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from ..calibration.retention import evaluate_retention, record_figures
    from ..lab.corpus import token_sequences
    from ..maps.kvmap import KVMap
    from ..maps.storage import resolve_map_folder

    if args.write and not Path(args.map).expanduser().is_dir():
        raise CLIUsageError("evaluate --write needs a local MAP folder")
    folder = resolve_map_folder(args.map, revision=args.revision)
    kv_map = KVMap.from_pretrained(folder)
    texts, description = _texts(args, "evaluation")
    calibrated = set(kv_map.config.calibration.data.names())
    if args.write and (not calibrated or calibrated & set(texts)):
        raise CLIUsageError("evaluate --write needs evaluation text disjoint from the map's calibration text: "
                            f"{sorted(calibrated & set(texts))[:3] or 'the map records no calibration texts'}")
    recorded = kv_map.config.calibration
    (source, tokenizer), (target, _) = (
        _load_model("--source", args.source or (recorded.source.model if recorded.source else kv_map.config.source_name),
                    args.dtype),
        _load_model("--target", args.target or (recorded.target.model if recorded.target else kv_map.config.target_name),
                    args.dtype))
    total = args.context_length + args.continuation_length
    tokenized = {name: token_sequences([text], tokenizer, total) for name, text in texts.items()}
    names = [name for name, found in tokenized.items() if found][: args.max_examples]  # texts long enough
    sequences = [tokenized[name][0] for name in names]
    if not sequences:
        raise CLIUsageError(f"--data {args.data}: no text has the {total} tokens an example needs (--context-length "
                            f"{args.context_length} + --continuation-length {args.continuation_length})")
    report = evaluate_retention(source, target, kv_map, sequences, args.context_length, args.continuation_length,
                                windows=tuple(args.windows), progress=not args.no_progress)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.table())
    if args.write:
        record_figures(kv_map, report, folder, {"description": description, "texts": names})
        kv_map.save_pretrained(folder, repo_id=args.repo_id)
        print(f"recorded the figures in {folder / 'config.json'} and its card (from evaluation.json)", file=sys.stderr)
    return 0


def cmd_card(args: argparse.Namespace) -> int:
    from ..maps.kvmap import KVMap

    folder = _local_folder(args.map)
    kv_map = KVMap.from_pretrained(folder)
    if args.license:
        kv_map.config.calibration.license = args.license
    kv_map.save_pretrained(folder, repo_id=args.repo_id)  # the card renders from config.json
    print(f"wrote {folder / 'README.md'}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..maps.card import summary_text
    from ..maps.kvmap import KVMap
    from ..maps.storage import resolve_map_folder

    folder = resolve_map_folder(args.map, revision=args.revision)
    kv_map = KVMap.from_pretrained(folder)
    print(json.dumps(kv_map.config.to_dict(), indent=2) if args.json else summary_text(kv_map.config, folder))
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from ..maps.kvmap import KVMap

    kv_map = KVMap.from_pretrained(_local_folder(args.map))  # validates before anything is uploaded
    print(kv_map.push_to_hub(args.repo_id, private=args.private or None, token=args.token,
                             commit_message=args.commit_message, branch=args.revision))
    return 0


def _local_folder(spec: str) -> Path:
    if not Path(spec).expanduser().is_dir():
        raise CLIUsageError(f"MAP {spec!r} is not a local map folder")
    return Path(spec).expanduser()
