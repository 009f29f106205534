"""The command line's options: the flags each command declares (the calibration flags derived from
`CalibrationConfig`'s fields), the adapters given as ``NAME=PATH`` and the error a bad argument raises."""

from __future__ import annotations

import argparse
import re
import typing
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from .._files import is_repo_id
from ..errors import PeftKVCacheError
from ..maps.config import CalibrationConfig

ADAPTER_DEFAULTS = {"same_layer": True}  # calibrate-adapters' CalibrationConfig defaults (each layer from itself)
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # an adapter's name, as it names map folders


class CLIUsageError(PeftKVCacheError, ValueError):
    """An argument of the command line names something that cannot be used (a missing file, an empty corpus, a
    malformed ``NAME=PATH``)."""


def parse_adapter_specs(specs: Sequence[str]) -> dict[str, str]:
    """``{name: folder or Hub id}`` from ``--adapter NAME=PATH`` arguments, checked before any model loads (a
    `CLIUsageError` for a malformed, repeated or unusable one; names hold letters, digits, '_', '-' and '.' only).
    """
    adapters: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise CLIUsageError(f"--adapter {spec!r}: expected NAME=PATH (a folder saved by PEFT or a Hub repo id)")
        if name in adapters:
            raise CLIUsageError(f"--adapter {name!r} is given twice")
        if not ADAPTER_NAME.fullmatch(name):  # it names map folders, and clients write base:adapter
            raise CLIUsageError(f"--adapter {name!r}: a name holds letters, digits, '_', '-' and '.' only (it names "
                                "the map folders, and clients write base:adapter)")
        local = Path(path).expanduser()
        if local.exists() and not (local / "adapter_config.json").is_file():
            raise CLIUsageError(f"--adapter {spec!r}: {path} holds no adapter_config.json (not a PEFT adapter)")
        if not local.exists() and not is_repo_id(path):
            raise CLIUsageError(f"--adapter {spec!r}: {path} is neither a folder nor a Hub repo id")
        adapters[name] = str(local) if local.exists() else path
    return adapters


def map_argument(p: argparse.ArgumentParser, hub: bool) -> None:
    p.add_argument("map", metavar="MAP", help="local map folder" + (" or Hub repo id" if hub else ""))


def revision_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--revision", default=None, help="Hub revision of MAP (branch, tag or commit)")


def model_pair_options(p: argparse.ArgumentParser, required: bool, hint: str = "") -> None:
    p.add_argument("--source", required=required, metavar="MODEL",
                   help=f"source model: Hub id, folder or fixture name{hint}")
    p.add_argument("--target", required=required, metavar="MODEL", help=f"target model, same forms{hint}")


def data_options(p: argparse.ArgumentParser, split: str) -> None:
    """``--data`` and ``--num-files`` (read by `_texts`), then the models' ``--dtype`` and ``--no-progress``."""
    add = p.add_argument
    add("--data", default="stdlib", metavar="DATA", help="a text file, a folder of text files, or 'stdlib' (the "
        f"Python standard library corpus, {split} split; default: %(default)s)")
    add("--num-files", type=int, default=None, metavar="N", help="use the first N files of --data (default: 32 "
        "calibration / 20 evaluation files for stdlib, all for a folder)")
    add("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="dtype the models are "
        "loaded in (default: %(default)s)")
    add("--no-progress", action="store_true", help="no progress bars")


def calibration_options(p: argparse.ArgumentParser, **defaults) -> None:
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


def repo_id_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repo-id", default=None, help="Hub repo the card's usage snippet loads (default: the folder's name)")


def json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def calibrate_arguments(p: argparse.ArgumentParser) -> None:
    model_pair_options(p, required=True)
    data_options(p, "calibration")
    calibration_options(p)
    p.add_argument("--license", default=None, help="license for the card (default: the models' common one)")
    repo_id_option(p)


def calibrate_adapters_arguments(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--base", required=True, metavar="MODEL", help="the base model: Hub id, folder or fixture name")
    add("--adapter", required=True, action="append", metavar="NAME=PATH",
        help="a PEFT adapter folder and the name to give it (repeat for several adapters)")
    add("--prefix", default=None, help="name prefix of the map folders (default: the base model's name)")
    add("--no-reverse", action="store_true", help="only the base -> adapter maps")
    add("--blend-files", type=int, default=0, metavar="N", help="hold out the last N texts of --data to choose "
        "each map's blend toward its source cache (default: 0, no blend)")
    add("--choose-rank", type=int, nargs="+", default=None, metavar="R", help="also fit each map at these residual "
        "ranks (from the same statistics) and keep, per map, the smallest whose KL on the --blend-files texts cannot "
        "be told from the full correction's (peft_kvcache.calibration.rank); needs --blend-files")
    add("--repo-namespace", default=None, metavar="NS", help="Hub namespace the cards' snippets load from")
    data_options(p, "calibration")
    calibration_options(p, **ADAPTER_DEFAULTS)


def evaluate_arguments(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    map_argument(p, hub=True)
    revision_option(p)
    model_pair_options(p, required=False, hint=" (default: the one recorded)")
    data_options(p, "evaluation")
    repo_id_option(p)
    add("--context-length", type=int, default=256, metavar="C", help="context tokens (default: %(default)s)")
    add("--continuation-length", type=int, default=64, metavar="M", help="scored tokens (default: %(default)s)")
    add("--windows", type=int, nargs="+", default=[1], metavar="W",
        help="last W context tokens the target computes itself (default: 1)")
    add("--max-examples", type=int, default=None, metavar="N", help="score at most N examples")
    add("--write", action="store_true", help="record the figures in the map (local MAP only)")
    json_option(p)


def card_arguments(p: argparse.ArgumentParser) -> None:
    map_argument(p, hub=False)
    repo_id_option(p)
    p.add_argument("--license", default=None, help="set the license (recorded in config.json too)")


def inspect_arguments(p: argparse.ArgumentParser) -> None:
    map_argument(p, hub=True)
    revision_option(p)
    json_option(p)


def push_arguments(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    map_argument(p, hub=False)
    add("repo_id", metavar="REPO_ID", help="Hub repo id, e.g. my-org/model-a-to-model-b-kvmap")
    add("--private", action="store_true", help="create the repo as private")
    add("--revision", default=None, help="branch to push to (created if needed)")
    add("--token", default=None, help="Hub token (default: the stored login or HF_TOKEN)")
    add("--commit-message", default="Upload KV map", help="commit message (default: %(default)s)")
