"""How long a user's own adapter maps take (issue 30): the README's ``calibrate-adapters`` command, read from the
README itself and run as typed (in a fresh output folder), its wall time and, per map it wrote, the training and
held-out tokens and the fit's own seconds. Run it on a quiet machine: it times.

    python -m benchmarks.calibrate_time          # ~20 min on 2 cores

Writes benchmarks/results/calibrate-time.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import ROOT, save, start_run, table

COMMAND_START = "peft-kvcache calibrate-adapters "


def readme_command(readme: Path = ROOT / "README.md") -> list[str]:
    """The README's ``calibrate-adapters`` command as words (its backslash-continued lines joined)."""
    lines = readme.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(COMMAND_START)), None)
    if start is None:
        raise SystemExit(f"README.md has no line starting with {COMMAND_START!r}")
    text = lines[start]
    for line in lines[start + 1:]:
        if not text.endswith("\\"):
            break
        text = text[:-1] + " " + line.strip()
    return shlex.split(text)


def with_output(words: list[str], output: Path) -> list[str]:
    """``words`` writing into ``output`` instead of the README's folder."""
    if "--output" not in words:
        raise SystemExit("the README's calibrate-adapters command names no --output")
    at = words.index("--output")
    return [*words[: at + 1], str(output), *words[at + 2:]]


def main(argv=None) -> int:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    words = readme_command()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryDirectory() as folder:
        command = with_output(words, Path(folder) / "maps")
        executable = [sys.executable, "-m", "peft_kvcache.cli", *command[1:]]  # the installed CLI, this interpreter
        started = time.perf_counter()
        subprocess.run(executable, cwd=ROOT, env=env, check=True)
        seconds = time.perf_counter() - started
        maps = []
        for config in sorted(Path(folder, "maps").glob("*/config.json")):
            calibration = json.loads(config.read_text())["calibration"]
            maps.append({"map": config.parent.name, "train_tokens": calibration["train_tokens"],
                         "heldout_tokens": calibration["heldout_tokens"], "fit_seconds": calibration["seconds"]})
    if not maps:
        raise SystemExit("the command wrote no maps")
    payload = {"readme_command": shlex.join(words), "threads": args.threads, "seconds": seconds, "maps": maps}
    minutes, rest = divmod(round(seconds), 60)
    text = "\n".join([
        f"# The README's calibrate-adapters command: {minutes} min {rest} s on {args.threads} threads", "",
        f"`{shlex.join(words)}`", "",
        table(["map", "training tokens", "held-out tokens", "fit (s)"],
              [[m["map"], f"{m['train_tokens']:,}", f"{m['heldout_tokens']:,}", f"{m['fit_seconds']:.0f}"]
               for m in maps])])
    save("calibrate-time", payload, text, data={"command": shlex.join(words), "maps": [m["map"] for m in maps]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
