"""``peft-kvcache serve`` without the ``serve`` extra (fastapi, uvicorn, prometheus-client): one line on stderr
naming the extra to install, exit status 2, before any model loads; the rest of the command line works without
it. The real command line runs in a subprocess in which the extra's modules cannot be imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
EXTRA = ("fastapi", "uvicorn", "prometheus_client")

# The command line in a process where the extra is not installed, by one of two means: an entry of None in
# sys.modules (import raises ModuleNotFoundError, importlib.util.find_spec answers None, as for a module that is
# not there), or a finder ahead of every other that refuses the modules. Loading a model exits with status 99.
HARNESS = """
import importlib.abc, sys
EXTRA, HOW = {extra!r}, {how!r}
if HOW == "modules":
    sys.modules.update(dict.fromkeys(EXTRA))
else:
    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in EXTRA:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None
    sys.meta_path.insert(0, Refuse())
import peft_kvcache.modeling.fixtures as fixtures

def load_model(*args, **kwargs):
    print("a model was loaded", file=sys.stderr)
    sys.exit(99)

fixtures.load_model = load_model
from peft_kvcache.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_without_extra(args: list[str], tmp_path: Path, how: str = "modules") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub-cache"),
               TRANSFORMERS_VERBOSITY="error")
    return subprocess.run([sys.executable, "-c", HARNESS.format(extra=EXTRA, how=how), *args], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)


@pytest.mark.parametrize("how", ["modules", "finder"])
def test_serve_names_the_extra_and_exits_2_before_any_model_loads(tmp_path, how):
    result = run_without_extra(["serve", "--model", str(tmp_path / "no-such-model"), "--adapter",
                                f"shout={tmp_path / 'no-such-adapter'}"], tmp_path, how)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("peft-kvcache: error: serve needs the serve extra")
    assert 'pip install "peft-kvcache[serve]"' in result.stderr
    assert all(name in result.stderr for name in EXTRA)
    assert "a model was loaded" not in result.stderr and "cannot be loaded" not in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_the_other_commands_and_every_help_work_without_the_extra(tmp_path):
    for args in (["--help"], ["serve", "--help"]):
        result = run_without_extra(args, tmp_path)
        assert result.returncode == 0 and result.stdout.startswith("usage: peft-kvcache"), result.stderr
    card = REPO_ROOT / "hub_cards" / "smollm2-135m-instruct-base-to-shout"
    result = run_without_extra(["inspect", str(card)], tmp_path)
    assert result.returncode == 0 and "smollm2" in result.stdout.lower(), result.stderr


def test_the_command_line_imports_none_of_the_extra():
    code = f"import sys, peft_kvcache.cli; print(sorted(set({EXTRA!r}) & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr
