"""The ``peft-kvcache`` command line, end to end on tiny models saved to disk with their tokenizer: calibrate in
a subprocess, then inspect, card, evaluate and push, the card's usage snippet run as written, bad arguments,
library errors as one line on stderr with exit status 2, and ``--help`` at every level."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from conftest import save_tiny_model
from huggingface_hub import ModelCard, constants
from transformers import AutoModelForCausalLM

from peft_kvcache import KVMap
from peft_kvcache.cli import build_parser, main
from peft_kvcache.lab.provenance import lookup

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("calibrate", "calibrate-adapters", "evaluate", "card", "inspect", "push")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    data = root / "data"
    data.mkdir()
    for f in range(3):
        lines = [f"def f{f}_{i}(x, y):\n    return x * {i} + y - {f}\n" for i in range(14)]
        (data / f"part{f}.py").write_text("".join(lines))
    (data / "ignored.bin").write_bytes(b"\x00" * 10)
    return {"root": root, "data": data, "source": save_tiny_model(root / "source", 2, 0),
            "target": save_tiny_model(root / "target", 3, 1)}


def _env(root: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(root / "hub-cache"),
               TRANSFORMERS_VERBOSITY="error")
    return env


def run_cli(args: list[str], root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peft_kvcache", *args], capture_output=True, text=True,
                          env=_env(root), cwd=root, timeout=300)


@pytest.fixture(scope="module")
def calibrated(workspace) -> Path:
    """``peft-kvcache calibrate`` run in a subprocess, as a user would."""
    output = workspace["root"] / "map"
    result = run_cli(["calibrate", "--source", str(workspace["source"]), "--target", str(workspace["target"]),
                      "--data", str(workspace["data"]), "--output", str(output), "--max-length", "64",
                      "--top-k", "2", "--sink-tokens", "2", "--heldout-fraction", "0.25", "--no-progress"],
                     workspace["root"])
    assert result.returncode == 0, result.stderr
    assert f"to {output}" in result.stdout and "layers keys" in result.stdout and "(1 process(es))" in result.stdout
    assert "Traceback" not in result.stderr
    return output


def cli(args: list[str]) -> tuple[int, str, str]:
    """Run ``main`` in this process; returns (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(args)
        except SystemExit as exit_:
            status = exit_.code
    return status, out.getvalue(), err.getvalue()


def test_calibrate_writes_a_complete_map(calibrated, workspace):
    assert {"config.json", "model.safetensors", "README.md", "layer_r2.png"} <= {p.name for p in calibrated.iterdir()}
    kv_map = KVMap.from_pretrained(calibrated)
    c = kv_map.config
    assert c.target_layout.num_layers == 3 and c.source_layout.num_layers == 2
    assert all(len(group) == 2 for group in c.key_layers + c.value_layers)  # --top-k 2 of 2 source layers
    assert c.sink_tokens == 2 and c.calibration.options.max_length == 64 and c.calibration.options.top_k == 2
    assert c.calibration.source.model == str(workspace["source"])
    assert c.calibration.data.description.startswith("3 distinct files")
    assert sorted(c.calibration.data.names()) == ["part0.py", "part1.py", "part2.py"]  # each file, once, by name
    assert c.calibration.data.names("heldout") == ["part2.py"]  # every 4th text (--heldout-fraction 0.25), whole
    assert c.calibration.train_tokens > 500
    assert c.calibration.license == "mit"  # both models' cards say mit
    assert ModelCard.load(calibrated / "README.md").data.license == "mit"


def test_the_card_snippet_runs_as_written(calibrated, capsys, monkeypatch):
    monkeypatch.chdir(calibrated.parent)  # the snippet names the map by its folder (the repo name once pushed)
    readme = (calibrated / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, flags=re.S).group(1)
    exec(compile(snippet, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.strip(), "the snippet prints the generated continuation"


def test_bad_arguments_exit_nonzero_and_name_the_argument(workspace):
    result = run_cli(["calibrate", "--source", "s", "--target", "t", "--output", "o", "--top-k", "0"],
                     workspace["root"])
    assert result.returncode == 2
    assert "--top-k" in result.stderr and "positive" in result.stderr and "cannot be loaded" not in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["calibrate", "calibrate-adapters"])
def test_an_output_that_cannot_be_written_is_refused_before_any_model_loads(tmp_path, command):
    taken = tmp_path / "notes"
    taken.mkdir()
    (taken / "mine.txt").write_text("not a map")
    (tmp_path / "file.txt").write_text("a file")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    models = (["--source", "no-such-model", "--target", "no-such-model"] if command == "calibrate" else
              ["--base", "no-such-model", "--adapter", f"a={tmp_path / 'adapter'}"])
    outputs = [(tmp_path / "file.txt", "file")] + ([(taken, "not a KV map folder")] if command == "calibrate" else [])
    for output, named in outputs:
        status, _, err = cli([command, *models, "--data", "stdlib", "--output", str(output)])
        assert status != 0 and named in err and "cannot be loaded" not in err, err


@pytest.mark.parametrize("args, named", [
    (["calibrate", "--source", "s", "--target", "t", "--output", "o", "--heldout-fraction", "1.5"],
     "--heldout-fraction"),
    (["calibrate", "--source", "s", "--target", "t"], "--output"),
    (["evaluate", "m", "--context-length", "x"], "--context-length"),
    (["inspect"], "MAP"),
    (["push", "folder"], "REPO_ID"),
    (["frobnicate"], "frobnicate"),
])
def test_argument_errors_in_process(args, named):
    status, _, err = cli(args)
    assert status == 2 and named in err


def test_missing_data_is_a_one_line_error(workspace, tmp_path):
    status, out, err = cli(["calibrate", "--source", str(workspace["source"]), "--target", str(workspace["target"]),
                            "--data", str(tmp_path / "nowhere"), "--output", str(tmp_path / "map")])
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("peft-kvcache: error: --data") and "nowhere" in err
    assert not (tmp_path / "map").exists()


def test_an_unloadable_model_names_the_option(workspace, tmp_path):
    status, _, err = cli(["calibrate", "--source", str(workspace["source"]), "--target", str(tmp_path),
                          "--data", str(workspace["data"]), "--output", str(tmp_path / "map")])
    assert status == 2 and "--target" in err and str(tmp_path) in err and "Traceback" not in err


def test_inspect(calibrated):
    status, out, _ = cli(["inspect", str(calibrated)])
    kv_map = KVMap.from_pretrained(calibrated)
    assert status == 0
    assert kv_map.config.source_fingerprint in out and kv_map.config.target_fingerprint in out
    assert "layers keys  0<-0+1 1<-0+1 2<-0+1" in out
    assert f"{kv_map.num_parameters:,} parameters" in out and "model.safetensors (" in out
    status, out, _ = cli(["inspect", str(calibrated), "--json"])
    assert json.loads(out) == json.loads((calibrated / "config.json").read_text())


def test_a_corrupted_map_is_a_one_line_error(calibrated, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "model.safetensors"):
        (broken / name).write_bytes((calibrated / name).read_bytes())
    (broken / "model.safetensors").write_bytes((broken / "model.safetensors").read_bytes()[:100])
    status, out, err = cli(["inspect", str(broken)])
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and "model.safetensors" in err and "truncated" in err


def test_a_missing_repo_is_the_hubs_error_on_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    status, _, err = cli(["inspect", "org/no-such-map"])
    assert status == 2 and err.count("\n") == 1 and "LocalEntryNotFoundError" in err


def test_card_regenerates_the_readme(calibrated, tmp_path):
    folder = tmp_path / "map"
    folder.mkdir()
    for path in calibrated.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / "README.md").write_text("stale")
    before = KVMap.from_pretrained(folder)
    status, out, _ = cli(["card", str(folder), "--repo-id", "my-org/tiny-kvmap"])
    assert status == 0 and "README.md" in out
    readme = (folder / "README.md").read_text()
    assert 'KVMap.from_pretrained("my-org/tiny-kvmap")' in readme and "## Limitations" in readme
    after = KVMap.from_pretrained(folder)
    assert all(torch.equal(after.tensors[k], v) for k, v in before.tensors.items())
    assert after.config.to_dict() == before.config.to_dict()
    status, _, _ = cli(["card", str(folder), "--license", "apache-2.0"])
    assert status == 0 and ModelCard.load(folder / "README.md").data.license == "apache-2.0"
    assert KVMap.from_pretrained(folder).config.calibration.license == "apache-2.0"


def test_card_refuses_a_repo_id(tmp_path):
    status, _, err = cli(["card", "org/some-map"])
    assert status == 2 and "not a local map folder" in err


def test_evaluate_prints_a_table_and_records_figures_only_for_held_out_text(calibrated, workspace, tmp_path):
    folder = tmp_path / "map"
    folder.mkdir()
    for path in calibrated.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    evaluation = tmp_path / "evaluation"
    evaluation.mkdir()
    for f in range(2):
        (evaluation / f"other{f}.py").write_text("".join(f"def g{f}_{i}(a):\n    return a + {i}\n" for i in range(12)))
    args = ["--context-length", "24", "--continuation-length", "8", "--max-examples", "2", "--no-progress"]
    status, out, err = cli(["evaluate", str(folder), "--data", str(workspace["data"]), *args])
    assert status == 0, err
    assert "mapped@1" in out and "| variant |" in out
    # the calibration text itself: no figures may be recorded from it
    status, _, err = cli(["evaluate", str(folder), "--data", str(workspace["data"]), "--write", *args])
    assert status == 2 and "disjoint" in err and "part0.py" in err
    status, out, err = cli(["evaluate", str(folder), "--data", str(evaluation), "--json", "--write", *args])
    assert status == 0, err
    report = json.loads(out)
    assert report["context_length"] == 24 and report["examples"] == 2
    figure = KVMap.from_pretrained(folder).config.quality.figures["mapped@1.kl"]
    results = json.loads((folder / figure.results).read_text())
    assert results["retention"]["rows"] == report["rows"]
    assert results["provenance"]["data"]["texts"] == ["other0.py", "other1.py"]
    assert figure.value == lookup(results, figure.key) == next(r["kl"] for r in report["rows"] if r["variant"] == "mapped@1")
    assert "mapped@1.kl" in (folder / "README.md").read_text()


def test_evaluate_needs_enough_tokens(calibrated, workspace):
    pytest.importorskip("peft_kvcache.calibration.retention")
    status, _, err = cli(["evaluate", str(calibrated), "--data", str(workspace["data"]),
                          "--context-length", "100000", "--no-progress"])
    assert status == 2 and "--context-length 100000" in err


def test_evaluate_write_refuses_a_repo_before_any_work(monkeypatch):
    pytest.importorskip("peft_kvcache.calibration.retention")
    monkeypatch.setattr("peft_kvcache.maps.storage.resolve_map_folder",
                        lambda *a, **k: pytest.fail("resolved the map before checking --write"))
    status, _, err = cli(["evaluate", "org/some-map", "--write"])
    assert status == 2 and "--write" in err


def test_push_uploads_the_folder(calibrated, monkeypatch):
    calls = {}

    def create_repo(api, repo_id, **kwargs):
        calls["create_repo"] = dict(kwargs, repo_id=repo_id)
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(api, **kwargs):
        calls["upload_folder"] = dict(kwargs, files=sorted(p.name for p in Path(kwargs["folder_path"]).iterdir()))
        return huggingface_hub.CommitInfo(commit_url="https://huggingface.co/org/tiny/commit/abc", commit_message="",
                                          commit_description="", oid="abc")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    status, out, err = cli(["push", str(calibrated), "org/tiny", "--private", "--commit-message", "v1"])
    assert status == 0, err
    assert out.strip() == "https://huggingface.co/org/tiny/commit/abc"
    assert calls["create_repo"]["private"] is True and calls["create_repo"]["repo_id"] == "org/tiny"
    assert {"config.json", "model.safetensors", "README.md"} <= set(calls["upload_folder"]["files"])
    assert calls["upload_folder"]["commit_message"] == "v1"


def test_help_at_every_level():
    status, out, _ = cli(["--help"])
    assert status == 0 and all(command in out for command in COMMANDS) and "examples:" in out
    for command in COMMANDS:
        status, out, _ = cli([command, "--help"])
        assert status == 0 and out.startswith(f"usage: peft-kvcache {command}") and "example:" in out
    status, _, err = cli([])
    assert status == 2 and "calibrate" in err


def test_every_option_has_help_text():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and set(COMMANDS) <= set(a.choices)).choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"


def test_the_console_script_points_at_main():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["peft-kvcache"].partition(":")
    assert (module, function) == ("peft_kvcache.cli", "main")
    status, out, _ = cli(["--version"])
    assert status == 0 and re.fullmatch(r"peft-kvcache \d+\.\d+\.\d+\S*\n", out)


def test_stdlib_data_reads_the_split_asked_for():
    corpus = pytest.importorskip("peft_kvcache.lab.corpus")
    from peft_kvcache.lab.corpus import read_texts

    texts, description = read_texts("stdlib", "calibration", 2)
    assert list(texts.values()) == corpus.calibration_texts(2) and "calibration split" in description
    assert all(name.endswith(".py") and not name.startswith("/") for name in texts)  # relative paths
    texts, description = read_texts("stdlib", "evaluation", 1)
    assert list(texts.values()) == corpus.evaluation_texts(1) and "evaluation split" in description
    status, _, err = cli(["calibrate", "--source", "s", "--target", "t", "--output", "o", "--data", "stdlib",
                          "--num-files", "100000"])
    assert status == 2 and err.startswith("peft-kvcache: error: --data stdlib")


@pytest.fixture(scope="module")
def adapter_folders(workspace) -> dict[str, Path]:
    """Two random LoRA adapters (attention and MLP projections, nonzero B) of the tiny target, saved by PEFT."""
    from peft import LoraConfig, get_peft_model

    folders = {}
    for seed, name in enumerate(("terse", "loud")):
        base = AutoModelForCausalLM.from_pretrained(workspace["target"])
        torch.manual_seed(20 + seed)
        config = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=4, init_lora_weights=False,
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
        get_peft_model(base, config).save_pretrained(workspace["root"] / "adapters" / name)
        folders[name] = workspace["root"] / "adapters" / name
    return folders


def test_calibrate_adapters_writes_both_directions_for_every_adapter(workspace, adapter_folders, tmp_path):
    from peft import PeftModel

    from peft_kvcache import AdapterMaps, FingerprintMismatchError, MappedCache
    from peft_kvcache.modeling.adapters import adapter_active
    from peft_kvcache.modeling.capture import run_with_cache

    status, out, err = cli(["calibrate-adapters", "--base", str(workspace["target"]),
                            "--adapter", f"terse={adapter_folders['terse']}", "--adapter",
                            f"loud={adapter_folders['loud']}", "--data", str(workspace["data"]), "--output",
                            str(tmp_path), "--prefix", "tiny", "--max-length", "64", "--blend-files", "1",
                            "--no-progress"])
    assert status == 0, err
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["tiny-base-to-loud", "tiny-base-to-terse", "tiny-loud-to-base", "tiny-terse-to-base"]
    assert out.count("saved ") == 4 and all((tmp_path / n / "README.md").is_file() for n in names)

    # the saved maps are the right ones for the models: each adapter's map passes its fingerprint check
    # with that adapter active and is refused with the other one
    base = AutoModelForCausalLM.from_pretrained(workspace["target"])
    model = PeftModel.from_pretrained(base, str(adapter_folders["terse"]), adapter_name="terse")
    model.load_adapter(str(adapter_folders["loud"]), adapter_name="loud")
    maps = AdapterMaps.from_pretrained(tmp_path, model, ["terse", "loud"])  # found by what they fit
    assert all(m.config.blend for m in [*maps.to_adapter.values(), *maps.to_base.values()])  # chosen on held-out text
    ids = torch.randint(3, 100, (1, 20))
    with adapter_active(model, None):
        captured = run_with_cache(model, ids)
    base_cache = list(zip(captured.keys, captured.values))
    with adapter_active(model, "loud"):
        MappedCache.from_source(base_cache, maps.to_adapter["loud"], model, input_ids=ids)
        with pytest.raises(FingerprintMismatchError):
            MappedCache.from_source(base_cache, maps.to_adapter["terse"], model, input_ids=ids)


def test_calibrate_adapters_names_a_bad_adapter_argument(workspace, adapter_folders, tmp_path):
    base = ["calibrate-adapters", "--base", str(workspace["target"]), "--data", str(workspace["data"]),
            "--output", str(tmp_path), "--no-progress"]
    for adapter, named in [("terse", "NAME=PATH"), (f"x={tmp_path}", "adapter_config.json"),
                           (f"terse={adapter_folders['terse']}", None),
                           (f"org/terse={adapter_folders['terse']}", "letters, digits"),  # it names map folders
                           (f"base:terse={adapter_folders['terse']}", "letters, digits")]:
        args = base + ["--adapter", adapter] + (["--adapter", f"terse={adapter_folders['loud']}"] if named is None else [])
        status, _, err = cli(args)
        assert status == 2 and err.count("\n") == 1, err
        assert (named or "given twice") in err
    status, _, err = cli(base + ["--adapter", f"terse={adapter_folders['terse']}", "--blend-files", "3"])
    assert status == 2 and "--blend-files 3" in err


def test_calibrate_adapters_chooses_each_maps_rank_on_the_held_out_texts(workspace, adapter_folders, tmp_path):
    from peft_kvcache import KVMap

    args = ["calibrate-adapters", "--base", str(workspace["target"]), "--adapter", f"terse={adapter_folders['terse']}",
            "--data", str(workspace["data"]), "--output", str(tmp_path), "--prefix", "tiny", "--max-length", "64",
            "--no-progress", "--no-reverse"]
    status, _, err = cli(args + ["--choose-rank", "2"])  # no texts to choose on: refused before any model loads
    assert status == 2 and "--choose-rank needs --blend-files" in err and not list(tmp_path.iterdir())
    status, _, err = cli(args + ["--blend-files", "1", "--choose-rank", "2", "500"])
    assert status == 2 and "--choose-rank 500" in err and "below half the layer width" in err
    status, out, err = cli(args + ["--blend-files", "1", "--choose-rank", "2", "3"])
    assert status == 0, err
    kv_map = KVMap.from_pretrained(tmp_path / "tiny-base-to-terse")
    record = kv_map.config.rank_choice
    assert set(record.kl) == {"0", "2", "3"} and kv_map.residual_rank == record.rank and kv_map.config.blend
    assert "Residual rank" in (tmp_path / "tiny-base-to-terse" / "README.md").read_text()


def test_the_cli_on_a_missing_folder_fails_at_once(capsys):
    assert main(["inspect", "./no/such/map"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no map folder" in err
