"""Whether two commits compute the same things: the adapter benchmark at small sizes and ``peft-kvcache
calibrate-adapters`` on a few files, each run in a worktree of each commit (its own code first on the path), their
outputs compared field by field and tensor by tensor (timings, dates, commits and versions aside).

    python -m scripts.same_outputs --before 249c159 --after HEAD

Writes benchmarks/results/same-outputs.json/.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, save, start_run, table

# Fields that differ from run to run whatever the code: wall time, dates, provenance.
VOLATILE = re.compile(r"seconds|ttft|time|date|commit|dirty|command|version|cpu|cores|threads|python|machine|"
                      r"provenance|speedup|throughput|tokens_per_second|per_token|library", re.I)
BENCHMARK = ["-m", "benchmarks.adapters", "--maps", "hub_cards", "--examples", "4", "--task-examples", "4",
             "--history-tokens", "256", "--turns", "2", "--threads", "2"]
CALIBRATE = ["-m", "peft_kvcache", "calibrate-adapters", "--base", "gguf:smollm2-135m-instruct", "--adapter",
             "shout=adapters/shout", "--data", "stdlib", "--num-files", "6", "--blend-files", "2", "--no-progress"]


def worktree(rev: str, root: Path) -> Path:
    folder = root / rev.replace("/", "-")
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), rev], cwd=ROOT, check=True,
                   capture_output=True)
    return folder


def run_at(tree: Path, args: list[str], output: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed at {tree}:\n{done.stderr[-3000:]}")


def stable(data):
    """``data`` without its volatile fields (recursively)."""
    if isinstance(data, dict):
        return {k: stable(v) for k, v in data.items() if not VOLATILE.search(k)}
    if isinstance(data, list):
        return [stable(v) for v in data]
    return data


def differences(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}/{k}: only in one" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += differences(a[k], b[k], f"{where}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {str(a)[:60]} != {str(b)[:60]}"]


def compare_maps(a: Path, b: Path) -> list[str]:
    from safetensors.torch import load_file

    out = []
    for folder in sorted(p.name for p in a.iterdir()):
        ta, tb = load_file(a / folder / "model.safetensors"), load_file(b / folder / "model.safetensors")
        out += [f"{folder}: tensor {n} differs" for n in sorted(set(ta) | set(tb))
                if n not in ta or n not in tb or not (ta[n] == tb[n]).all()]
        ca, cb = (stable(json.loads((p / folder / "config.json").read_text())) for p in (a, b))
        out += [f"{folder}/config.json{d}" for d in differences(ca, cb)]
    return out


def main() -> None:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", default="HEAD")
    args = parser.parse_args()
    revs = {side: subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.strip() for side, rev in (("before", args.before), ("after", args.after))}
    with tempfile.TemporaryDirectory() as scratch:
        trees = {side: worktree(rev, Path(scratch)) for side, rev in revs.items()}
        try:
            outputs = {}
            for side, tree in trees.items():
                run_at(tree, [*BENCHMARK, "--output", "same-outputs-probe"], tree)
                outputs[side] = {"benchmark": stable(json.loads((tree / "benchmarks/results/same-outputs-probe.json")
                                                                .read_text())), "maps": tree / "maps-probe"}
                run_at(tree, [*CALIBRATE, "--output", str(tree / "maps-probe")], tree)
            found = {"adapter benchmark (small sizes)": differences(outputs["before"]["benchmark"],
                                                                    outputs["after"]["benchmark"]),
                     "calibrate-adapters (maps and configs)": compare_maps(outputs["before"]["maps"],
                                                                           outputs["after"]["maps"])}
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    rows = [[name, "identical" if not diffs else f"{len(diffs)} differences: {'; '.join(diffs[:3])}"]
            for name, diffs in found.items()]
    lines = [f"# Same outputs before and after ({revs['before'][:7]} -> {revs['after'][:7]})", "",
             f"Benchmark: `python {' '.join(BENCHMARK)}`; calibration: `python {' '.join(CALIBRATE)}`. Timings, dates "
             "and provenance aside; every other field and every tensor compared exactly.", "",
             table(["what", "result"], rows)]
    save("same-outputs", {"revisions": revs, "differences": found,
                          "commands": {"benchmark": BENCHMARK, "calibrate": CALIBRATE}}, "\n".join(lines))


if __name__ == "__main__":
    main()
