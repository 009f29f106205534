"""Where a figure comes from: every results file records the commit (and whether the tree was dirty), the exact
command line, the date, the machine (and the CPU features its kernels depend on), the torch threads, the library
versions, the seeds and the data."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from .._cpu import speed_flags
from .._files import atomic_write

PACKAGES = ("torch", "transformers", "peft", "huggingface_hub", "accelerate", "safetensors", "peft-kvcache")


def _git(*args: str, cwd: Path) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo), recorded with every measurement."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


_CODE_STATES: dict[Path, dict] = {}


CODE_PATHS = ("--", ":(top)", ":(top,exclude)benchmarks/results")  # results being written are data, not code


def code_state(cwd: str | os.PathLike | None = None) -> dict:
    """``{"commit", "dirty"}`` of the code this process runs, read from git once per folder, the first time it is
    asked: a long run that calls this at startup records the code it started with, not a commit made while it
    ran (``dirty`` ignores untracked files and results files, e.g. results being written). A dirty tree adds
    ``changes``: the diff of its code against the commit, so that the record still pins the code that ran."""
    root = Path(cwd or os.getcwd()).resolve()
    if root not in _CODE_STATES:
        status = _git("status", "--porcelain", "--untracked-files=no", *CODE_PATHS, cwd=root)
        state = {"commit": _git("rev-parse", "HEAD", cwd=root), "dirty": None if status is None else bool(status)}
        if status:
            state["changes"] = _git("diff", "HEAD", *CODE_PATHS, cwd=root)
        _CODE_STATES[root] = state
    return _CODE_STATES[root]


def command_line() -> str:
    """The command that started this process, as one would type it again: ``python -m package.module ...`` for a
    module run with ``-m`` (whose ``sys.argv[0]`` is the module's file path)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["-m", spec.name.removesuffix(".__main__")] if spec is not None and spec.name else sys.argv[:1]
    return shlex.join([Path(sys.executable).name, *head, *sys.argv[1:]])


def provenance(seeds: dict[str, int] | None = None, data: Any = None, cwd: str | os.PathLike | None = None) -> dict:
    """The provenance block of a results file, for the current process (the code as `code_state` first saw it).

    Example:
        >>> {"command", "commit", "cpu", "torch_threads", "versions"} <= set(provenance())
        True
    """
    import torch

    return {
        **code_state(cwd),
        "command": command_line(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_features": speed_flags(),  # one model name may run other kernels
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in PACKAGES},
        "seeds": seeds or {},
        "data": data,
    }


def write_results(path: str | os.PathLike, payload: dict, markdown: str | None = None, **provenance_kwargs) -> Path:
    """Write ``payload`` with its ``provenance`` as JSON to ``path`` (and ``markdown`` beside it as ``.md``),
    each file replaced atomically. Returns the JSON path."""
    path = Path(path).with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"provenance": provenance(**provenance_kwargs), **payload}
    text = json.dumps(record, indent=2, default=_jsonable) + "\n"
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    if markdown is not None:
        atomic_write(path.with_suffix(".md"), lambda tmp: Path(tmp).write_text(markdown.rstrip() + "\n"))
    return path


def _jsonable(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    from dataclasses import asdict, is_dataclass

    if is_dataclass(value):
        return asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def key_of(*parts: str) -> str:
    """The `lookup` key of ``parts``, each escaped as in a JSON pointer (``~`` as ``~0``, ``/`` as ``~1``), so a
    name holding a slash (a recipe such as ``index@160/p40``) is one part.

    Example:
        >>> key_of("rows", "index@160/p40", "normalized")
        'rows/index@160~1p40/normalized'
    """
    return "/".join(str(part).replace("~", "~0").replace("/", "~1") for part in parts)


def lookup(data, key: str):
    """The value at ``key`` in results ``data``: ``/``-separated keys and list indices, where ``name=value`` picks
    the list entry whose ``name`` is ``value`` (e.g. ``results/continuation/rows/variant=mapped@1/kl``); a part's
    ``~1`` and ``~0`` stand for ``/`` and ``~`` (`key_of`).

    Example:
        >>> lookup({"rows": [{"variant": "full", "kl": 0.0}, {"variant": "mapped@1", "kl": 0.3}]}, "rows/variant=mapped@1/kl")
        0.3
        >>> lookup({"rows": {"index@160/p40": 0.7}}, "rows/index@160~1p40")
        0.7
    """
    for escaped in key.split("/"):
        part = escaped.replace("~1", "/").replace("~0", "~")
        if isinstance(data, list):
            if "=" in part:
                name, _, wanted = part.partition("=")
                data = next(entry for entry in data if str(entry.get(name)) == wanted)
            else:
                data = data[int(part)]
        else:
            data = data[part]
    return data
