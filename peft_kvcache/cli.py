"""The ``peft-kvcache`` command line: calibrate (model pairs, or a base and its adapters; also under
``torchrun``), evaluate, card, inspect and push KV maps; serve a base model and its adapters (`serve`).

Example:
    $ peft-kvcache calibrate --source gguf:qwen2.5-coder-0.5b-instruct \\
          --target gguf:qwen2.5-coder-1.5b-instruct --data stdlib --output maps/coder-0.5b-to-1.5b
    $ torchrun --nproc_per_node 2 -m peft_kvcache.cli calibrate ...   # statistics summed over processes
    $ peft-kvcache inspect maps/coder-0.5b-to-1.5b
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from ._version import __version__
from .errors import CalibrationError, CLIUsageError, ModelLoadError, PeftKVCacheError
from .maps.config import CalibrationConfig, ModelSpec
from .serving import command as serve

PROG = "peft-kvcache"
BLEND_CONTINUATION = 64  # tokens scored per held-out text when choosing an adapter map's blend
ADAPTER_DEFAULTS = {"same_layer": True}  # calibrate-adapters' CalibrationConfig defaults (each layer from itself)
DESCRIPTION = """\
Map a source LLM's KV cache into a target model's KV space, so that the target skips prefill after a
model switch (sibling sizes of one family, or a base model and its PEFT adapter).

A map is a folder (config.json, model.safetensors, README.md model card) or a Hub repo holding one.
Models are Hub ids, local folders, or fixture names such as gguf:smollm2-135m-instruct."""


def _load_model(option: str, spec: str, dtype: str):
    """``(model, tokenizer)`` for the model spec given to ``option``; a load failure names the option."""
    import torch

    from .lab.fixtures import load_model

    try:
        return load_model(spec, dtype=getattr(torch, dtype))
    except ModelLoadError as err:
        raise CLIUsageError(f"{option}: {err}") from None


def _config(args: argparse.Namespace, **defaults) -> CalibrationConfig:
    """The `CalibrationConfig` of the flags (one per field), checked before any model loads; errors name the flag."""
    from .calibration.loop import resolve_config

    given = {f.name: getattr(args, f.name) for f in fields(CalibrationConfig) if getattr(args, f.name) is not None}
    try:
        return resolve_config(None, {**defaults, **given})
    except CalibrationError as err:
        name, _, problem = str(err).removeprefix("CalibrationConfig: ").partition(" ")
        raise CLIUsageError(f"--{name.replace('_', '-')} {problem}") from None


def _texts(args: argparse.Namespace, split: str) -> tuple[dict[str, str], str]:
    from .lab.corpus import read_texts

    return read_texts(args.data, split, args.num_files, 32 if split == "calibration" else 20)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .calibration.loop import calibrate, join_process_group
    from .maps.card import inherited_license, summary_text

    config = _config(args)
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
    from .calibration.blend import choose_adapter_blends
    from .calibration.loop import calibrate_adapters
    from .lab.corpus import token_sequences
    from .maps.adapter_maps import default_prefix
    from .modeling.adapters import load_adapters, parse_adapter_specs

    config = _config(args, **ADAPTER_DEFAULTS)
    adapters = parse_adapter_specs(args.adapter)
    texts, description = _texts(args, "calibration")
    if args.blend_files and args.blend_files >= len(texts):
        raise CLIUsageError(f"--blend-files {args.blend_files} leaves no calibration text of the {len(texts)} read")
    base, tokenizer = _load_model("--base", args.base, args.dtype)
    model = load_adapters(base, adapters)
    names = list(texts)
    fit = {n: texts[n] for n in names[: len(names) - args.blend_files]}
    maps = calibrate_adapters(model, fit, tokenizer, config=config, reverse=not args.no_reverse,
                              description=description, base_spec=args.base,
                              adapter_paths=adapters, progress=not args.no_progress,
                              checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every)
    if args.blend_files:  # each map's blend toward its source cache, chosen on text the fit did not see
        held = [texts[n] for n in names[len(fit):]]
        sequences = token_sequences(held, tokenizer, 2 * BLEND_CONTINUATION, config.max_length + BLEND_CONTINUATION)
        if len(sequences) < len(held):
            raise CLIUsageError(f"--blend-files: {len(held) - len(sequences)} held-out text(s) are shorter than "
                                f"{2 * BLEND_CONTINUATION} tokens")
        maps = choose_adapter_blends(maps, model, sequences, continuation=BLEND_CONTINUATION,
                                     progress=not args.no_progress)
    prefix = args.prefix or default_prefix(args.base)
    for folder, (_, _, kv_map) in zip(maps.save_pretrained(args.output, prefix, args.repo_namespace), maps.all()):
        print(f"saved {kv_map!r} to {folder}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from .calibration.retention import evaluate_retention, record_figures
    from .lab.corpus import token_sequences
    from .maps.kvmap import KVMap, resolve_map_folder

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
    from .maps.kvmap import KVMap

    folder = _local_folder(args.map)
    kv_map = KVMap.from_pretrained(folder)
    if args.license:
        kv_map.config.calibration.license = args.license
    kv_map.save_pretrained(folder, repo_id=args.repo_id)  # the card renders from config.json
    print(f"wrote {folder / 'README.md'}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .maps.card import summary_text
    from .maps.kvmap import KVMap, resolve_map_folder

    folder = resolve_map_folder(args.map, revision=args.revision)
    kv_map = KVMap.from_pretrained(folder)
    print(json.dumps(kv_map.config.to_dict(), indent=2) if args.json else summary_text(kv_map.config, folder))
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from .maps.kvmap import KVMap

    kv_map = KVMap.from_pretrained(_local_folder(args.map))  # validates before anything is uploaded
    print(kv_map.push_to_hub(args.repo_id, private=args.private or None, token=args.token,
                             commit_message=args.commit_message, branch=args.revision))
    return 0


def _local_folder(spec: str) -> Path:
    if not Path(spec).expanduser().is_dir():
        raise CLIUsageError(f"MAP {spec!r} is not a local map folder")
    return Path(spec).expanduser()


# ----- the commands: each declares its own arguments -----


@dataclass(frozen=True)
class Command:
    """One subcommand: its help texts, the arguments it declares (``add_arguments(parser)``) and what it runs
    (``run(args)``, the exit status)."""

    summary: str  # one line, in the list of commands
    description: str
    example: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _map_argument(p: argparse.ArgumentParser, hub: bool) -> None:
    p.add_argument("map", metavar="MAP", help="local map folder" + (" or Hub repo id" if hub else ""))


def _revision_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--revision", default=None, help="Hub revision of MAP (branch, tag or commit)")


def _model_pair_options(p: argparse.ArgumentParser, required: bool, hint: str = "") -> None:
    p.add_argument("--source", required=required, metavar="MODEL",
                   help=f"source model: Hub id, folder or fixture name{hint}")
    p.add_argument("--target", required=required, metavar="MODEL", help=f"target model, same forms{hint}")


def _data_options(p: argparse.ArgumentParser, split: str) -> None:
    """``--data`` and ``--num-files`` (read by `_texts`), then the models' ``--dtype`` and ``--no-progress``."""
    add = p.add_argument
    add("--data", default="stdlib", metavar="DATA", help="a text file, a folder of text files, or 'stdlib' (the "
        f"Python standard library corpus, {split} split; default: %(default)s)")
    add("--num-files", type=int, default=None, metavar="N", help="use the first N files of --data (default: 32 "
        "calibration / 20 evaluation files for stdlib, all for a folder)")
    add("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="dtype the models are "
        "loaded in (default: %(default)s)")
    add("--no-progress", action="store_true", help="no progress bars")


def _calibration_options(p: argparse.ArgumentParser, **defaults) -> None:
    """``--output``, one flag per `CalibrationConfig` field (read by `_config` with the same ``defaults``) and the
    checkpoint options."""
    add = p.add_argument
    add("--output", required=True, metavar="DIR", help="folder to write the map (folders) to")
    hints = typing.get_type_hints(CalibrationConfig)
    for f in fields(CalibrationConfig):
        flag, help_text = "--" + f.name.replace("_", "-"), f"{f.metadata['help']} (default: {defaults.get(f.name, f.default)})"
        if hints[f.name] is bool:
            add(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            tuple_ = typing.get_origin(hints[f.name]) is tuple
            add(flag, type=float if tuple_ else hints[f.name], nargs="+" if tuple_ else None, default=None,
                metavar=f.name.split("_")[-1].upper(), help=help_text)
    add("--checkpoint-dir", default=None, metavar="DIR", help="checkpoint the statistics there and resume an "
        "interrupted calibration from it")
    add("--checkpoint-every", type=int, default=50, metavar="N", help="batches between checkpoints (default: 50)")


def _repo_id_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repo-id", default=None, help="Hub repo the card's usage snippet loads (default: the folder's name)")


def _json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def calibrate_arguments(p: argparse.ArgumentParser) -> None:
    _model_pair_options(p, required=True)
    _data_options(p, "calibration")
    _calibration_options(p)
    p.add_argument("--license", default=None, help="license for the card (default: the models' common one)")
    _repo_id_option(p)


def calibrate_adapters_arguments(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--base", required=True, metavar="MODEL", help="the base model: Hub id, folder or fixture name")
    add("--adapter", required=True, action="append", metavar="NAME=PATH",
        help="a PEFT adapter folder and the name to give it (repeat for several adapters)")
    add("--prefix", default=None, help="name prefix of the map folders (default: the base model's name)")
    add("--no-reverse", action="store_true", help="only the base -> adapter maps")
    add("--blend-files", type=int, default=0, metavar="N", help="hold out the last N texts of --data to choose "
        "each map's blend toward its source cache (default: 0, no blend)")
    add("--repo-namespace", default=None, metavar="NS", help="Hub namespace the cards' snippets load from")
    _data_options(p, "calibration")
    _calibration_options(p, **ADAPTER_DEFAULTS)


def evaluate_arguments(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    _map_argument(p, hub=True)
    _revision_option(p)
    _model_pair_options(p, required=False, hint=" (default: the one recorded)")
    _data_options(p, "evaluation")
    _repo_id_option(p)
    add("--context-length", type=int, default=256, metavar="C", help="context tokens (default: %(default)s)")
    add("--continuation-length", type=int, default=64, metavar="M", help="scored tokens (default: %(default)s)")
    add("--windows", type=int, nargs="+", default=[1], metavar="W",
        help="last W context tokens the target computes itself (default: 1)")
    add("--max-examples", type=int, default=None, metavar="N", help="score at most N examples")
    add("--write", action="store_true", help="record the figures in the map (local MAP only)")
    _json_option(p)


def card_arguments(p: argparse.ArgumentParser) -> None:
    _map_argument(p, hub=False)
    _repo_id_option(p)
    p.add_argument("--license", default=None, help="set the license (recorded in config.json too)")


def inspect_arguments(p: argparse.ArgumentParser) -> None:
    _map_argument(p, hub=True)
    _revision_option(p)
    _json_option(p)


def push_arguments(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    _map_argument(p, hub=False)
    add("repo_id", metavar="REPO_ID", help="Hub repo id, e.g. my-org/model-a-to-model-b-kvmap")
    add("--private", action="store_true", help="create the repo as private")
    add("--revision", default=None, help="branch to push to (created if needed)")
    add("--token", default=None, help="Hub token (default: the stored login or HF_TOKEN)")
    add("--commit-message", default="Upload KV map", help="commit message (default: %(default)s)")


COMMANDS: dict[str, Command] = {
    "calibrate": Command(
        "fit a map from a source model to a target model",
        "Run both models over calibration text, fit per-head ridge maps from the source's KV cache to the "
        "target's, and save the map folder with its card. Under torchrun every process takes a shard.",
        "peft-kvcache calibrate --source gguf:qwen2.5-coder-0.5b-instruct "
        "--target gguf:qwen2.5-coder-1.5b-instruct --output maps/coder-up",
        calibrate_arguments, cmd_calibrate),
    "calibrate-adapters": Command(
        "fit base <-> adapter maps for the PEFT adapters of one base",
        "Run the base once and every adapter over the calibration text and save "
        "<OUTPUT>/<prefix>-base-to-<adapter> and <OUTPUT>/<prefix>-<adapter>-to-base with their cards.",
        "peft-kvcache calibrate-adapters --base gguf:smollm2-135m-instruct "
        "--adapter shout=adapters/shout --output maps",
        calibrate_adapters_arguments, cmd_calibrate_adapters),
    "evaluate": Command(
        "measure how much of the target's accuracy a map keeps",
        "Teacher-forced next-token accuracy over a continuation after a context from the target's own "
        "prefill, from the map, or none. --write records the figures (and evaluation.json with their "
        "provenance) only for text disjoint from the map's calibration text.",
        "peft-kvcache evaluate maps/coder-up --context-length 512 --num-files 10 --write",
        evaluate_arguments, cmd_evaluate),
    "card": Command(
        "regenerate the README.md model card of a map folder",
        "Render README.md and the chart from the map's config.json.",
        "peft-kvcache card maps/coder-up --repo-id my-org/coder-up-kvmap",
        card_arguments, cmd_card),
    "inspect": Command(
        "summarize a map: pair, layers, R², data, figures",
        "Load and validate a map (folder or Hub repo) and say what it maps, how well and on what data.",
        "peft-kvcache inspect my-org/coder-up-kvmap --json",
        inspect_arguments, cmd_inspect),
    "push": Command(
        "upload a map folder to a Hub repo",
        "Validate a local map and upload it to a Hub model repo, creating the repo (and branch) if needed. "
        "Authentication: `hf auth login`, HF_TOKEN or --token.",
        "peft-kvcache push maps/coder-up my-org/coder-up-kvmap --private",
        push_arguments, cmd_push),
    "serve": Command(
        "serve an OpenAI-compatible chat API over a base model and its adapters",
        "Chat completions for the base model and each adapter, with one prefix cache shared across adapters: "
        "a switch maps the base cache of the history instead of prefilling it (see peft_kvcache.serving.app).",
        "peft-kvcache serve --model gguf:smollm2-135m-instruct --adapter shout=adapters/shout --maps hub_cards",
        serve.add_arguments, serve.run),
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``peft-kvcache`` and its subcommands."""
    fmt = argparse.RawDescriptionHelpFormatter
    examples = "\n".join(f"  {command.example}" for command in COMMANDS.values())
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, formatter_class=fmt, epilog=(
        f"examples:\n{examples}\n\nRun 'peft-kvcache COMMAND --help' for the options of a command."))
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the library does (INFO level)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, formatter_class=fmt, help=command.summary, description=command.description,
                                  epilog=f"example:\n  {command.example}")
        command.add_arguments(sub)
        sub.set_defaults(func=command.run)
    return parser


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    notes = " ".join(" ".join(note.split()) for note in getattr(err, "__notes__", []))
    return f"{text} {notes}".strip()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for errors in the arguments or the artifacts)."""
    from huggingface_hub import errors as hub

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.verbose:
        logging.getLogger("peft_kvcache").setLevel(logging.INFO)
    if getattr(args, "no_progress", False):
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        disable_progress_bars()
    try:
        return args.func(args)
    except PeftKVCacheError as err:
        print(f"{PROG}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except (hub.HfHubHTTPError, hub.EntryNotFoundError, hub.HFValidationError, hub.OfflineModeIsEnabled,
            hub.LocalTokenNotFoundError) as err:
        print(f"{PROG}: error: {type(err).__name__}: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
