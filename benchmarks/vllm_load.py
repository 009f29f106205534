"""Load benchmark of the vLLM connector (issues 23, 32): vLLM's CPU build (float32) on SmolLM2-135M-Instruct and the
committed adapters, on 127.0.0.1, three servers: (a) with the connector mapping, (b) with the connector injecting the
other variant's blocks unmapped (the naive baseline), (c) vLLM alone (its prefix cache keyed by adapter: every switch
is a prefill). Every server is started fresh for every measurement and warmed up with one base-model request only, so
the first switch to each adapter is as cold as after any start (the maps ship the adapters' sinks; nothing else is
taught).

1. Load, ``--runs`` times per server: a closed loop (``--conversations`` at once, each turn sent when the last one is
   answered) and, on a server started again, an open loop (``--open-conversations`` arriving as a Poisson process of
   ``--rate`` per second). Conversations begin on the base model and switch at every turn (base, an adapter, base,
   the next adapter, ...), on histories of 1,500+ tokens. TTFT (streamed, from the `openai` client, queueing
   included) of switch turns, cold ones (the first to each adapter since the start) and warm ones apart; the mean over
   runs with its 95% t-interval, and the ratios to (c) run by run.
2. Streams: inter-token latency of two long base-model streams while requests arrive on histories the base model
   computed: switches to adapters, or (the same load without switches) to the base model again.
3. A conversation of ``--long-turns`` turns switching at every turn (base, shout, docstring, reverse, ...): per turn
   the prompt tokens computed, the connector's label and the first-token KL against (c) on the same prompt.
4. Held-out quality: one switch per evaluation-split module and published map (all six): the first reply token of (a)
   and (b) against (c)'s exact prefill, a lower bound of the KL from the two top-20 lists (`first_token_kl`), means
   with 95% bootstrap intervals, and (a) - (b) paired.
5. At ``--own-tokens`` of history, an adapter continuing its own cached prefix against a mapped switch and a prefill.
6. Where mapping stops paying: with ``min_mapped_tokens`` 0, switches mapping 128 .. 1,024 tokens against the same
   request prefilled.

    bash scripts/vllm_env.sh                  # once: the vLLM environment (.venv-vllm)
    python -m benchmarks.vllm_load            # about 2 hours on 2 cores
    python -m benchmarks.vllm_load --runs 1 --conversations 2 --open-conversations 2 --samples 1 --long-turns 3 \\
        --repetitions 1 --repeats 1 --max-tokens 4 --output /tmp/vllm-load-smoke   # a smoke run

Measurements are kept after every server in ``--raw`` (a later run with the same arguments resumes from them).
Writes benchmarks/results/vllm-load.json and .md. Loopback only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from peft_kvcache._files import atomic_write
from peft_kvcache.lab.provenance import code_state, cpu_model, write_results
from peft_kvcache.modeling.fixtures import converted_path
from peft_kvcache.vllm.options import DEFAULT_MIN_MAPPED_TOKENS

from . import vllm_traffic as traffic
from .common import RESULTS, ROOT, SMOLLM, start_run
from .vllm_report import markdown, summarise
from .vllm_servers import ADAPTERS, vllm_server

MAPS = str(ROOT / "hub_cards")
SERVERS = {"a": {"maps": MAPS}, "b": {"maps": MAPS, "mode": "naive"}, "c": None}
MEASURE_ARGUMENTS = ("runs", "conversations", "open_conversations", "rate", "turns", "max_tokens", "history_chars",
                     "samples", "long_turns", "repetitions", "own_tokens", "repeats", "threads")


def phases(args) -> list[tuple[str, str]]:
    """(measurement, server) in the order they run, each on a freshly started server."""
    out = [(f"{loop}-{run}", key) for run in range(args.runs) for key in SERVERS for loop in ("closed", "open")]
    # extras: (c) after (a), whose conversation it answers exactly; the threshold on a server mapping any length
    return out + [("extras", "a"), ("extras", "b"), ("extras", "c"), ("threshold", "a")]


def measure_phase(name: str, key: str, url: str, args, raw: dict, tokenizer) -> dict:
    """One measurement on a started server."""
    texts = traffic.modules(args.history_chars)
    deadline = time.monotonic() + args.time_limit
    traffic.warm_up(url)
    if name.startswith("closed"):
        script = traffic.scripts(texts[: args.conversations], args.turns, args.history_chars)
        records, wall = traffic.conversations(url, script, args.max_tokens, deadline)
        return {"records": records, "wall": wall, "fallbacks": traffic.fallback_counts(url)}
    if name.startswith("open"):
        chosen = texts[args.conversations: args.conversations + args.open_conversations]
        starts = traffic.poisson_starts(len(chosen), args.rate, seed=int(name.split("-")[1]))  # seeded by the run
        records, wall = traffic.conversations(url, traffic.scripts(chosen, args.turns, args.history_chars),
                                              args.max_tokens, deadline, starts)
        return {"records": records, "wall": wall, "starts": starts, "fallbacks": traffic.fallback_counts(url)}
    module = next(t for t in traffic.modules(0) if len(t) > 40000)
    if name == "threshold":
        return {"rows": traffic.threshold(url, tokenizer, module, args.repeats)}
    out = {}
    if key in "ac":
        out["streams"] = traffic.streams(url, texts, args.history_chars, args.repetitions)
    if key == "a":
        out["own"] = traffic.own_versus_mapped(url, tokenizer, module, args.own_tokens, args.repeats)
        out["conversation"] = traffic.long_conversation(url, texts[-1], args.long_turns, args.history_chars,
                                                         args.max_tokens)
    if key == "c":
        out["conversation_references"] = traffic.references(url, raw["phases"]["extras/a"]["conversation"])
    out["samples"] = samples = traffic.switch_samples(texts[: args.samples], args.history_chars)
    out["answers"] = traffic.switch_answers(url, samples)
    return out


def measure(args, tokenizer) -> dict:
    """Every phase not yet in ``args.raw`` (from an earlier run with the same arguments), the raw file written
    after each."""
    arguments = {k: getattr(args, k) for k in MEASURE_ARGUMENTS}
    raw = json.loads(args.raw.read_text()) if args.raw.exists() else {}
    if raw.get("arguments") != arguments:
        raw = {"arguments": arguments, "command": sys.argv, "phases": {}}
    elif raw["phases"]:
        print(f"resuming from {args.raw}: {len(raw['phases'])} measurements kept", flush=True)
    model_folder = converted_path(SMOLLM)
    for name, key in phases(args):
        if f"{name}/{key}" in raw["phases"]:
            continue
        options = {**SERVERS[key], "min_mapped_tokens": 0} if name == "threshold" else SERVERS[key]
        log = args.raw.parent / f"vllm-load-{name}-{key}.log"
        started = time.monotonic()
        with vllm_server(args.vllm_python, model_folder, options, log) as url:
            measured = measure_phase(name, key, url, args, raw, tokenizer)
        # the code and the machine of this measurement (a run resumed in another session may run on another CPU)
        raw["phases"][f"{name}/{key}"] = {**measured, "measured_by": {**code_state(), "cpu": cpu_model()}}
        print(f"{name} on ({key}): {time.monotonic() - started:.0f} s", flush=True)
        atomic_write(args.raw, lambda tmp: Path(tmp).write_text(json.dumps(raw)))
    return raw


def compact(phases: dict) -> dict:
    """The measurements without the texts sent (the modules and replies: they are made again from the evaluation
    split and the arguments; the raw file keeps them)."""
    bulky = {"messages", "history", "switch", "reply"}

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in bulky}
        return [strip(v) for v in value] if isinstance(value, list) else value

    return strip(phases)


def main(argv=None) -> int:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="load runs per server and loop")
    parser.add_argument("--conversations", type=int, default=4, help="closed loop: conversations at once")
    parser.add_argument("--open-conversations", type=int, default=6, help="open loop: conversations arriving")
    parser.add_argument("--rate", type=float, default=0.05, help="open loop: conversations per second (Poisson)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--history-chars", type=int, default=6000, help="characters of the module shared first")
    parser.add_argument("--samples", type=int, default=24, help="held-out modules of the switch-quality samples")
    parser.add_argument("--long-turns", type=int, default=12, help="turns of the conversation switching at each")
    parser.add_argument("--repetitions", type=int, default=3, help="inter-token latency windows per condition")
    parser.add_argument("--own-tokens", type=int, default=2048, help="history of the own-cache comparison")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of the single-switch timings")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                        help="python of the vLLM environment (scripts/vllm_env.sh)")
    parser.add_argument("--time-limit", type=float, default=3600, help="seconds one load run may take")
    parser.add_argument("--raw", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "vllm-load-raw.json",
                        help="where measurements are kept after every server (and resumed from)")
    parser.add_argument("--output", type=Path, default=RESULTS / "vllm-load")
    args = parser.parse_args(argv)
    if not Path(args.vllm_python).exists():
        raise SystemExit(f"{args.vllm_python} does not exist: build the vLLM environment with bash scripts/vllm_env.sh")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    raw = measure(args, AutoTokenizer.from_pretrained(converted_path(SMOLLM)))
    payload = summarise(raw)
    payload["setup"] = {"model": SMOLLM, "adapters": list(ADAPTERS), "dtype": "float32", **raw["arguments"],
                        "connector_min_mapped_tokens": DEFAULT_MIN_MAPPED_TOKENS}
    text = markdown(payload)
    print(text)
    data = {"texts": "evaluation-split stdlib modules (first history_chars characters) and two of their documented "
                     "functions each; a module over 40,000 characters for the single-switch timings",
            "measured_by": sorted({json.dumps(p["measured_by"], sort_keys=True) for p in raw["phases"].values()}),
            "command": raw["command"]}
    write_results(args.output, {**payload, "measurements": compact(raw["phases"])}, text, data=data,
                  seeds={"vllm": 0, "arrivals": "the run's index"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
