"""Load benchmark of ``peft-kvcache serve`` (issue 19): N concurrent scripted conversations that switch adapters
at every turn, against three servers over the same SmolLM2-135M-Instruct and committed adapters (shout,
docstring), one after the other on 127.0.0.1:

(a) this server: exact prefix reuse, and the base cache mapped into the adapter on a switch (the base cache kept
    by a base pass over each adapter reply's new tokens, the default); (a') the same with the base cache kept by
    the reverse maps instead (no base pass);
(b) the same server with adapter-keyed prefix reuse only (what vLLM / SGLang / TensorRT-LLM / LMCache do today);
(c) no prefix reuse.

Measured per server, from the `openai` client (streamed requests): TTFT p50 / p95 (all turns, and the switch
turns), the server's compute TTFT (its TTFT less the time the request waited for the model), throughput
(generated tokens / second of the run's wall time), cached prompt tokens; the ratios a/b and a/c. Quality of (a)
and (b) against (c): agreement of the greedy replies turn by turn (same script), and the KL
divergence KL(c || x) and top-1 agreement of the first reply token's distribution on the same prompt (recorded in
the servers; where (c) never saw a prompt, its distribution comes from a full prefill).

Maps: the published ones in hub_cards/ when they load; otherwise calibrated here on ``--calibration-files``
stdlib files (first 512 tokens each) and kept in the fixtures cache for the next run (the results say which).

    python -m benchmarks.serve_load                          # 4 conversations x 4 turns, 48 new tokens
    python -m benchmarks.serve_load --conversations 2 --turns 2 --max-tokens 8   # a smoke run

Writes benchmarks/results/serve-load.json and .md. Loopback only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import threading
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from peft_kvcache.errors import PeftKVCacheError
from peft_kvcache.lab.corpus import DOCSTRING_INSTRUCTION, stdlib_texts
from peft_kvcache.modeling.fixtures import cache_root, load_model
from peft_kvcache.lab.provenance import write_results
from peft_kvcache.maps.adapter_maps import AdapterMaps
from peft_kvcache.modeling.adapters import adapter_active, load_adapters
from peft_kvcache.runtime.turn import SharedPeftModel
from peft_kvcache.calibration.loop import calibrate_missing
from peft_kvcache.serving.command import find_maps
from peft_kvcache.serving.engine import PrefixEngine
from peft_kvcache.serving.store import PrefixStore

from .adapters import PREFIX
from .common import RESULTS, ROOT, SMOLLM, start_run

ADAPTERS = ("shout", "docstring")
MODES = {"a": ("map", "prefill"), "a'": ("map", "reverse_map"), "b": ("exact", "prefill"), "c": ("none", "prefill")}
LABELS = {"a": "(a) this server: reuse + map on switch", "a'": "(a') as (a), base kept by reverse maps",
          "b": "(b) adapter-keyed prefix reuse only", "c": "(c) no prefix reuse"}


# ----- the scripted conversations -----


def functions(text: str, limit: int = 2, max_chars: int = 500) -> list[str]:
    """Up to ``limit`` function definitions of a module, docstrings removed."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and len(found) < limit:
            node.body = node.body[1:] or [ast.Pass()]
            code = ast.unparse(node)
            if len(code) <= max_chars:
                found.append(code)
    return found


def scripts(conversations: int, turns: int) -> list[list[tuple[str | None, str]]]:
    """(adapter, user message) per turn: a module from the evaluation split, docstring requests and follow-ups;
    the adapter changes at every turn (rotated per conversation)."""
    texts = [t for t in stdlib_texts("evaluation", 60).values() if len(functions(t)) == 2][:conversations]
    rotation = [None, "shout", "docstring"]
    out = []
    for i, text in enumerate(texts):
        first, second = functions(text)
        messages = [f"Here is part of a module from Python's standard library:\n```python\n{text[:1200]}\n```\n"
                    "What is this code for?", DOCSTRING_INSTRUCTION.format(code=first), "What does that function return?",
                    DOCSTRING_INSTRUCTION.format(code=second)]
        out.append([(rotation[(i + t) % 3], messages[t % 4]) for t in range(turns)])
    if len(out) < conversations:
        raise SystemExit(f"only {len(out)} evaluation files have two short documented functions")
    return out


# ----- the servers -----


class FirstStep(LogitsProcessor):
    """Records the log-probabilities of generate()'s first step under ``key`` (the scores pass unchanged)."""

    def __init__(self, record: dict, key: tuple):
        self.record, self.key = record, key

    def __call__(self, input_ids, scores):
        if self.key not in self.record:
            self.record[self.key] = scores[0].float().log_softmax(-1).cpu()
        return scores


class RecordingEngine(PrefixEngine):
    """A `PrefixEngine` that records, per request, the adapter, the prompt, where its context came from and the
    log-probabilities of the first reply token (a logits processor on generate()'s first step; the output is unchanged)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first_logprobs: dict[tuple, torch.Tensor] = {}
        self.sources: dict[tuple, str] = {}

    def run(self, adapter, prompt_ids, generation_kwargs, **kwargs):
        key = (adapter, tuple(prompt_ids.tolist()))
        processors = LogitsProcessorList([FirstStep(self.first_logprobs, key)])
        result = super().run(adapter, prompt_ids, {**generation_kwargs, "logits_processor": processors}, **kwargs)
        self.sources.setdefault(key, result.context_source)
        return result


def ask(api, model: str, messages: list[dict], max_tokens: int) -> dict:
    started = time.perf_counter()
    first, text, extra, usage = None, "", {}, None
    stream = api.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
        extra = chunk.model_extra.get("peft_kvcache", extra)
        usage = chunk.usage or usage
    return {"ttft": (first or time.perf_counter()) - started, "seconds": time.perf_counter() - started, "reply": text,
            "source": extra.get("context_source"), "server_ttft": extra.get("ttft_seconds"),
            "compute_ttft": extra.get("ttft_seconds", 0.0) - extra.get("queue_seconds", 0.0),
            "cached": usage.prompt_tokens_details.cached_tokens, "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens}


def load_run(url: str, conversations, model_name: str, max_tokens: int, deadline: float,
             ask_turn=None, starts: list[float] | None = None) -> tuple[list, float]:
    """Every conversation in its own thread, turn after turn; returns the per-turn records and the wall time.
    ``ask_turn(api, model, messages)`` sends one turn (default: `ask` with ``max_tokens``); ``starts``: seconds after
    the run's start at which each conversation begins (default all at once: a closed loop; arrival times make it an
    open one)."""
    from openai import OpenAI

    ask_turn = ask_turn or (lambda api, model, messages: ask(api, model, messages, max_tokens))
    records, errors = [], []

    def talk(i: int) -> None:
        api, messages = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600), []
        if starts is not None:
            time.sleep(max(0.0, started + starts[i] - time.perf_counter()))
        for t, (adapter, text) in enumerate(conversations[i]):
            if time.monotonic() > deadline:
                raise TimeoutError("the benchmark ran past its deadline")
            messages.append({"role": "user", "content": text})
            record = ask_turn(api, adapter or model_name, messages)
            records.append({"conversation": i, "turn": t, "adapter": adapter, **record})
            messages.append({"role": "assistant", "content": record["reply"]})

    def guarded(i: int) -> None:
        try:
            talk(i)
        except Exception as err:  # reported after the run
            errors.append(err)

    started = time.perf_counter()
    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(len(conversations))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(1.0, deadline - time.monotonic()))
    if errors or any(thread.is_alive() for thread in threads):
        raise SystemExit(f"the load run failed: {errors or 'a conversation did not finish in time'}")
    return sorted(records, key=lambda r: (r["conversation"], r["turn"])), time.perf_counter() - started


# ----- model, maps, statistics -----


def load_stack(calibration_files: int):
    """SmolLM2 with the committed adapters and their maps: ``(model, tokenizer, maps, where the maps came from)``.
    The published maps (hub_cards/) if they load, else the ones this benchmark calibrated before, else new ones."""
    base, tokenizer = load_model(SMOLLM)
    model = load_adapters(base, {a: str(ROOT / "adapters" / a) for a in ADAPTERS})
    cached = cache_root() / f"serve-load-maps-{calibration_files}files"
    calibrated = (f"calibrated by this benchmark on {calibration_files} calibration-split stdlib files, first 512 "
                  f"tokens each")
    skipped = []
    sources = ((ROOT / "hub_cards", "published maps (hub_cards/)"), (cached, f"{calibrated} (kept in {cached})"))
    for folder, note in sources:
        try:
            maps = find_maps(model, ADAPTERS, [str(folder)]) if folder.is_dir() else None
        except PeftKVCacheError as err:
            skipped.append(f"{folder}: {err}")
            continue
        if maps is not None and all(a in maps.to_adapter and a in maps.to_base for a in ADAPTERS):
            return model, tokenizer, maps, note + "".join(f"; not used: {s}" for s in skipped)
        why = "; ".join(f"{a}{' -> base' if reverse else ''}: {w}" for (a, reverse), w in maps.missing.items()) if maps else ""
        skipped.append(f"{folder}: " + (why or "no complete set of maps"))
    print(f"no usable maps ({skipped}); calibrating on {calibration_files} stdlib files ...", flush=True)
    maps = calibrate_missing(model, tokenizer, ADAPTERS, AdapterMaps(), files=calibration_files)
    maps.save_pretrained(cached, PREFIX)
    return model, tokenizer, maps, f"{calibrated} (saved to {cached})" + "".join(f"; not used: {s}" for s in skipped)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    index = (len(values) - 1) * q
    low, high = int(index), min(int(index) + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (index - low)


def summary(records: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in records]
    switches = [r["ttft"] for r in records if r["turn"] > 0]  # every later turn switches the adapter
    generated = sum(r["completion_tokens"] for r in records)
    compute = [r["compute_ttft"] for r in records]
    return {"requests": len(records), "ttft_p50": percentile(ttft, 0.5), "ttft_p95": percentile(ttft, 0.95),
            "compute_ttft_p50": percentile(compute, 0.5), "compute_ttft_p95": percentile(compute, 0.95),
            "switch_ttft_p50": percentile(switches, 0.5) if switches else None,
            "switch_ttft_p95": percentile(switches, 0.95) if switches else None,
            "wall_seconds": wall, "generated_tokens": generated, "tokens_per_second": generated / wall,
            "cached_fraction": sum(r["cached"] for r in records) / sum(r["prompt_tokens"] for r in records),
            "sources": {s: sum(r["source"] == s for r in records) for s in sorted({r["source"] for r in records})}}


@torch.no_grad()
def prefill_logprobs(model, adapter, prompt: tuple) -> torch.Tensor:
    """The first reply token's log-probabilities after a full prefill of ``prompt`` (what (c) computes)."""
    with adapter_active(model, adapter):
        logits = model(input_ids=torch.tensor([prompt]), logits_to_keep=1).logits[0, -1]
    return logits.float().log_softmax(-1)


def quality(model, tokenizer, mode: str, records: dict, engines: dict) -> dict:
    """Replies and first-token distributions of ``mode`` against (c) on the same script and prompts."""
    same = [x["reply"] == c["reply"] for x, c in zip(records[mode], records["c"])]
    shared = []  # leading reply tokens in common, as a share of the longer reply
    for x, c in zip(records[mode], records["c"]):
        a, b = (tokenizer(r["reply"], add_special_tokens=False).input_ids for r in (x, c))
        common = next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b)))
        shared.append(common / max(len(a), len(b), 1))
    kls, agree, by_source = [], [], {}
    for (adapter, prompt), logprobs in engines[mode].first_logprobs.items():
        reference = engines["c"].first_logprobs.get((adapter, prompt))
        if reference is None:
            reference = prefill_logprobs(model, adapter, prompt)
        kls.append(max(0.0, float((reference.exp() * (reference - logprobs)).sum())))  # -1e-9 is rounding
        agree.append(int(reference.argmax()) == int(logprobs.argmax()))
        kind = "base" if adapter is None else "adapter"
        by_source.setdefault(f"{kind}, {engines[mode].sources[(adapter, prompt)]}", []).append(kls[-1])
    return {"reply_agreement": sum(same) / len(same), "replies_compared": len(same),
            "reply_common_prefix": statistics.fmean(shared),
            "first_token_kl_mean": statistics.fmean(kls), "first_token_kl_max": max(kls),
            "first_token_top1_agreement": sum(agree) / len(agree), "prompts_compared": len(kls),
            "first_token_kl_by_source": {k: {"mean": statistics.fmean(v), "count": len(v)}
                                         for k, v in sorted(by_source.items())}}


def markdown(args, stats: dict, ratios: dict, qualities: dict, maps_note: str) -> str:
    lines = ["# peft-kvcache serve: load benchmark", "",
             f"{args.conversations} concurrent conversations x {args.turns} turns (the adapter changes at every turn: "
             f"base / shout / docstring rotated), {args.max_tokens} new tokens max, greedy, streamed, "
             f"SmolLM2-135M-Instruct on CPU ({torch.get_num_threads()} threads), 127.0.0.1. TTFT from the openai "
             f"client: request sent -> first content chunk, queueing behind other conversations included.", "",
             f"Maps: {maps_note}.", "",
             "| server | TTFT p50 (s) | TTFT p95 (s) | switch TTFT p50 (s) | compute TTFT p50 / p95 (s) | tokens/s | "
             "cached prompt tokens | replies equal to (c)'s | common reply prefix | first-token KL vs (c) | "
             "first-token top-1 vs (c) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in MODES:
        s, q = stats[key], qualities.get(key)
        quality_cells = (f"{q['reply_agreement']:.2f} ({q['replies_compared']} turns) | "
                         f"{q['reply_common_prefix']:.2f} | "
                         f"{q['first_token_kl_mean']:.4f} (max {q['first_token_kl_max']:.4f}) | "
                         f"{q['first_token_top1_agreement']:.2f}") if q else "- | - | - | -"
        lines.append(f"| {LABELS[key]} | {s['ttft_p50']:.3f} | {s['ttft_p95']:.3f} | {s['switch_ttft_p50']:.3f} | "
                     f"{s['compute_ttft_p50']:.3f} / {s['compute_ttft_p95']:.3f} | {s['tokens_per_second']:.1f} | "
                     f"{s['cached_fraction']:.0%} | {quality_cells} |")
    lines += ["", "| ratio | TTFT p50 | TTFT p95 | switch TTFT p50 | compute TTFT p50 | compute TTFT p95 | "
              "throughput |",
              "|---|---|---|---|---|---|---|"]
    for name, r in ratios.items():
        lines.append(f"| {name} | {r['ttft_p50']:.2f} | {r['ttft_p95']:.2f} | {r['switch_ttft_p50']:.2f} | "
                     f"{r['compute_ttft_p50']:.2f} | {r['compute_ttft_p95']:.2f} | {r['tokens_per_second']:.2f} |")
    lines += ["", "Context sources per server: " + "; ".join(f"({k}) {stats[k]['sources']}" for k in MODES) + ".",
              "TTFT: from the client, queueing behind the other conversations' requests included (one model, one "
              "request at a time); compute TTFT: the server's, less that wait. "
              "TTFT ratios below 1 and throughput ratios above 1 favour (a). Replies equal to (c)'s: share of turns "
              "whose greedy reply is (c)'s on the same script (a diverging reply changes the later prompts); common "
              "reply prefix: leading reply tokens shared with (c)'s, as a share of the longer reply; KL(c || x) and "
              "top-1 agreement of the first reply token on the same prompt.", "",
              "First-token KL vs (c) by request kind and context source (mean, count): " + "; ".join(
                  f"({key}) " + ", ".join(f"{k}: {v['mean']:.4f} x{v['count']}"
                                          for k, v in qualities[key]["first_token_kl_by_source"].items())
                  for key in qualities) + "."]
    return "\n".join(lines)


def script_arguments(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    """The load script's size and the threads: what every load benchmark takes."""
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--threads", type=int, default=2)


def main(argv=None) -> int:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    script_arguments(parser, max_tokens=48)
    parser.add_argument("--calibration-files", type=int, default=16)
    parser.add_argument("--time-limit", type=float, default=900, help="seconds all three load runs may take")
    parser.add_argument("--min-mapped-tokens", type=int, default=0, help="the servers' threshold for mapping (default "
                        "0: every switch mapped, as the committed results were measured before the threshold existed; "
                        "the server's own default is peft_kvcache.runtime.reuse.MIN_MAPPED_TOKENS)")
    parser.add_argument("--output", type=Path, default=RESULTS / "serve-load")
    args = parser.parse_args(argv)
    from peft_kvcache.serving.app import create_app
    from peft_kvcache.serving.hosting import running

    torch.set_num_threads(args.threads)
    conversations = scripts(args.conversations, args.turns)
    model, tokenizer, maps, maps_note = load_stack(args.calibration_files)
    shared = SharedPeftModel(model, maps)
    name = "smollm2"
    deadline = time.monotonic() + args.time_limit
    records, stats, engines = {}, {}, {}
    for key, (mode, keep_base) in MODES.items():
        engines[key] = RecordingEngine(shared, PrefixStore(2 * 2**30), reuse=mode, keep_base=keep_base,
                                       min_mapped_tokens=args.min_mapped_tokens)
        with running(create_app(engines[key], tokenizer, name, args.max_tokens)) as url:
            warm = [[(None, "Hello")]]
            load_run(url, warm, name, 2, deadline)  # not timed: first-call allocations
            engines[key].store.clear()
            engines[key].first_logprobs.clear()
            records[key], wall = load_run(url, conversations, name, args.max_tokens, deadline)
        stats[key] = summary(records[key], wall)
        print(f"{LABELS[key]}: {stats[key]}", flush=True)
    ratios = {f"{a}/{other}": {k: stats[a][k] / stats[other][k] for k in
                               ("ttft_p50", "ttft_p95", "switch_ttft_p50", "compute_ttft_p50", "compute_ttft_p95",
                                "tokens_per_second")}
              for a in ("a", "a'") for other in "bc"}
    qualities = {key: quality(model, tokenizer, key, records, engines) for key in ("a", "a'", "b")}
    text = markdown(args, stats, ratios, qualities, maps_note)
    print(text)
    payload = {"setup": {"model": SMOLLM, "adapters": list(ADAPTERS), "conversations": args.conversations,
                         "turns": args.turns, "max_tokens": args.max_tokens, "maps": maps_note, "modes": MODES,
                         "min_mapped_tokens": args.min_mapped_tokens},
               "summary": stats, "ratios": ratios, "quality": qualities, "requests": records}
    write_results(args.output, payload, text, data={"script": "evaluation-split stdlib modules (first 1200 chars) "
                                                              "and two of their documented functions each",
                                                    "conversations": conversations}, seeds={})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
