"""The shortest prefix worth mapping: the server's ``--min-mapped-tokens`` default, measured.

A switch to an adapter can start from the base model's cache of the history (mapped into the adapter) or prefill
the history under the adapter. Mapping saves prefill, and drifts from the exact answer; for a short history it saves
little (the new tokens, the target's sink and generate()'s own overhead are paid either way), so below some length
the drift is not worth it. This measures, on SmolLM2-135M-Instruct with the committed adapters (shout, docstring)
and their published maps (hub_cards/), for mapped prefixes of ``--lengths`` tokens followed by ``--suffix`` new
tokens (the switch's new message):

- the time to first token of the switch served by `PrefixEngine` (what the server runs) by mapping the base
  model's cache of the prefix (``--min-mapped-tokens 0``; the target's sink memo cleared before every run: cold,
  and kept: warm) and by prefilling the whole prompt (``reuse="none"``), each the median [min, max] of
  ``--repeats`` runs on one text;
- the KL divergence KL(exact || mapped) of the first reply token's distribution, and how often the greedy first
  token is the same, over ``--texts`` held-out texts (the evaluation split of `peft_kvcache.lab.corpus`).

The recommended threshold is the smallest measured length from which on (that length and every longer one) the cold
mapped switch takes at most ``1 - SAVING`` of the prefill's median TTFT for every adapter: mapping must at least
halve the time to first token to be offered. `peft_kvcache.runtime.reuse.MIN_MAPPED_TOKENS` equals it
(tests/test_server_policy.py checks).

    python -m benchmarks.map_threshold                               # 16 .. 1024 tokens, 7 repeats, 8 texts
    python -m benchmarks.map_threshold --lengths 16 64 --repeats 2 --texts 2     # a smoke run (overwrites them)

Writes benchmarks/results/map-threshold.json and .md.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from peft_kvcache.lab.corpus import stdlib_texts, token_sequences
from peft_kvcache import load_model
from peft_kvcache.maps.adapter_maps import AdapterMaps
from peft_kvcache.modeling.adapters import adapter_active, load_adapters
from peft_kvcache.modeling.capture import run_with_cache
from peft_kvcache.runtime.target_sink import clear_target_sinks
from peft_kvcache.runtime.turn import SharedPeftModel
from peft_kvcache.serving.engine import PrefixEngine
from peft_kvcache.serving.store import PrefixStore

from .common import ROOT, SMOLLM, save, start_run, table, timed

PREFIX = "smollm2-135m-instruct"  # the published maps' folder prefix in hub_cards/
ADAPTERS = ("docstring", "shout")  # the committed adapters with published maps
SAVING = 0.5  # the share of the prefill's TTFT a mapped switch must save to be offered
LENGTHS = (16, 32, 64, 128, 256, 512, 1024)


class FirstScores(LogitsProcessor):
    """Keeps the scores of generate()'s first step (the output is unchanged)."""

    def __init__(self):
        self.scores: torch.Tensor | None = None

    def __call__(self, input_ids, scores):
        if self.scores is None:
            self.scores = scores[0].float().log_softmax(-1).cpu()
        return scores


def switch(engine: PrefixEngine, adapter: str, ids: torch.Tensor, base_kv, prefix: int, greedy: dict):
    """One switch: the store holds only the base model's cache of ``ids[:prefix]`` (``base_kv``); ``adapter`` answers
    ``ids`` with one token. Returns ``(TurnResult, first-step log-probabilities)``; nothing is kept after it."""
    engine.store.clear()
    if base_kv is not None:
        engine.store.add(None, ids[:prefix], base_kv.prefix(prefix))
    first = FirstScores()
    result = engine.run(adapter, ids, {**greedy, "logits_processor": LogitsProcessorList([first])},
                        cancelled=lambda: True)  # one token, then stop: no catch-up, nothing stored
    return result, first.scores


def measure(shared: SharedPeftModel, adapter: str, texts: list[torch.Tensor], prefix: int, suffix: int,
            repeats: int, greedy: dict) -> dict:
    """TTFT (mapped cold / warm, prefilled) on the first text, and first-token KL and agreement over all texts."""
    mapping = PrefixEngine(shared, PrefixStore(2**31), min_mapped_tokens=0)
    prefilling = PrefixEngine(shared, PrefixStore(2**31), reuse="none")
    model = shared.model

    def base_cache(ids):
        with adapter_active(model, None), torch.no_grad():
            return run_with_cache(model, ids[None, :prefix])

    def ttft(engine, ids, kv, before=None):
        seconds = []

        def once():
            result, _ = switch(engine, adapter, ids, kv, prefix, greedy)
            expected = "mapped" if engine is mapping else "prefilled"
            assert result.context_source == expected and result.cached_tokens == (prefix if kv is not None else 0)
            seconds.append(result.first_token_seconds)

        timed(once, repeats, warmup=1, before=before)
        runs = seconds[1:]  # the server's own first-token clock; the warm-up run dropped
        return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}

    ids = texts[0][: prefix + suffix]
    kv = base_cache(ids)
    row = {"adapter": adapter, "prefix_tokens": prefix, "suffix_tokens": suffix,
           "prefill": ttft(prefilling, ids, None), "mapped_cold": ttft(mapping, ids, kv, before=clear_target_sinks),
           "mapped_warm": ttft(mapping, ids, kv)}
    for kind in ("cold", "warm"):
        row[f"saving_{kind}"] = 1 - row[f"mapped_{kind}"]["median"] / row["prefill"]["median"]
    kls, same = [], []
    for text in texts:
        ids = text[: prefix + suffix]
        kv = base_cache(ids)
        mapped, mapped_scores = switch(mapping, adapter, ids, kv, prefix, greedy)
        exact, exact_scores = switch(prefilling, adapter, ids, None, prefix, greedy)
        kls.append(float((exact_scores.exp() * (exact_scores - mapped_scores)).sum()))
        same.append(int(mapped.new_ids[0, 0]) == int(exact.new_ids[0, 0]))
    row.update(kl_mean=statistics.fmean(kls), kl_median=statistics.median(kls), kl_max=max(kls),
               same_first_token=sum(same) / len(same), kl_per_text=kls)
    return row


def recommend(rows: list[dict], saving: float = SAVING) -> int | None:
    """The smallest length from which on every adapter's cold mapped switch saves at least ``saving`` of the TTFT."""
    lengths = sorted({r["prefix_tokens"] for r in rows})
    pays = {n: all(r["saving_cold"] >= saving for r in rows if r["prefix_tokens"] == n) for n in lengths}
    for i, n in enumerate(lengths):
        if all(pays[m] for m in lengths[i:]):
            return n
    return None


def run(lengths, suffix: int, repeats: int, num_texts: int, threads: int) -> dict:
    """Measure every (adapter, length); returns the payload."""
    torch.set_num_threads(threads)
    base, tokenizer = load_model(SMOLLM)
    model = load_adapters(base, {a: str(ROOT / "adapters" / a) for a in ADAPTERS})
    maps = AdapterMaps.from_pretrained(ROOT / "hub_cards", model, ADAPTERS, reverse=False)
    shared = SharedPeftModel(model, maps)
    need = max(lengths) + suffix
    texts = token_sequences(stdlib_texts("evaluation", 4 * num_texts).values(), tokenizer, need)[:num_texts]
    if len(texts) < num_texts:
        raise SystemExit(f"only {len(texts)} evaluation texts have {need} tokens; {num_texts} were asked for")
    greedy = {"max_new_tokens": 1, "do_sample": False, "pad_token_id": tokenizer.pad_token_id or 0}
    rows = []
    for prefix in lengths:
        for adapter in ADAPTERS:
            rows.append(measure(shared, adapter, texts, prefix, suffix, repeats, greedy))
            r = rows[-1]
            print(f"{adapter:>9} {prefix:>5}: prefill {r['prefill']['median']:.3f} s, mapped cold "
                  f"{r['mapped_cold']['median']:.3f} s ({r['saving_cold']:.0%} saved), KL {r['kl_mean']:.4f}",
                  flush=True)
    return {"setup": {"model": SMOLLM, "adapters": list(ADAPTERS), "maps": "published maps (hub_cards/)",
                      "lengths": list(lengths), "suffix_tokens": suffix, "repeats": repeats, "texts": num_texts,
                      "threads": threads, "saving_share": SAVING},
            "rows": rows, "recommended_min_mapped_tokens": recommend(rows)}


def markdown(payload: dict) -> str:
    setup, rows = payload["setup"], payload["rows"]

    def cell(timing: dict) -> str:
        return f"{timing['median']:.3f} [{timing['min']:.3f}, {timing['max']:.3f}] s"

    body = [[r["adapter"], r["prefix_tokens"], cell(r["prefill"]), cell(r["mapped_cold"]), cell(r["mapped_warm"]),
             f"{r['saving_cold']:.0%} / {r['saving_warm']:.0%}", f"{r['kl_mean']:.4f} ({r['kl_max']:.4f})",
             f"{r['same_first_token']:.2f}"] for r in rows]
    header = ["adapter", "mapped prefix", "TTFT prefilled", "TTFT mapped, cold sink", "TTFT mapped, warm sink",
              "TTFT saved cold / warm", "first-token KL mean (max)", "same first token"]
    recommended = payload["recommended_min_mapped_tokens"]
    verdict = (f"**Recommended `--min-mapped-tokens`: {recommended}** — the smallest measured prefix from which on "
               f"mapping saves at least {setup['saving_share']:.0%} of the time to first token (cold sink) for every "
               "adapter; shorter prefixes are prefilled exactly." if recommended is not None else
               f"No measured length saves {setup['saving_share']:.0%} of the TTFT for every adapter.")
    return (f"## The shortest prefix worth mapping ({setup['model']}, {', '.join(setup['adapters'])})\n\n"
            f"A switch served by `PrefixEngine` with the base model's cache of the prefix mapped into the adapter vs "
            f"the whole prompt prefilled; {setup['suffix_tokens']} new tokens after the prefix, one reply token. "
            f"TTFT: median [min, max] of {setup['repeats']} runs on one text, {setup['threads']} threads. KL: "
            f"KL(exact || mapped) of the first reply token over {setup['texts']} evaluation-split texts; maps: "
            f"{setup['maps']}.\n\n" + table(header, body) + "\n\n" + verdict + "\n")


def main(argv=None) -> int:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--suffix", type=int, default=16, help="new tokens after the mapped prefix")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--texts", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    payload = run(sorted(args.lengths), args.suffix, args.repeats, args.texts, args.threads)
    save("map-threshold", payload, markdown(payload),
         data={"texts": f"the first {args.texts} evaluation-split stdlib files with at least "
                        f"{max(args.lengths) + args.suffix} tokens"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
