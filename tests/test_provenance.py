"""Results files record the code a run started with, the command and the data."""

from __future__ import annotations

import subprocess

from peft_kvcache.provenance import code_state, lookup, provenance


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
