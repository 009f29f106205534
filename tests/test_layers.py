"""The package's import graph: no cycles, and every import goes down the floors of `FLOORS` (README, "Layout");
the artifact and the runtime import no calibration, and only the model-running modules run models."""

from __future__ import annotations

import ast
from pathlib import Path

import peft_kvcache

PACKAGE = Path(peft_kvcache.__file__).parent
# Each module's floor: a module may import only modules on lower floors.
FLOORS = {
    "errors": 0, "_files": 0, "_compat": 0, "_version": 0, "_records": 0.5,
    "positions": 1, "fit": 1, "corpus": 1, "provenance": 1, "fixtures": 1,
    "models": 2, "checkpoint": 2,
    "config": 3, "capture": 3, "apply": 3,
    "card": 4,
    "kvmap": 5, "refresh": 5,
    "cache": 6, "adapter_maps": 6,
    "quality": 7, "sessions": 7,
    "evaluate": 8, "calibrate": 8, "prefix_store": 8, "openai_api": 8,
    "blend": 9, "nonlinear": 9, "server": 9,
    "serve": 10,  # the serve command: may calibrate missing maps at startup (--calibrate-missing)
    "cli": 11, "__init__": 12, "__main__": 13,
}
RUNTIME = {"apply", "kvmap", "refresh", "cache", "adapter_maps", "sessions", "prefix_store", "openai_api", "server"}
CALIBRATION = {"calibrate", "checkpoint", "fit", "blend", "nonlinear", "evaluate"}
MODEL_RUNNING = {"capture", "refresh", "cache", "quality", "sessions", "evaluate", "calibrate", "blend", "nonlinear",
                 "prefix_store"}


def imports_of(module: str) -> set[str]:
    """Package modules imported anywhere in ``module`` (top level and inside functions)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.update([node.module] if node.module else [alias.name for alias in node.names])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("peft_kvcache"):
            found.add((node.module or "").removeprefix("peft_kvcache").lstrip(".") or "__init__")
    return {name.split(".")[0] for name in found}


def test_every_module_has_a_floor():
    assert {p.stem for p in PACKAGE.glob("*.py")} == set(FLOORS)


def test_imports_only_go_down():
    upward = [(module, name) for module in FLOORS for name in imports_of(module)
              if name not in FLOORS or FLOORS[name] >= FLOORS[module]]
    assert upward == []


def test_the_artifact_knows_no_calibration_and_runs_no_model():
    assert imports_of("kvmap") & (CALIBRATION | MODEL_RUNNING) == set()
    assert imports_of("card") & {"kvmap"} == set()  # the card renders from the config alone


def test_runtime_modules_import_no_calibration():
    offenders = {module: imports_of(module) & CALIBRATION for module in RUNTIME}
    assert {m: names for m, names in offenders.items() if names} == {}


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The rule above would catch a cycle: positions importing cache is refused."""
    fake = tmp_path / "positions.py"
    fake.write_text("from .cache import MappedCache\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path)
    assert imports_of("positions") == {"cache"}
    assert FLOORS["cache"] >= FLOORS["positions"]
