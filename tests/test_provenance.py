"""Results files record the code a run started with, the command and the data."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from peft_kvcache.lab.provenance import code_state, key_of, lookup, provenance


def _git(root, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_a_commit_made_while_a_run_goes_on_is_not_claimed_by_its_results(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    _git(tmp_path, "add", "code.py")
    _git(tmp_path, "commit", "-qm", "first")
    started = _git(tmp_path, "rev-parse", "HEAD")
    assert code_state(tmp_path) == {"commit": started, "dirty": False}  # the run starts
    (tmp_path / "code.py").write_text("x = 2\n")
    _git(tmp_path, "commit", "-qam", "second")  # a commit lands while it runs
    (tmp_path / "results.json").write_text("{}")  # untracked results never make the tree dirty
    record = provenance(data={"texts": ["a.py"]}, cwd=tmp_path)
    assert record["commit"] == started and record["dirty"] is False and record["data"] == {"texts": ["a.py"]}


def test_lookup_picks_list_entries_by_name():
    data = {"rows": [{"variant": "full", "kl": 0.0}, {"variant": "mapped@1", "kl": 0.3}]}
    assert lookup(data, "rows/variant=mapped@1/kl") == 0.3 and lookup(data, "rows/0/variant") == "full"
    named = {"rows": [{"variant": "index@160/p40", "kl": 0.2}], "a/b~c": {"x": 1}}  # names holding / and ~
    assert lookup(named, key_of("rows", "variant=index@160/p40", "kl")) == 0.2
    assert lookup(named, key_of("a/b~c", "x")) == 1


def test_the_command_of_a_module_run_is_recorded_as_typed(tmp_path):
    """``python -m pkg.mod --flag`` is recorded as such, not as the module's file path (which may not run alone)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text("from peft_kvcache.lab.provenance import command_line\nprint(command_line())\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-m", "pkg.mod", "--flag", "a b"], cwd=tmp_path, capture_output=True,
                          text=True, check=True, env=env)
    assert done.stdout.strip().endswith("-m pkg.mod --flag 'a b'")
    script = subprocess.run([sys.executable, "pkg/mod.py", "--x"], cwd=tmp_path, capture_output=True, text=True,
                            check=True, env=env)
    assert script.stdout.strip().endswith("pkg/mod.py --x")


def test_a_run_on_changed_code_records_the_changes_and_results_being_written_are_not_code(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "runs.jsonl").write_text("{}\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "first")
    (tmp_path / "benchmarks" / "results" / "runs.jsonl").write_text("{}\n{}\n")  # a run appending its records
    assert code_state(tmp_path) == {"commit": _git(tmp_path, "rev-parse", "HEAD"), "dirty": False}
    changed = tmp_path / "again"
    _git(tmp_path, "clone", "-q", str(tmp_path), str(changed))
    (changed / "code.py").write_text("x = 2\n")
    (changed / "benchmarks" / "results" / "runs.jsonl").write_text("{}\n{}\n")
    state = code_state(changed)
    assert state["dirty"] is True and "-x = 1" in state["changes"] and "+x = 2" in state["changes"]
    assert "runs.jsonl" not in state["changes"]
    inside = code_state(changed / "benchmarks")  # a run started from a subfolder reads the whole tree
    assert inside["dirty"] is True and "+x = 2" in inside["changes"] and "runs.jsonl" not in inside["changes"]

