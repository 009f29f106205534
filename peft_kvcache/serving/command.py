"""``peft-kvcache serve``: its options, the ``serve`` extra and the port, checked before any model loads, and what it
loads: the base model, its adapters and their maps (published map folders or Hub repos, each map chosen by what it
fits: the fingerprints of the weights on both sides, the KV layout and the rotary parameters, never by a folder
name; calibrated at startup only with ``--calibrate-missing``), then the app of `peft_kvcache.serving.app` under
uvicorn. A server with adapters it cannot map says so at startup, and a bind beyond the loopback without
``--api-key`` is warned about loudly.

Example:
    $ peft-kvcache serve --model gguf:smollm2-135m-instruct --adapter shout=adapters/shout \\
          --adapter docstring=adapters/docstring --maps hub_cards --port 8000
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .._files import is_repo_id
from ..errors import PeftKVCacheError, ServerError
from ..maps.adapter_maps import AdapterMaps
from ..maps.kvmap import CONFIG_NAME, KVMap, is_map_folder, resolve_map_folder
from ..modeling.adapters import adapter_active, is_activated_lora, load_adapters, parse_adapter_specs
from ..modeling.identity import base_name, cached_fingerprint
from ..modeling.layout import KVLayout
from ..runtime.sessions import KEEP_BASE, SharedPeftModel
from .prefix_store import DEFAULT_MIN_MAPPED_TOKENS, REUSE_MODES, PrefixEngine, PrefixStore

logger = logging.getLogger(__name__)

SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client")  # the modules of the ``serve`` extra the app imports
CALIBRATION_FILES = 16  # stdlib files (first 512 tokens each) --calibrate-missing fits on: a fraction of the
# published maps' 128, to keep startup short
# The app's defaults, repeated here so that the options (and --help) need none of the serve extra's modules.
MAX_BODY_BYTES, MAX_QUEUE, READ_TIMEOUT, DRAIN_TIMEOUT = 8 * 2**20, 32, 30.0, 5.0
API_KEY_ENV = "PEFT_KVCACHE_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``peft-kvcache serve``."""
    add = p.add_argument
    add("--model", required=True, metavar="MODEL", help="the base model: Hub id, folder or fixture name")
    add("--adapter", required=True, action="append", metavar="NAME=PATH",
        help="a PEFT adapter (folder or Hub id) and the model name clients use for it (repeat for several)")
    add("--maps", action="append", default=[], metavar="DIR|REPO",
        help="a folder of published maps (e.g. hub_cards), one map folder or a Hub repo id of one map (repeat for "
             "several); each map is used for what it fits: the fingerprints of the base model and of an adapter, "
             "the KV layout and the rotary parameters, whatever its folder is named")
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
    add("--min-mapped-tokens", type=int, default=DEFAULT_MIN_MAPPED_TOKENS, metavar="N", help="map a prefix (or "
        "reuse a cache derived from a mapped one) only where it saves at least N tokens of prefill over the longest "
        "exact prefix; shorter ones, such as a chat template's system prompt, are prefilled exactly. The default is "
        "the smallest prefix whose mapped switch took at most half the time to first token of prefilling it "
        "(SmolLM2-135M, benchmarks/map_threshold.py -> benchmarks/results/map-threshold.md) (default: %(default)s)")
    add("--served-model-name", default=None, metavar="NAME", help="the base model's name in the API (default: "
        "its name or path)")
    add("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY", help="the key clients must send as "
        f"OpenAI's 'Authorization: Bearer KEY' header (401 otherwise; /health and the chat page stay open) "
        f"(default: ${API_KEY_ENV}, else none)")
    add("--max-body-bytes", type=int, default=MAX_BODY_BYTES, metavar="N", help="largest request body accepted; a "
        "larger one gets 413 (default: %(default)s)")
    add("--max-queue", type=int, default=MAX_QUEUE, metavar="N", help="requests that may wait for the model; more "
        "get 429 with Retry-After (default: %(default)s)")
    add("--read-timeout", type=float, default=READ_TIMEOUT, metavar="SECONDS", help="seconds a client may take to "
        "send a request's headers, and then its body; a slower one is disconnected (408 for a body) (default: "
        "%(default)s)")
    add("--drain-timeout", type=float, default=DRAIN_TIMEOUT, metavar="SECONDS", help="at shutdown (SIGTERM), "
        "seconds the running request may go on before it is cut; waiting requests get 503 at once (default: "
        "%(default)s)")
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
    calibrate_missing: bool = False
    calibration_files: int = CALIBRATION_FILES
    cache_bytes: int = 2 * 2**30
    max_tokens: int = 512
    reuse: str = "map"
    keep_base: str = "prefill"
    served_model_name: str | None = None
    dtype: str = "float32"
    min_mapped_tokens: int = DEFAULT_MIN_MAPPED_TOKENS
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    max_queue: int = MAX_QUEUE
    read_timeout: float = READ_TIMEOUT
    drain_timeout: float = DRAIN_TIMEOUT

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
        for flag, value, least in (("--min-mapped-tokens", args.min_mapped_tokens, 0),
                                   ("--max-body-bytes", args.max_body_bytes, 1024), ("--max-queue", args.max_queue, 0)):
            if value < least:
                raise ServerError(f"{flag} must be at least {least}, got {value}")
        for flag, value in (("--read-timeout", args.read_timeout), ("--drain-timeout", args.drain_timeout)):
            if not 0 <= value < 86400 or (flag == "--read-timeout" and value == 0):
                raise ServerError(f"{flag} must be a number of seconds ({'> 0' if flag == '--read-timeout' else '>= 0'}"
                                  f", under a day), got {value}")
        if args.api_key is not None and not args.api_key.strip():
            raise ServerError("--api-key is empty")
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
        return cls(args.model, adapters, list(args.maps), args.calibrate_missing, args.calibration_files,
                   int(args.cache_memory * 2**30), args.max_tokens, args.prefix_reuse, args.keep_base,
                   args.served_model_name, args.dtype, args.min_mapped_tokens, args.api_key, args.max_body_bytes,
                   args.max_queue, args.read_timeout, args.drain_timeout)

    def limits(self) -> dict:
        """The app's limits (`create_app`'s keyword arguments)."""
        return {"max_body_bytes": self.max_body_bytes, "max_queue": self.max_queue,
                "read_timeout": self.read_timeout, "drain_timeout": self.drain_timeout}


def load_maps(model, adapters: Sequence[str], specs: Sequence[str],
              ) -> tuple[AdapterMaps, dict[tuple[str, bool], str], dict[str, str]]:
    """The maps ``specs`` hold for ``adapters`` of ``model``, chosen by what they fit: a map goes base -> adapter
    (or adapter -> base) when its fingerprints are those of the base model and of the base with that adapter
    active, and it is used when its KV layout and rotary parameters are the model's too (`KVMap.check_models`);
    folder names play no part. A folder of map folders gives every map that fits (the others, fitted for other
    models, are passed over); one map folder or Hub repo must fit (`ServerError` otherwise). Returns ``(maps,
    where each came from, {folder: why a map fitted for these weights cannot be used})``."""
    prints = _fingerprints(model, adapters)
    directions = {}
    for adapter in adapters:
        directions[prints[None], prints[adapter]] = (adapter, False)
        directions[prints[adapter], prints[None]] = (adapter, True)
    maps, found, unusable = AdapterMaps(), {}, {}
    for spec in specs:
        path = Path(spec).expanduser()
        if path.is_dir() and not is_map_folder(path):  # a folder of map folders
            candidates = [folder for folder in sorted(path.iterdir()) if is_map_folder(folder)]
            one = False
        else:
            try:
                candidates, one = [resolve_map_folder(spec)], True
            except (PeftKVCacheError, OSError) as err:
                raise ServerError(f"--maps {spec!r} cannot be loaded: {err}") from None
        for folder in candidates:
            where = spec if one else str(folder)
            try:
                config = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
                fitted = (config.get("source_fingerprint"), config.get("target_fingerprint"))
            except (OSError, ValueError, AttributeError) as err:
                if one:
                    raise ServerError(f"--maps {spec!r} cannot be loaded: {err}") from None
                continue
            if fitted not in directions:
                if one:
                    raise ServerError(f"--maps {spec!r} is not a map between this base model and one of the adapters "
                                      f"{list(adapters)}: it was fitted for {config.get('source_name')!r} -> "
                                      f"{config.get('target_name')!r} (other weights)")
                logger.debug("map folder %s fits other models: not used", folder)
                continue
            adapter, reverse = directions[fitted]
            if (adapter, reverse) in found:
                logger.info("map folder %s fits %s too; %s is used", folder, adapter, found[adapter, reverse])
                continue
            try:
                kv_map = KVMap.from_pretrained(folder)
                _check_map(model, kv_map, adapter, reverse)
            except (PeftKVCacheError, OSError) as err:
                unusable[where] = f"{where}: {err}"
                continue
            (maps.to_base if reverse else maps.to_adapter)[adapter] = kv_map
            found[(adapter, reverse)] = where
    return maps, found, unusable


def _fingerprints(model, adapters: Sequence[str]) -> dict[str | None, str]:
    """The fingerprint of the base model (key None) and of the base with each adapter active."""
    prints = {}
    for adapter in [None, *adapters]:
        with adapter_active(model, adapter):
            prints[adapter] = cached_fingerprint(model)
    return prints


def _check_map(model, kv_map: KVMap, adapter: str, reverse: bool) -> None:
    """Refuse (`PeftKVCacheError`) a map whose fingerprints fit but whose layout or rotary parameters are not this
    model's: the target side is checked with its adapter active, and an adapter keeps the base's layout and rotary."""
    layout, config = KVLayout.of(model), kv_map.config
    if not config.source_layout == config.target_layout == layout:
        raise ServerError(f"it maps KV layout {config.source_layout} -> {config.target_layout}, the model has {layout}")
    with adapter_active(model, None if reverse else adapter):
        kv_map.check_models(None, model)


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

    base, tokenizer = load_model(options.model, dtype=getattr(torch, options.dtype))  # a ModelLoadError names it
    model = load_adapters(base, options.adapters)
    maps, found, unusable = load_maps(model, list(options.adapters), options.maps)
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
    unmapped = [a for a in options.adapters if a not in maps.to_adapter and not is_activated_lora(model, a)]
    if unmapped and options.reuse == "map":
        searched = ", ".join(options.maps) or "no --maps given"
        warning = (f"WARNING: no usable map for adapters {unmapped} ({searched}): a switch to them prefills the whole "
                   "history. Maps are chosen by the fingerprints of the weights they were fitted for; publish or "
                   "calibrate maps for these weights, or pass --calibrate-missing")
        logger.warning(warning)
        lines.append(warning)
    engine = PrefixEngine(SharedPeftModel(model, maps), PrefixStore(options.cache_bytes), options.reuse,
                          options.keep_base, options.min_mapped_tokens)
    lines.append(f"prefix store: {options.cache_bytes / 2**30:.2f} GiB, reuse={options.reuse}, "
                 f"keep_base={options.keep_base}, min_mapped_tokens={options.min_mapped_tokens}")
    return engine, tokenizer, name, lines


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    """``peft-kvcache serve``: check that the serve extra is installed, the options and the port (held from then
    on), load, say which maps are used, then serve until interrupted (SIGTERM drains: `app.uvicorn_server`)."""
    check_serve_extra()
    from .app import bind, create_app, uvicorn_server

    options = ServeOptions.from_args(args)
    if not is_loopback(args.host) and not options.api_key:
        print(f"WARNING: serving on {args.host}, beyond the loopback, without --api-key: anyone who can reach port "
              f"{args.port} can use the model. Pass --api-key KEY (or set ${API_KEY_ENV}) so that clients must send "
              "it as OpenAI's bearer key.", file=sys.stderr, flush=True)
    try:
        sock = bind(args.host, args.port)
    except OSError as err:
        raise ServerError(f"--host {args.host} --port {args.port} cannot be bound: {err.strerror or err} (another "
                          "server there? choose another --port); nothing was loaded") from None
    try:
        engine, tokenizer, name, lines = build(options)
        app = create_app(engine, tokenizer, name, options.max_tokens, api_key=options.api_key, **options.limits())
        url = f"http://{args.host}:{args.port}"
        for line in lines + [f"OpenAI base_url: {url}/v1 (chat page: {url}/)" +
                             ("; clients send --api-key as their api_key" if options.api_key else "")]:
            print(line, file=sys.stderr, flush=True)
        uvicorn_server(app, args.host, args.port).run(sockets=[sock])
    finally:
        sock.close()
    return 0


__all__ = ["ServeOptions", "add_arguments", "build", "calibrate_missing", "check_serve_extra", "is_loopback",
           "load_maps", "missing_serve_modules", "run"]
