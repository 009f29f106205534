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
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._version import __version__
from ..errors import PeftKVCacheError
from ..serving import command as serve
from . import commands as run
from .options import (
    CLIUsageError,
    calibrate_adapters_arguments,
    calibrate_arguments,
    card_arguments,
    evaluate_arguments,
    inspect_arguments,
    parse_adapter_specs,
    push_arguments,
)

PROG = "peft-kvcache"
DESCRIPTION = """\
Map a source LLM's KV cache into a target model's KV space, so that the target skips prefill after a
model switch (sibling sizes of one family, or a base model and its PEFT adapter).

A map is a folder (config.json, model.safetensors, README.md model card) or a Hub repo holding one.
Models are Hub ids, local folders, or fixture names such as gguf:smollm2-135m-instruct."""


@dataclass(frozen=True)
class Command:
    """One subcommand: its help texts, the arguments it declares (``add_arguments(parser)``) and what it runs
    (``run(args)``, the exit status)."""

    summary: str  # one line, in the list of commands
    description: str
    example: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _serve(args: argparse.Namespace) -> int:
    return serve.run(args, parse_adapter_specs)


COMMANDS: dict[str, Command] = {
    "calibrate": Command(
        "fit a map from a source model to a target model",
        "Run both models over calibration text, fit per-head ridge maps from the source's KV cache to the "
        "target's, and save the map folder with its card. Under torchrun every process takes a shard.",
        "peft-kvcache calibrate --source gguf:qwen2.5-coder-0.5b-instruct "
        "--target gguf:qwen2.5-coder-1.5b-instruct --output maps/coder-up",
        calibrate_arguments, run.cmd_calibrate),
    "calibrate-adapters": Command(
        "fit base <-> adapter maps for the PEFT adapters of one base",
        "Run the base once and every adapter over the calibration text and save "
        "<OUTPUT>/<prefix>-base-to-<adapter> and <OUTPUT>/<prefix>-<adapter>-to-base with their cards.",
        "peft-kvcache calibrate-adapters --base gguf:smollm2-135m-instruct "
        "--adapter shout=adapters/shout --output maps",
        calibrate_adapters_arguments, run.cmd_calibrate_adapters),
    "evaluate": Command(
        "measure how much of the target's accuracy a map keeps",
        "Teacher-forced next-token accuracy over a continuation after a context from the target's own "
        "prefill, from the map, or none. --write records the figures (and evaluation.json with their "
        "provenance) only for text disjoint from the map's calibration text.",
        "peft-kvcache evaluate maps/coder-up --context-length 512 --num-files 10 --write",
        evaluate_arguments, run.cmd_evaluate),
    "card": Command(
        "regenerate the README.md model card of a map folder",
        "Render README.md and the chart from the map's config.json.",
        "peft-kvcache card maps/coder-up --repo-id my-org/coder-up-kvmap",
        card_arguments, run.cmd_card),
    "inspect": Command(
        "summarize a map: pair, layers, R², data, figures",
        "Load and validate a map (folder or Hub repo) and say what it maps, how well and on what data.",
        "peft-kvcache inspect my-org/coder-up-kvmap --json",
        inspect_arguments, run.cmd_inspect),
    "push": Command(
        "upload a map folder to a Hub repo",
        "Validate a local map and upload it to a Hub model repo, creating the repo (and branch) if needed. "
        "Authentication: `hf auth login`, HF_TOKEN or --token.",
        "peft-kvcache push maps/coder-up my-org/coder-up-kvmap --private",
        push_arguments, run.cmd_push),
    "serve": Command(
        "serve an OpenAI-compatible chat API over a base model and its adapters",
        "Chat completions for the base model and each adapter, with one prefix cache shared across adapters: "
        "a switch maps the base cache of the history instead of prefilling it (see peft_kvcache.serving.app).",
        "peft-kvcache serve --model gguf:smollm2-135m-instruct --adapter shout=adapters/shout --maps hub_cards",
        serve.add_arguments, _serve),
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


__all__ = ["CLIUsageError", "PROG", "build_parser", "main"]
