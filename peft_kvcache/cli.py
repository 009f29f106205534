"""The ``peft-kvcache`` command line: calibrate (model pairs or a base and its adapters), evaluate, card,
inspect and push KV maps.

Example:
    $ peft-kvcache calibrate --source gguf:qwen2.5-coder-0.5b-instruct \\
          --target gguf:qwen2.5-coder-1.5b-instruct --data stdlib --output maps/coder-0.5b-to-1.5b
    $ peft-kvcache inspect maps/coder-0.5b-to-1.5b
    $ peft-kvcache evaluate maps/coder-0.5b-to-1.5b --context-length 512 --write
    $ peft-kvcache push maps/coder-0.5b-to-1.5b my-org/coder-0.5b-to-1.5b-kvmap
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from . import __version__
from .errors import PeftKVCacheError

logger = logging.getLogger(__name__)

PROG = "peft-kvcache"
DATA_SUFFIXES = (".py", ".txt")
DEFAULT_CALIBRATION_FILES = 32
DEFAULT_EVALUATION_FILES = 20
BLEND_CONTINUATION = 64  # tokens scored per held-out text when choosing an adapter map's blend

DESCRIPTION = """\
Map a source LLM's KV cache into a target model's KV space, so that the target skips prefill after a
model switch (sibling sizes of one family, or a base model and its PEFT adapter).

A map is a folder (config.json, model.safetensors, README.md model card) or a Hub repo holding one.
Models are Hub ids, local folders, or fixture names such as gguf:smollm2-135m-instruct."""

EPILOG = """\
examples:
  peft-kvcache calibrate --source SRC --target TGT --data stdlib --output maps/src-to-tgt
  peft-kvcache calibrate-adapters --base gguf:smollm2-135m-instruct --adapter shout=adapters/shout \
      --output maps --prefix smollm2-135m-instruct
  peft-kvcache evaluate maps/src-to-tgt --context-length 512 --write
  peft-kvcache inspect maps/src-to-tgt
  peft-kvcache card maps/src-to-tgt --repo-id my-org/src-to-tgt-kvmap
  peft-kvcache push maps/src-to-tgt my-org/src-to-tgt-kvmap

Run 'peft-kvcache COMMAND --help' for the options of a command."""


class CLIUsageError(PeftKVCacheError, ValueError):
    """An argument of the command line names something that cannot be used (a missing file, an empty corpus)."""


# ----- data -----


def read_texts(data: str, split: str, num_files: int | None) -> tuple[list[str], str]:
    """Texts and a one-line description for ``--data``: a text file, a folder of .py/.txt files, or
    ``stdlib`` (the Python standard library corpus; ``split`` is ``calibration`` or ``evaluation``)."""
    if data == "stdlib":
        from . import corpus

        count = num_files or (DEFAULT_CALIBRATION_FILES if split == "calibration" else DEFAULT_EVALUATION_FILES)
        read = corpus.calibration_texts if split == "calibration" else corpus.evaluation_texts
        try:
            texts = read(count)
        except ValueError as err:
            raise CLIUsageError(f"--data stdlib: {err}") from None
        return texts, corpus.corpus_description(split, count)
    path = Path(data).expanduser()
    if path.is_file():
        return [path.read_text(encoding="utf-8", errors="replace")], f"the text file {path.name}"
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file())
        files = files[:num_files] if num_files else files
        if not files:
            raise CLIUsageError(f"--data {data}: the folder holds no {'/'.join(DATA_SUFFIXES)} files")
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
        return texts, f"{len(files)} {'/'.join(DATA_SUFFIXES)} files from the folder {path.name}"
    raise CLIUsageError(f"--data {data!r} is neither a file, a folder, nor 'stdlib'")


def load_models(source: str, target: str, dtype: str):
    """``(source_model, target_model, tokenizer)`` from two model specs (see `peft_kvcache.fixtures.load_model`)."""
    (source_model, tokenizer), (target_model, _) = (_load_model("--source", source, dtype),
                                                    _load_model("--target", target, dtype))
    return source_model, target_model, tokenizer


def _load_model(option: str, spec: str, dtype: str):
    """``(model, tokenizer)`` for the model spec given to ``option``; a load failure names the option."""
    import torch

    from .fixtures import load_model

    try:
        return load_model(spec, dtype=getattr(torch, dtype))
    except PeftKVCacheError:
        raise
    except (OSError, ValueError) as err:
        raise CLIUsageError(f"{option} {spec!r} cannot be loaded: {_one_line(err)}") from None


def _map_folder(spec: str, revision: str | None = None) -> Path:
    from .kvmap import resolve_map_folder

    return resolve_map_folder(spec, revision=revision)


def _local_folder(spec: str, option: str = "MAP") -> Path:
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise CLIUsageError(f"{option} {spec!r} is not a local map folder")
    return folder


# ----- commands -----


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .card import inherited_license
    from .kvmap import KVMap

    texts, description = read_texts(args.data, "calibration", args.num_files)
    source_model, target_model, tokenizer = load_models(args.source, args.target, args.dtype)
    kv_map = KVMap.calibrate(
        source_model, target_model, texts, tokenizer=tokenizer, top_k=args.top_k, max_length=args.max_length,
        heldout_fraction=args.heldout_fraction, sink_tokens=args.sink_tokens, batch_size=args.batch_size,
        description=description, progress=not args.no_progress,
    )
    kv_map.config.calibration.update(source_spec=args.source, target_spec=args.target, num_texts=len(texts))
    license_ = args.license or inherited_license(args.source, args.target)
    if license_:
        kv_map.config.calibration["license"] = license_
    folder = kv_map.save_pretrained(args.output, repo_id=args.repo_id)
    print(f"saved {kv_map!r} to {folder}")
    print(format_summary(summarize(kv_map, folder)))
    return 0


def _adapter_specs(specs: Sequence[str]) -> dict[str, Path]:
    adapters = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise CLIUsageError(f"--adapter {spec!r}: expected NAME=PATH (a folder saved by PEFT)")
        folder = Path(path).expanduser()
        if not (folder / "adapter_config.json").is_file():
            raise CLIUsageError(f"--adapter {spec!r}: {folder} holds no adapter_config.json (not a PEFT adapter)")
        if name in adapters:
            raise CLIUsageError(f"--adapter {name!r} is given twice")
        adapters[name] = folder
    return adapters


def cmd_calibrate_adapters(args: argparse.Namespace) -> int:
    from peft import PeftModel

    from .peft_maps import calibrate_adapters, choose_adapter_blends

    adapters = _adapter_specs(args.adapter)
    texts, description = read_texts(args.data, "calibration", args.num_files)
    if args.blend_files and args.blend_files >= len(texts):
        raise CLIUsageError(f"--blend-files {args.blend_files} leaves no calibration text of the {len(texts)} read")
    base, tokenizer = _load_model("--base", args.base, args.dtype)
    model = None
    for name, path in adapters.items():
        try:
            if model is None:
                model = PeftModel.from_pretrained(base, str(path), adapter_name=name)
            else:
                model.load_adapter(str(path), adapter_name=name)
        except (OSError, ValueError, RuntimeError) as err:  # e.g. an adapter trained on another base
            raise CLIUsageError(f"--adapter {name}={path} cannot be loaded on {args.base}: {_one_line(err)}") from None
    model.eval()
    heldout = texts[len(texts) - args.blend_files:] if args.blend_files else []
    fit_texts = texts[: len(texts) - len(heldout)]
    maps = calibrate_adapters(model, _tokenize(fit_texts, tokenizer), reverse=not args.no_reverse,
                              heldout_fraction=args.heldout_fraction, sink_tokens=args.sink_tokens,
                              max_length=args.max_length, description=description, progress=not args.no_progress)
    if heldout:  # each map's blend toward its source cache, chosen on text the fit did not see
        sequences = [ids[: args.max_length + BLEND_CONTINUATION] for ids in _tokenize(heldout, tokenizer)]
        short = [i for i, ids in enumerate(sequences) if len(ids) < 2 * BLEND_CONTINUATION]
        if short:
            raise CLIUsageError(f"--blend-files: {len(short)} held-out text(s) are shorter than "
                                f"{2 * BLEND_CONTINUATION} tokens")
        maps = choose_adapter_blends(maps, model, sequences, continuation=BLEND_CONTINUATION,
                                     progress=not args.no_progress)
    for kv_map in [*maps.to_adapter.values(), *maps.to_base.values()]:
        kv_map.config.calibration.update(base_spec=args.base, num_texts=len(fit_texts))
    prefix = args.prefix or Path(args.base.split(":")[-1].rstrip("/")).name.lower()
    folders = maps.save_pretrained(args.output, prefix, repo_namespace=args.repo_namespace)
    for kv_map, folder in zip([*maps.to_adapter.values(), *maps.to_base.values()], folders):
        print(f"saved {kv_map!r} to {folder}")
        print(format_summary(summarize(kv_map, folder)))
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from .evaluate import evaluate_retention
    from .kvmap import KVMap

    local = _local_folder(args.map, "evaluate --write needs a local MAP folder;") if args.write else None
    folder = _map_folder(args.map, args.revision)
    kv_map = KVMap.from_pretrained(folder)
    source = args.source or kv_map.config.calibration.get("source_spec") or kv_map.config.source_name
    target = args.target or kv_map.config.calibration.get("target_spec") or kv_map.config.target_name
    texts, description = read_texts(args.data, "evaluation", args.num_files)
    source_model, target_model, tokenizer = load_models(source, target, args.dtype)
    total = args.context_length + args.continuation_length
    sequences = [ids[:total] for ids in _tokenize(texts, tokenizer) if len(ids) >= total]
    if not sequences:
        raise CLIUsageError(
            f"--data {args.data}: no text has the {total} tokens an example needs (--context-length "
            f"{args.context_length} + --continuation-length {args.continuation_length})"
        )
    if args.max_examples:
        sequences = sequences[:args.max_examples]
    kwargs = {"progress": not args.no_progress}
    if args.windows:
        kwargs["windows"] = tuple(args.windows)
    try:
        report = evaluate_retention(source_model, target_model, kv_map, sequences, args.context_length,
                                    args.continuation_length, **kwargs)
    except ValueError as err:  # argument problems the evaluation finds (windows, lengths)
        if isinstance(err, PeftKVCacheError):
            raise
        raise CLIUsageError(str(err)) from None
    result = dict(report.to_dict(), data=description)
    print(json.dumps(result, indent=2) if args.json else report.table())
    if local is not None:
        kv_map.config.quality["retention"] = result
        kv_map.save_pretrained(local, repo_id=args.repo_id)
        print(f"recorded the figures in {local / 'config.json'} and its card", file=sys.stderr)
    return 0


def cmd_card(args: argparse.Namespace) -> int:
    from .card import write_card
    from .kvmap import KVMap

    folder = _local_folder(args.map)
    kv_map = KVMap.from_pretrained(folder)
    if args.license:
        kv_map.config.calibration["license"] = args.license
        kv_map.save_pretrained(folder, repo_id=args.repo_id)  # the license is part of config.json too
        path = folder / "README.md"
    else:
        path = write_card(kv_map, folder, repo_id=args.repo_id)
    print(f"wrote {path}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .kvmap import KVMap

    folder = _map_folder(args.map, args.revision)
    kv_map = KVMap.from_pretrained(folder)
    summary = summarize(kv_map, folder)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from .kvmap import KVMap

    kv_map = KVMap.from_pretrained(_local_folder(args.map))  # validates before anything is uploaded
    url = kv_map.push_to_hub(args.repo_id, private=args.private or None, token=args.token,
                             commit_message=args.commit_message, revision=args.revision)
    print(url)
    return 0


# ----- inspect -----


def _stats(rows: list[list[float]]) -> dict | None:
    values = [v for row in rows for v in row]
    if not values:
        return None
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def summarize(kv_map, folder: Path | None = None) -> dict:
    """A JSON-friendly summary of a map: pair, fingerprints, layers chosen, R^2, sizes, figures, files."""
    c = kv_map.config
    files = {}
    if folder is not None:
        files = {p.name: p.stat().st_size for p in sorted(Path(folder).iterdir()) if p.is_file()}
    layer_means = [sum(r) / len(r) for r in c.key_r2] if c.key_r2 else []
    weakest = sorted(range(len(layer_means)), key=layer_means.__getitem__)[:3]
    return {
        "folder": None if folder is None else str(folder),
        "pair_kind": c.pair_kind,
        "source": {"name": c.source_name, "fingerprint": c.source_fingerprint, **c.source_layout.to_dict(),
                   "rope": c.source_rotary},
        "target": {"name": c.target_name, "fingerprint": c.target_fingerprint, **c.target_layout.to_dict(),
                   "rope": c.target_rotary},
        "vocab_size": c.vocab_size,
        "sink_tokens": c.sink_tokens,
        "key_layers": c.key_layers,
        "value_layers": c.value_layers,
        "key_r2": _stats(c.key_r2),
        "value_r2": _stats(c.value_r2),
        "weakest_key_layers": [{"layer": t, "r2": layer_means[t]} for t in weakest],
        "parameters": kv_map.num_parameters,
        "files": files,
        "calibration": {k: v for k, v in c.calibration.items() if k != "lambda_grid"},
        "quality": c.quality,
        "format_version": c.format_version,
        "library_version": c.library_version,
    }


def _count(value) -> str:
    return f"{value:,}" if isinstance(value, int) else "?"


def _layers_line(groups: list[list[int]]) -> str:
    return " ".join(f"{t}<-{'+'.join(map(str, group))}" for t, group in enumerate(groups))


def format_summary(summary: dict) -> str:
    """The text `peft-kvcache inspect` prints for a `summarize` result."""
    s, t = summary["source"], summary["target"]
    lines = [
        f"map          {summary['folder'] or '(in memory)'}",
        f"pair         {s['name']} -> {t['name']} ({summary['pair_kind']}, vocabulary {summary['vocab_size']:,})",
    ]
    for role, side in (("source", s), ("target", t)):
        rope = side["rope"]
        lines.append(f"{role:<12} {side['num_layers']} layers x {side['kv_heads']} KV heads x {side['head_dim']}, "
                     f"RoPE {rope.get('rope_type')} (rotary dim {rope.get('rotary_dim')}), "
                     f"fingerprint {side['fingerprint']}")
    lines.append(f"layers keys  {_layers_line(summary['key_layers'])}   (target<-source)")
    lines.append(f"layers vals  {_layers_line(summary['value_layers'])}")
    for kind in ("key", "value"):
        stats = summary[f"{kind}_r2"]
        text = "not recorded" if stats is None else (
            f"mean {stats['mean']:.3f}, min {stats['min']:.3f}, max {stats['max']:.3f} over layers and KV heads")
        lines.append(f"R2 {kind + 's':<9} {text}")
    if summary["weakest_key_layers"]:
        weakest = ", ".join(f"{w['layer']} ({w['r2']:.3f})" for w in summary["weakest_key_layers"])
        lines.append(f"weakest      target layers by key R2: {weakest}")
    lines.append(f"size         {summary['parameters']:,} parameters; sink tokens {summary['sink_tokens']}")
    if summary["files"]:
        lines.append("files        " + ", ".join(f"{name} ({size:,} bytes)" for name, size in summary["files"].items()))
    calibration = summary["calibration"]
    if calibration:
        lines.append(f"calibration  {calibration.get('description') or 'not described'}")
        lines.append(f"             {_count(calibration.get('train_tokens'))} train / "
                     f"{_count(calibration.get('heldout_tokens'))} held-out tokens in "
                     f"{_count(calibration.get('sequences'))} sequences, top-{calibration.get('top_k', 1)}, "
                     f"{calibration.get('seconds', '?')} s")
    from .card import quality_text

    lines.append("quality      " + ("none recorded (peft-kvcache evaluate --write)" if not summary["quality"] else ""))
    if summary["quality"]:
        lines.append(quality_text(summary["quality"]))
    lines.append(f"format       {summary['format_version']} (peft-kvcache {summary['library_version']})")
    return "\n".join(lines)


# ----- parser -----


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be strictly between 0 and 1, got {text}")
    return value


def _add_models(parser: argparse.ArgumentParser, required: bool) -> None:
    hint = "" if required else " (default: the one recorded at calibration)"
    parser.add_argument("--source", required=required, metavar="MODEL",
                        help=f"source model: Hub id, folder or fixture name (gguf:...){hint}")
    parser.add_argument("--target", required=required, metavar="MODEL", help=f"target model, same forms{hint}")
    _add_dtype(parser, "the models are")


def _add_dtype(parser: argparse.ArgumentParser, loaded: str) -> None:
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help=f"dtype {loaded} loaded in (default: %(default)s)")


def _add_fit_options(parser: argparse.ArgumentParser, heldout_chooses: str) -> None:
    """The options of the ridge fit that `calibrate` and `calibrate-adapters` share."""
    parser.add_argument("--max-length", type=_positive_int, default=512, metavar="TOKENS",
                        help="texts are split into chunks of at most this many tokens (default: %(default)s)")
    parser.add_argument("--heldout-fraction", type=_fraction, default=0.2, metavar="F",
                        help=f"share of chunks held out to choose {heldout_chooses} (default: %(default)s)")
    parser.add_argument("--sink-tokens", type=_non_negative_int, default=1, metavar="N",
                        help="leading tokens the target computes itself (default: %(default)s)")


def _add_data(parser: argparse.ArgumentParser, split: str, default_files: int) -> None:
    parser.add_argument("--data", default="stdlib", metavar="DATA",
                        help="a text file, a folder of .py/.txt files, or 'stdlib' for the Python standard "
                             f"library corpus ({split} split; default: %(default)s)")
    parser.add_argument("--num-files", type=_positive_int, default=None, metavar="N",
                        help=f"use the first N files of --data (default: {default_files} for stdlib, all for a folder)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``peft-kvcache`` and its subcommands."""
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EPILOG, formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the library does (INFO level)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    p = commands.add_parser(
        "calibrate", formatter_class=fmt, help="fit a map from a source model to a target model",
        description="Run both models over calibration text, fit per-head ridge maps from the source's KV cache "
                    "to the target's, and save the map folder with its model card.",
        epilog="example:\n  peft-kvcache calibrate --source gguf:qwen2.5-coder-0.5b-instruct \\\n"
               "      --target gguf:qwen2.5-coder-1.5b-instruct --data stdlib --output maps/coder-0.5b-to-1.5b")
    _add_models(p, required=True)
    _add_data(p, "calibration", DEFAULT_CALIBRATION_FILES)
    p.add_argument("--output", required=True, metavar="DIR", help="folder to write the map to")
    p.add_argument("--top-k", type=_positive_int, default=1, metavar="K",
                   help="source layers feeding each target layer (default: %(default)s)")
    _add_fit_options(p, "ridge strengths and layers")
    p.add_argument("--batch-size", type=_positive_int, default=1, metavar="N",
                   help="chunks per forward pass (default: %(default)s)")
    p.add_argument("--license", default=None,
                   help="license for the card (default: the models' own, when both declare the same one)")
    p.add_argument("--repo-id", default=None, help="Hub repo the card's usage snippet loads (default: --output)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_calibrate)

    p = commands.add_parser(
        "calibrate-adapters", formatter_class=fmt, help="fit base <-> adapter maps for PEFT adapters of one base",
        description="Load the base model and its PEFT adapters, run the base once and every adapter over the "
                    "calibration text (PEFT's own adapter switching), fit base -> adapter maps and the reverse "
                    "adapter -> base maps, and save each as <OUTPUT>/<prefix>-base-to-<adapter> and "
                    "<OUTPUT>/<prefix>-<adapter>-to-base with its model card.",
        epilog="example:\n  peft-kvcache calibrate-adapters --base gguf:smollm2-135m-instruct \\\n"
               "      --adapter docstring=adapters/docstring --adapter shout=adapters/shout \\\n"
               "      --data stdlib --blend-files 12 --output maps --prefix smollm2-135m-instruct")
    p.add_argument("--base", required=True, metavar="MODEL",
                   help="the base model: Hub id, folder or fixture name (gguf:...)")
    p.add_argument("--adapter", required=True, action="append", metavar="NAME=PATH",
                   help="a PEFT adapter folder and the name to give it (repeat for several adapters)")
    _add_dtype(p, "the base model is")
    _add_data(p, "calibration", DEFAULT_CALIBRATION_FILES)
    p.add_argument("--output", required=True, metavar="DIR", help="folder to write the map folders into")
    p.add_argument("--prefix", default=None,
                   help="name prefix of the map folders (default: the base model's name, lower case)")
    p.add_argument("--no-reverse", action="store_true", help="only the base -> adapter maps")
    p.add_argument("--blend-files", type=_non_negative_int, default=0, metavar="N",
                   help="hold out the last N texts of --data to choose each map's blend toward its source cache "
                        "(peft_kvcache.blend; default: %(default)s, no blend)")
    _add_fit_options(p, "ridge strengths")
    p.add_argument("--repo-namespace", default=None, metavar="NS",
                   help="Hub namespace the cards' usage snippets load from (NS/<folder>; default: the folders)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_calibrate_adapters)

    p = commands.add_parser(
        "evaluate", formatter_class=fmt, help="measure how much of the target's accuracy a map retains",
        description="Teacher-forced next-token accuracy of the target over a continuation, after a context given "
                    "by its own prefill, by the mapped source cache, or not at all; prints a retention table. "
                    "Use text the map was not calibrated on (the stdlib evaluation split is disjoint).",
        epilog="example:\n  peft-kvcache evaluate maps/coder-0.5b-to-1.5b --context-length 512 --num-files 10 --write")
    p.add_argument("map", metavar="MAP", help="map folder or Hub repo id")
    p.add_argument("--revision", default=None, help="Hub revision of MAP (branch, tag or commit)")
    _add_models(p, required=False)
    _add_data(p, "evaluation", DEFAULT_EVALUATION_FILES)
    p.add_argument("--context-length", type=_positive_int, default=256, metavar="C",
                   help="context tokens per example (default: %(default)s)")
    p.add_argument("--continuation-length", type=_positive_int, default=64, metavar="M",
                   help="continuation tokens scored per example (default: %(default)s)")
    p.add_argument("--windows", type=_positive_int, nargs="+", default=None, metavar="W",
                   help="last W context tokens the target computes itself on top of the mapped cache (default: 1)")
    p.add_argument("--max-examples", type=_positive_int, default=None, metavar="N", help="score at most N examples")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.add_argument("--write", action="store_true",
                   help="record the figures in the map's config.json and regenerate its card (local MAP only)")
    p.add_argument("--repo-id", default=None, help="with --write: Hub repo the card's usage snippet loads")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_evaluate)

    p = commands.add_parser(
        "card", formatter_class=fmt, help="regenerate the README.md model card of a map folder",
        description="Render README.md (YAML metadata, pair, calibration, figures, layer chart, usage, limitations) "
                    "from the map's config.json; the tensors are not touched unless --license changes the config.",
        epilog="example:\n  peft-kvcache card maps/coder-0.5b-to-1.5b --repo-id my-org/coder-0.5b-to-1.5b-kvmap")
    p.add_argument("map", metavar="MAP", help="local map folder")
    p.add_argument("--repo-id", default=None, help="Hub repo the usage snippet loads (default: the folder)")
    p.add_argument("--license", default=None, help="set the license (recorded in config.json too)")
    p.set_defaults(func=cmd_card)

    p = commands.add_parser(
        "inspect", formatter_class=fmt, help="summarize a map: pair, layers chosen, R², sizes, figures",
        description="Load and validate a map (folder or Hub repo) and print what it maps, which source layers feed "
                    "each target layer, how well, its size and the figures measured for it.",
        epilog="example:\n  peft-kvcache inspect my-org/coder-0.5b-to-1.5b-kvmap --revision v1 --json")
    p.add_argument("map", metavar="MAP", help="map folder or Hub repo id")
    p.add_argument("--revision", default=None, help="Hub revision of MAP (branch, tag or commit)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_inspect)

    p = commands.add_parser(
        "push", formatter_class=fmt, help="upload a map folder to a Hub repo",
        description="Validate a local map and upload it (config.json, model.safetensors, README.md, chart) to a "
                    "Hub model repo, creating the repo if needed. Authentication: `hf auth login`, HF_TOKEN or "
                    "--token.",
        epilog="example:\n  peft-kvcache push maps/coder-0.5b-to-1.5b my-org/coder-0.5b-to-1.5b-kvmap --private")
    p.add_argument("map", metavar="MAP", help="local map folder")
    p.add_argument("repo_id", metavar="REPO_ID", help="Hub repo id, e.g. my-org/model-a-to-model-b-kvmap")
    p.add_argument("--private", action="store_true", help="create the repo as private")
    p.add_argument("--revision", default=None, help="branch to push to (created if needed)")
    p.add_argument("--token", default=None, help="Hub token (default: the stored login or HF_TOKEN)")
    p.add_argument("--commit-message", default="Upload KV map", help="commit message (default: %(default)s)")
    p.set_defaults(func=cmd_push)
    return parser


# ----- entry point -----


def _tokenize(texts: Sequence[str], tokenizer) -> list:
    import torch

    return [torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long) for text in texts]


def _disable_progress_bars() -> None:
    """Silence the bars of transformers (weight loading) and huggingface_hub (downloads) too."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    disable_progress_bars()


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    notes = " ".join(" ".join(note.split()) for note in getattr(err, "__notes__", []))
    return f"{text} {notes}".strip()


def _hub_errors() -> tuple[type[BaseException], ...]:
    from huggingface_hub import errors

    return (errors.HfHubHTTPError, errors.EntryNotFoundError, errors.HFValidationError, errors.OfflineModeIsEnabled,
            errors.LocalTokenNotFoundError)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for errors in the arguments or the artifacts)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.verbose:
        logging.getLogger("peft_kvcache").setLevel(logging.INFO)
    if getattr(args, "no_progress", False):
        _disable_progress_bars()
    try:
        return args.func(args)
    except PeftKVCacheError as err:
        print(f"{PROG}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except _hub_errors() as err:
        print(f"{PROG}: error: {type(err).__name__}: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
