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
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .._files import is_repo_id
from ..errors import PeftKVCacheError
from ..maps.adapter_maps import MISSES, AdapterMaps
from ..maps.registry import NO_MAP, MapRegistry
from ..modeling.adapters import is_activated_lora, load_adapters
from ..modeling.identity import base_name
from .._allocator import keep_freed_memory
from ..runtime.turn import KEEP_BASE, SharedPeftModel
from .engine import DEFAULT_MIN_MAPPED_TOKENS, REUSE_MODES, PrefixEngine
from .errors import ServerError
from .limits import ServerLimits
from .store import PrefixStore

logger = logging.getLogger(__name__)

SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client")  # the modules of the ``serve`` extra the app imports
CALIBRATION_FILES = 16  # stdlib files (first 512 tokens each) --calibrate-missing fits on: a fraction of the
# published maps' 128, to keep startup short
LIMITS = ServerLimits()  # the app's defaults: the flags below take them from here
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
    add("--max-body-bytes", type=int, default=LIMITS.max_body_bytes, metavar="N", help="largest request body accepted; a "
        "larger one gets 413 (default: %(default)s)")
    add("--max-queue", type=int, default=LIMITS.max_queue, metavar="N", help="requests that may wait for the model; more "
        "get 429 with Retry-After (default: %(default)s)")
    add("--read-timeout", type=float, default=LIMITS.read_timeout, metavar="SECONDS", help="seconds a client may take to "
        "send a request's headers, and then its body; a slower one is disconnected (408 for a body) (default: "
        "%(default)s)")
    add("--drain-timeout", type=float, default=LIMITS.drain_timeout, metavar="SECONDS", help="at shutdown (SIGTERM), "
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
    limits: ServerLimits = field(default_factory=ServerLimits)

    @classmethod
    def from_args(cls, args: argparse.Namespace, adapters: dict[str, str]) -> "ServeOptions":
        """Check the options (a `ServerError` naming the flag) before anything loads; ``adapters``: the ``--adapter``
        specs, parsed by the command line."""
        if not 0 < args.cache_memory < 2**20:
            raise ServerError(f"--cache-memory must be a positive number of GiB, got {args.cache_memory}")
        if not 0 < args.port < 65536:
            raise ServerError(f"--port must be in 1..65535, got {args.port}")
        if args.max_tokens < 1:
            raise ServerError(f"--max-tokens must be at least 1, got {args.max_tokens}")
        if args.calibration_files < 2:
            raise ServerError(f"--calibration-files must be at least 2 (one is held out), got {args.calibration_files}")
        if args.min_mapped_tokens < 0:
            raise ServerError(f"--min-mapped-tokens must be at least 0, got {args.min_mapped_tokens}")
        try:
            limits = ServerLimits(args.max_body_bytes, args.max_queue, args.read_timeout, args.drain_timeout)
        except ServerError as err:  # the field named as its flag
            field_name, _, problem = str(err).partition(" ")
            raise ServerError(f"--{field_name.replace('_', '-')} {problem}") from None
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
        if args.served_model_name in adapters or ":" in (args.served_model_name or ""):
            raise ServerError(f"--served-model-name {args.served_model_name!r} collides with an adapter name or "
                              "holds ':' (the base:adapter separator)")
        return cls(args.model, adapters, list(args.maps), args.calibrate_missing, args.calibration_files,
                   int(args.cache_memory * 2**30), args.max_tokens, args.prefix_reuse, args.keep_base,
                   args.served_model_name, args.dtype, args.min_mapped_tokens, args.api_key, limits)


def find_maps(model, adapters: Sequence[str], specs: Sequence[str]) -> AdapterMaps:
    """The maps ``specs`` hold for ``adapters`` of ``model``, found by what they fit (`peft_kvcache.maps.registry`);
    folder names play no part. A folder of map folders gives every map that fits (the others, fitted for other
    models, are passed over); a spec naming one map folder or Hub repo must fit one direction (`ServerError`
    otherwise). ``missing[(adapter, reverse)]`` of the result says why a direction has no map."""
    try:
        registry = MapRegistry(specs)
    except PeftKVCacheError as err:
        raise ServerError(f"--maps: {err}") from None
    maps = AdapterMaps.from_pretrained(registry, model, adapters, missing_ok=True)
    for spec in registry.singles:
        if spec not in maps.found.values():
            config = next(c for folder, c in registry.configs.items() if registry.origin[folder] == spec)
            raise ServerError(f"--maps {spec!r} is not a usable map between this base model and one of the adapters "
                              f"{list(adapters)}: it was fitted for {config.source_name!r} -> {config.target_name!r}")
    return maps


def build(options: ServeOptions):
    """Load everything ``serve`` serves: ``(engine, tokenizer, model name, report lines)``."""
    import torch

    from ..modeling.fixtures import load_model

    # before the model's tensors: a switch's temporaries then reuse freed memory instead of faulting fresh pages in
    allocator = ("glibc malloc keeps freed blocks (switches without page faults)" if keep_freed_memory() else
                 "left as it is (not glibc, or another allocator preloaded)")
    base, tokenizer = load_model(options.model, dtype=getattr(torch, options.dtype))  # a ModelLoadError names it
    model = load_adapters(base, options.adapters)
    maps = find_maps(model, list(options.adapters), options.maps)
    found = maps.found
    unusable = {f"{a} ({'reverse' if r else 'forward'})": f"{a}: {MISSES[why]}" for (a, r), why in maps.missing.items()
                if why != NO_MAP}
    missing = [a for a in options.adapters if a not in maps.to_adapter or a not in maps.to_base]
    if unusable and not options.calibrate_missing:
        raise ServerError("maps that cannot be used: " + "; ".join(unusable.values()) +
                          " (pass --calibrate-missing to fit new ones at startup)")
    name = options.served_model_name or base_name(model)
    lines = [f"serving {name!r} and adapters {list(options.adapters)}", f"allocator: {allocator}"]
    if missing and options.calibrate_missing:
        lines.append(f"calibrated the maps of {missing} on {options.calibration_files} stdlib files (in memory, not "
                     "saved)" + "".join(f"; unusable: {why}" for why in unusable.values()))
        from ..calibration.loop import calibrate_missing

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


def run(args: argparse.Namespace, parse_adapters: Callable[[Sequence[str]], dict[str, str]]) -> int:
    """``peft-kvcache serve``: check that the serve extra is installed, the options (``parse_adapters``: the command
    line's parser of ``--adapter NAME=PATH``) and the port (held from then on), load, say which maps are used, then
    serve until interrupted (SIGTERM drains: `hosting.uvicorn_server`)."""
    check_serve_extra()
    from .app import create_app
    from .hosting import bind, uvicorn_server

    options = ServeOptions.from_args(args, parse_adapters(args.adapter))
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
        app = create_app(engine, tokenizer, name, options.max_tokens, api_key=options.api_key, limits=options.limits)
        url = f"http://{args.host}:{args.port}"
        for line in lines + [f"OpenAI base_url: {url}/v1 (chat page: {url}/)" +
                             ("; clients send --api-key as their api_key" if options.api_key else "")]:
            print(line, file=sys.stderr, flush=True)
        uvicorn_server(app, args.host, args.port).run(sockets=[sock])
    finally:
        sock.close()
    return 0


__all__ = ["ServeOptions", "add_arguments", "build", "check_serve_extra", "find_maps", "is_loopback",
           "missing_serve_modules", "run"]
