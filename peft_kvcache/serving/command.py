"""``peft-kvcache serve``: its options and the ``serve`` extra, checked before any model loads, and what it loads: the base model, its
adapters and their maps (published map folders or Hub repos; calibrated at startup only with
``--calibrate-missing``), then the app of `peft_kvcache.serving.app` under uvicorn.

Example:
    $ peft-kvcache serve --model gguf:smollm2-135m-instruct --adapter shout=adapters/shout \\
          --adapter docstring=adapters/docstring --maps hub_cards --port 8000
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .._files import is_repo_id
from ..errors import PeftKVCacheError, ServerError
from ..maps.adapter_maps import AdapterMaps, default_prefix, folder_name
from ..maps.kvmap import KVMap, is_map_folder, resolve_map_folder
from ..modeling.adapters import adapter_active, load_adapters, parse_adapter_specs
from ..modeling.identity import base_name, cached_fingerprint
from ..runtime.sessions import KEEP_BASE, SharedPeftModel
from .prefix_store import REUSE_MODES, PrefixEngine, PrefixStore

logger = logging.getLogger(__name__)

SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client")  # the modules of the ``serve`` extra the app imports
CALIBRATION_FILES = 16  # stdlib files (first 512 tokens each) --calibrate-missing fits on: a fraction of the
# published maps' 128, to keep startup short


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``peft-kvcache serve``."""
    add = p.add_argument
    add("--model", required=True, metavar="MODEL", help="the base model: Hub id, folder or fixture name")
    add("--adapter", required=True, action="append", metavar="NAME=PATH",
        help="a PEFT adapter (folder or Hub id) and the model name clients use for it (repeat for several)")
    add("--maps", action="append", default=[], metavar="DIR|REPO",
        help="a folder of published maps (<prefix>-base-to-<adapter>, <prefix>-<adapter>-to-base), one map folder "
             "or a Hub repo id of one map (repeat for several)")
    add("--map-prefix", default=None, metavar="PREFIX", help="name prefix of the map folders (default: the model's "
        "name, e.g. smollm2-135m-instruct)")
    add("--calibrate-missing", action="store_true", help="fit the maps of adapters --maps has none for (or none "
        "that loads) at startup, on --calibration-files stdlib files; without it such adapters are served without "
        "mapping (exact prefix reuse only)")
    add("--calibration-files", type=int, default=CALIBRATION_FILES, metavar="N", help="stdlib files (first 512 "
        "tokens each) --calibrate-missing fits on (default: %(default)s)")
    add("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    add("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    add("--cache-memory", type=float, default=2.0, metavar="GIB", help="bound of the prefix store in GiB, least "
        "recently used caches evicted first (default: %(default)s)")
    add("--max-tokens", type=int, default=512, metavar="N", help="reply length when a request sets no max_tokens "
        "(default: %(default)s)")
    add("--prefix-reuse", choices=REUSE_MODES, default="map", help="map: reuse caches exactly and map the base "
        "cache into an adapter on a switch (default); exact: reuse only caches of the same adapter (what vLLM and "
        "SGLang do); none: prefill every prompt. For comparisons")
    add("--keep-base", choices=KEEP_BASE, default="prefill", help="how the base cache of a "
        "conversation catches up after an adapter's reply: prefill (a base pass over the new tokens, after the reply "
        "is sent: base replies stay exact) or reverse_map (no pass; base replies then run on mapped-back caches, "
        "good with the published maps) (default: %(default)s)")
    add("--served-model-name", default=None, metavar="NAME", help="the base model's name in the API (default: "
        "its name or path)")
    add("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="dtype the model is loaded in "
        "(default: %(default)s)")


def missing_serve_modules() -> list[str]:
    """The modules of the ``serve`` extra that cannot be imported here (found without importing them)."""
    missing = []
    for name in SERVE_EXTRA:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a finder that refuses it, or a module entry without a spec
            found = False
        if not found:
            missing.append(name)
    return missing


def check_serve_extra() -> None:
    """Refuse to start (a `ServerError` naming the extra to install) where the ``serve`` extra is missing."""
    missing = missing_serve_modules()
    if missing:
        raise ServerError(f"serve needs the serve extra, which is not installed ({', '.join(missing)} missing): "
                          'pip install "peft-kvcache[serve]"')


@dataclass
class ServeOptions:
    """The checked options of ``serve``."""

    model: str
    adapters: dict[str, str]
    maps: list[str] = field(default_factory=list)
    map_prefix: str | None = None
    calibrate_missing: bool = False
    calibration_files: int = CALIBRATION_FILES
    cache_bytes: int = 2 * 2**30
    max_tokens: int = 512
    reuse: str = "map"
    keep_base: str = "prefill"
    served_model_name: str | None = None
    dtype: str = "float32"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServeOptions":
        """Check the options (a `ServerError` naming the flag) before anything loads."""
        if not 0 < args.cache_memory < 2**20:
            raise ServerError(f"--cache-memory must be a positive number of GiB, got {args.cache_memory}")
        if not 0 < args.port < 65536:
            raise ServerError(f"--port must be in 1..65535, got {args.port}")
        if args.max_tokens < 1:
            raise ServerError(f"--max-tokens must be at least 1, got {args.max_tokens}")
        if args.calibration_files < 2:
            raise ServerError(f"--calibration-files must be at least 2 (one is held out), got {args.calibration_files}")
        if args.calibrate_missing:
            from ..lab.corpus import stdlib_files

            available = len(stdlib_files("calibration"))
            if args.calibration_files > available:
                raise ServerError(f"--calibration-files {args.calibration_files}: the stdlib calibration split has "
                                  f"{available} files")
        for spec in args.maps:
            if not Path(spec).expanduser().exists() and not is_repo_id(spec):
                raise ServerError(f"--maps {spec!r} is neither a folder nor a Hub repo id")
        adapters = parse_adapter_specs(args.adapter)
        if args.served_model_name in adapters or ":" in (args.served_model_name or ""):
            raise ServerError(f"--served-model-name {args.served_model_name!r} collides with an adapter name or "
                              "holds ':' (the base:adapter separator)")
        return cls(args.model, adapters, list(args.maps), args.map_prefix, args.calibrate_missing,
                   args.calibration_files, int(args.cache_memory * 2**30), args.max_tokens, args.prefix_reuse,
                   args.keep_base, args.served_model_name, args.dtype)


def load_maps(model, adapters: Sequence[str], specs: Sequence[str], prefix: str,
              ) -> tuple[AdapterMaps, dict[tuple[str, bool], str], dict[str, str]]:
    """The maps ``specs`` hold for ``adapters``, each checked against the model: ``(maps, where each came from,
    {folder: why its map could not be used})``. A map fitted for other weights raises `ServerError`."""
    maps, found, unusable = AdapterMaps(), {}, {}
    for spec in specs:
        path = Path(spec).expanduser()
        if path.is_dir() and not is_map_folder(path):  # a folder of map folders, named by adapter
            candidates = [(path / folder_name(prefix, a, r), a, r) for a in adapters for r in (False, True)]
            candidates = [(str(folder), a, r) for folder, a, r in candidates if folder.is_dir()]
        else:
            candidates = [(spec, None, None)]
        for where, adapter, reverse in candidates:
            try:
                kv_map = KVMap.from_pretrained(resolve_map_folder(where))
            except (PeftKVCacheError, OSError) as err:
                if adapter is None:
                    raise ServerError(f"--maps {spec!r} cannot be loaded: {err}") from None
                unusable[where] = f"{where}: {err}"
                continue
            adapter, reverse = _direction(kv_map, adapter, reverse, adapters, where)
            _check_map(model, kv_map, adapter, reverse, where)
            (maps.to_base if reverse else maps.to_adapter)[adapter] = kv_map
            found[(adapter, reverse)] = where
    return maps, found, unusable


def _direction(kv_map: KVMap, adapter, reverse, adapters: Sequence[str], where: str) -> tuple[str, bool]:
    """(adapter, reverse) of a map: from its folder name, else from the adapters its calibration record names."""
    if adapter is not None:
        return adapter, reverse
    record = kv_map.config.calibration
    source = record.source.adapter if record.source else None
    target = record.target.adapter if record.target else None
    if (source is None) == (target is None) or (source or target) not in adapters:
        raise ServerError(f"--maps {where!r} is not a map between the base model and one of the adapters "
                          f"{list(adapters)} (it maps {kv_map.config.source_name!r} -> {kv_map.config.target_name!r})")
    return (source, True) if source else (target, False)


def _check_map(model, kv_map: KVMap, adapter: str, reverse: bool, where: str) -> None:
    """Refuse, before serving, a map fitted for other weights than this base model and adapter."""
    with adapter_active(model, None):
        base = cached_fingerprint(model)
    with adapter_active(model, adapter):
        tuned = cached_fingerprint(model)
    expected = (tuned, base) if reverse else (base, tuned)
    config = kv_map.config
    if (config.source_fingerprint, config.target_fingerprint) != expected:
        raise ServerError(f"--maps {where!r} was fitted for {config.source_name!r} -> {config.target_name!r}, not for "
                          f"this model and adapter {adapter!r} ({'adapter -> base' if reverse else 'base -> adapter'})")


def calibrate_missing(model, tokenizer, adapters: Sequence[str], maps: AdapterMaps, files: int = CALIBRATION_FILES,
                      tokens: int = 512) -> AdapterMaps:
    """Fit the maps of ``adapters`` on the first ``tokens`` tokens of ``files`` calibration-split stdlib files and
    add each direction ``maps`` lacks (a direction it holds keeps its map)."""
    from ..calibration.loop import calibrate_adapters
    from ..lab.corpus import stdlib_texts

    fitted = calibrate_adapters(model, stdlib_texts("calibration", files), tokenizer, adapters=list(adapters),
                                progress=False, max_length=tokens, chunks_per_text=1,
                                description=f"first {tokens} tokens of {files} calibration-split stdlib files")
    for fitted_maps, kept in ((fitted.to_adapter, maps.to_adapter), (fitted.to_base, maps.to_base)):
        for adapter, kv_map in fitted_maps.items():
            kept.setdefault(adapter, kv_map)  # a direction that loaded keeps its published map
    return maps


def build(options: ServeOptions):
    """Load everything ``serve`` serves: ``(engine, tokenizer, model name, report lines)``."""
    import torch

    from ..lab.fixtures import load_model

    try:
        base, tokenizer = load_model(options.model, dtype=getattr(torch, options.dtype))
    except (OSError, ValueError) as err:
        raise ServerError(f"--model {options.model!r} cannot be loaded: {err}") from None
    try:
        model = load_adapters(base, options.adapters)
    except (OSError, ValueError, RuntimeError) as err:
        raise ServerError(f"--adapter cannot be loaded on {options.model}: {err}") from None
    prefix = options.map_prefix or default_prefix(options.model)
    maps, found, unusable = load_maps(model, list(options.adapters), options.maps, prefix)
    missing = [a for a in options.adapters if a not in maps.to_adapter or a not in maps.to_base]
    if unusable and not options.calibrate_missing:
        raise ServerError("maps that cannot be used: " + "; ".join(unusable.values()) +
                          " (pass --calibrate-missing to fit new ones at startup)")
    name = options.served_model_name or base_name(model)
    lines = [f"serving {name!r} and adapters {list(options.adapters)}"]
    if missing and options.calibrate_missing:
        lines.append(f"calibrated the maps of {missing} on {options.calibration_files} stdlib files (in memory, not "
                     "saved)" + "".join(f"; unusable: {why}" for why in unusable.values()))
        maps = calibrate_missing(model, tokenizer, missing, maps, options.calibration_files)
    for adapter in options.adapters:
        where = [f"{'reverse' if r else 'forward'} {found.get((adapter, r), 'calibrated at startup')}"
                 for r, store in ((False, maps.to_adapter), (True, maps.to_base)) if adapter in store]
        lines.append(f"  {adapter}: " + ("; ".join(where) if where else "no map: switches to it prefill the history "
                                         "(exact prefix reuse only; --calibrate-missing fits maps)"))
    engine = PrefixEngine(SharedPeftModel(model, maps), PrefixStore(options.cache_bytes), options.reuse,
                          options.keep_base)
    lines.append(f"prefix store: {options.cache_bytes / 2**30:.2f} GiB, reuse={options.reuse}, "
                 f"keep_base={options.keep_base}")
    return engine, tokenizer, name, lines


def run(args: argparse.Namespace) -> int:
    """``peft-kvcache serve``: check that the serve extra is installed and the options, load, say which maps are
    used, then serve until interrupted."""
    check_serve_extra()
    import uvicorn

    from .app import create_app

    options = ServeOptions.from_args(args)
    engine, tokenizer, name, lines = build(options)
    app = create_app(engine, tokenizer, name, options.max_tokens)
    for line in lines + [f"OpenAI base_url: http://{args.host}:{args.port}/v1 (chat page: http://{args.host}:{args.port}/)"]:
        print(line, file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


__all__ = ["ServeOptions", "add_arguments", "build", "calibrate_missing", "check_serve_extra", "load_maps",
           "missing_serve_modules", "run"]
