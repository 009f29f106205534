"""The package's shape, as rules over its import graph (README, "Layout"):

1. Packages sit on floors; a module imports only its own package or lower floors (at module level or inside a
   function), but for the two ``calibrate`` classmethods of the artifact, which import calibration when called.
2. Inside a package the imports form no cycle.
3. What a module pulls in when it is imported, directly or through other modules: the artifact (`maps`) reaches
   no calibration, runtime, serving or `lab` code and runs no model; the runtime reaches no calibration, serving or
   `lab` code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import peft_kvcache

PACKAGE = Path(peft_kvcache.__file__).parent
FOUNDATION = {"errors", "_version", "_files", "_cpu"}
FLOORS = {**dict.fromkeys(FOUNDATION, 0), "_allocator": 1, "lab": 1, "modeling": 2, "maps": 3, "runtime": 4, "calibration": 5,
          "serving": 6, "vllm": 6, "cli": 7, "__init__": 8, "__main__": 9}
# (module, package it may import only inside a function): KVMap.calibrate and AdapterMaps.calibrate
CALLED_UPWARD = {("maps.kvmap", "calibration"), ("maps.adapter_maps", "calibration")}


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name (under the package) -> file of every module."""
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1]) if parts[-1] == "__init__" and len(parts) > 1 else ".".join(parts)] = path
    return found


def package_of(module: str) -> str:
    return module.split(".")[0]


def imports_of(module: str, root: Path = PACKAGE, top_level_only: bool = False) -> set[str]:
    """Package modules ``module`` imports (dotted, under the package), anywhere in it or only at module level."""
    path, known = modules(root)[module], modules(root)
    is_package = path.name == "__init__.py"
    base = [] if module == "__init__" else module.split(".") if is_package else module.split(".")[:-1]
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # imports under `if TYPE_CHECKING:` serve annotations only and never run
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = []
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            anchor = base[: len(base) - node.level + 1]
            target = ".".join(anchor + ([node.module] if node.module else []))
        elif (node.module or "").split(".")[0] == "peft_kvcache":
            target = node.module.removeprefix("peft_kvcache").lstrip(".")
        else:
            continue
        for alias in node.names:  # "from .maps import kvmap" imports the module maps.kvmap
            child = f"{target}.{alias.name}" if target else alias.name
            found.add(child if child in known else target or "__init__")
    return {name for name in found if name != module}


def closure(module: str, root: Path = PACKAGE) -> set[str]:
    """Every package module importing ``module`` loads (module-level imports, followed transitively)."""
    seen, todo = set(), [module]
    while todo:
        for name in imports_of(todo.pop(), root, top_level_only=True):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def test_every_module_sits_in_a_known_package():
    assert {package_of(m) for m in modules()} <= set(FLOORS)


def test_imports_go_to_lower_floors_or_stay_in_their_package():
    upward = []
    for module in modules():
        for name in imports_of(module):
            mine, theirs = package_of(module), package_of(name)
            if mine == theirs or FLOORS[theirs] < FLOORS[mine] or (module, theirs) in CALLED_UPWARD:
                continue
            upward.append((module, name))
    assert upward == []


def test_the_calibrate_classmethods_import_calibration_only_when_called():
    for module, package in CALLED_UPWARD:
        assert not any(package_of(n) == package for n in imports_of(module, top_level_only=True)), module


def test_no_cycle_inside_a_package():
    graph = {m: {n for n in imports_of(m) if package_of(n) == package_of(m)} for m in modules()}

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen)) for n in graph[start])

    assert [m for m in graph if reaches(m, m, set())] == []


@pytest.mark.parametrize("package, forbidden", [
    ("maps", {"calibration", "runtime", "serving", "vllm", "lab", "cli"}),
    ("runtime", {"calibration", "serving", "vllm", "lab", "cli"}),
    ("vllm", {"calibration", "serving", "lab", "cli"}),  # the wings stand on the runtime's reuse core
    ("serving", {"vllm", "cli"}),  # and never reach each other
])
def test_what_the_artifact_and_the_runtime_load(package, forbidden):
    reached = {m: {n for n in closure(m) if package_of(n) in forbidden} for m in modules() if package_of(m) == package}
    assert {m: names for m, names in reached.items() if names} == {}


# Where a map's fingerprints may be read: the registry matches maps to models; the config and the artifact declare
# and check them; storage tells a map's folder by them; the card shows them; calibration writes them.
FINGERPRINT_READERS = {"maps.registry", "maps.config", "maps.kvmap", "maps.storage", "maps.card", "calibration.loop"}


def test_the_registry_is_the_only_place_that_matches_maps_to_models():
    readers = {m for m, path in modules().items()
               if "source_fingerprint" in path.read_text() or "target_fingerprint" in path.read_text()}
    assert readers <= FINGERPRINT_READERS
    matchers = {m for m, path in modules().items() if "same_rotary(" in path.read_text() and m != "modeling.positions"}
    assert matchers <= {"maps.registry", "maps.kvmap"}  # the one tolerance: find a map, or check one given


def test_the_artifact_runs_no_model():
    assert {m for m in modules() if package_of(m) == "maps" and "modeling.capture" in closure(m)} == set()


def test_the_rules_see_an_indirect_import(tmp_path):
    """A runtime module that reaches lab through a map module (as kvmap -> config -> fit once reached calibration
    through a constant) is caught by the closure rule, and the floor rule names the upward step."""
    for name, text in {"runtime/cache.py": "from ..maps.config import X\n", "maps/config.py": "from ..lab.corpus import Y\n",
                       "lab/corpus.py": "Y = 1\n", "runtime/__init__.py": "", "maps/__init__.py": "",
                       "lab/__init__.py": ""}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert closure("runtime.cache", tmp_path) == {"maps.config", "lab.corpus"}
    assert imports_of("runtime.cache", tmp_path) == {"maps.config"}
