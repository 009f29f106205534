"""The public surface: what the README and the examples import comes from the package root, the two calibrate
entry points are real classmethods of the artifacts, and importing the artifact loads no calibration code."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import random_ids, tiny_model

import peft_kvcache
from peft_kvcache import AdapterMaps, KVMap

ROOT = Path(__file__).resolve().parents[1]


def _imported_from_root(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "peft_kvcache":
            names.update(alias.name for alias in node.names)
    return names


def test_every_name_the_readme_and_examples_import_from_the_root_is_exported():
    readme_blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    used = set().union(*(_imported_from_root(block) for block in readme_blocks))
    used |= set().union(*(_imported_from_root(path.read_text()) for path in (ROOT / "examples").glob("*.py")))
    assert used and used <= set(peft_kvcache.__all__)
    assert all(hasattr(peft_kvcache, name) for name in peft_kvcache.__all__)


def test_the_root_exports_the_error_root_and_few_errors_the_rest_stay_in_errors():
    from peft_kvcache import errors

    exported = {n for n in peft_kvcache.__all__ if n.endswith("Error")}
    everything = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, errors.PeftKVCacheError)}
    assert "PeftKVCacheError" in exported and exported < everything and len(exported) <= len(everything) // 2


@pytest.mark.parametrize("owner", [KVMap, AdapterMaps])
def test_calibrate_is_a_classmethod_of_the_artifact(owner):
    assert isinstance(vars(owner)["calibrate"], classmethod)


def test_importing_the_artifact_loads_no_calibration_code():
    code = ("import sys; import peft_kvcache.maps.kvmap, peft_kvcache.maps.adapter_maps; "
            "print(sorted(m for m in sys.modules if m.startswith('peft_kvcache.calibration')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_adapter_maps_calibrate_fits_both_directions():
    from peft import LoraConfig, get_peft_model

    base = tiny_model("llama", seed=5)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["k_proj", "v_proj"], init_lora_weights=False),
                           adapter_name="loud")
    maps = AdapterMaps.calibrate(model, random_ids(6, 24), progress=False)
    assert set(maps.to_adapter) == set(maps.to_base) == {"loud"}
    assert maps.to_adapter["loud"].config.pair_kind == "same_shape"


def test_the_readme_fixture_command_runs_its_module_once():
    # the package root imported the fixtures module eagerly, so `python -m` found it imported already and runpy warned
    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "peft_kvcache.modeling.fixtures",
                           "no-such-fixture"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "unknown fixture 'no-such-fixture'" in done.stderr and "RuntimeWarning" not in done.stderr
    assert peft_kvcache.load_model.__module__ == "peft_kvcache.modeling.fixtures"
