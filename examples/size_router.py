"""A conversation routed between Qwen2.5-Coder 0.5B (easy turns) and 1.5B (hard turns), switching through
mapped caches in both directions instead of re-running prefill over the history.

    python examples/size_router.py

Rule: a turn that asks to write or fix code goes to the 1.5B, anything else to the 0.5B. Each model keeps
its own cache of the conversation; on a switch the other model's cache is mapped (maps from hub_cards/,
calibrated on the fly if missing). Per turn it prints the time to first token with the mapped cache and
with a full re-prefill, and whether their first tokens agree; with `--refresh K` (default 32, 0: off) also
the mapped cache refreshed by the target (the new turn probes it and the K history positions it attends
to most are recomputed: `peft_kvcache.refresh`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from peft_kvcache import KVMap, MappedCache
from peft_kvcache.corpus import calibration_texts
from peft_kvcache.fixtures import load_model

CARDS = Path(__file__).resolve().parent.parent / "hub_cards"
MAPS = {("small", "large"): "qwen2.5-coder-0.5b-to-1.5b-top2", ("large", "small"): "qwen2.5-coder-1.5b-to-0.5b-top2"}
TURNS = [
    "What does a Python list comprehension do? One sentence.",
    "Write a function that returns the n-th Fibonacci number iteratively.",
    "Thanks. Is it O(n)?",
    "Fix this: def add(a, b): return a - b",
]


def route(message: str) -> str:
    return "large" if any(w in message.lower() for w in ("write", "fix", "implement", "refactor")) else "small"


def get_map(models, source: str, target: str, tokenizer) -> KVMap:
    folder = CARDS / MAPS[(source, target)]
    if folder.is_dir():
        return KVMap.from_pretrained(folder)
    print(f"(no published map in {folder}; calibrating a small one on the fly)")
    return KVMap.calibrate(models[source], models[target], calibration_texts(8), tokenizer=tokenizer,
                           top_k=2, max_length=256)


@torch.no_grad()
def first_token_after_prefill(model, ids):
    started = time.perf_counter()
    logits = model(ids, logits_to_keep=1).logits[0, -1]
    return int(logits.argmax()), time.perf_counter() - started


@torch.no_grad()
def first_token_after_switch(source_cache, kv_map, model, ids, **options):
    started = time.perf_counter()
    cache = MappedCache.from_source(source_cache, kv_map, model, input_ids=ids[:, :-1], **options)
    logits = model(ids[:, -1:], past_key_values=cache, logits_to_keep=1,
                   position_ids=torch.tensor([[ids.shape[1] - 1]])).logits[0, -1]
    return int(logits.argmax()), time.perf_counter() - started


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refresh", type=int, default=32, help="history positions the target recomputes (0: off)")
    args = parser.parse_args()
    small, tokenizer = load_model("gguf:qwen2.5-coder-0.5b-instruct")
    large, _ = load_model("gguf:qwen2.5-coder-1.5b-instruct")
    models = {"small": small, "large": large}
    maps = {pair: get_map(models, *pair, tokenizer) for pair in MAPS}
    messages, previous = [], None
    for turn, text in enumerate(TURNS, 1):
        messages.append({"role": "user", "content": text})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        active = route(text)
        model = models[active]
        line = f"turn {turn} -> {active:5s} ({ids.shape[1]} tokens of history)"
        if previous is not None and previous != active:
            # The previous model already holds this context (minus the new turn): map its cache.
            started = time.perf_counter()
            source_cache = models[previous](ids[:, :-1], use_cache=True).cache  # stands in for its live cache
            setup = time.perf_counter() - started
            mapped_token, mapped_s = first_token_after_switch(source_cache, maps[(previous, active)], model, ids)
            full_token, full_s = first_token_after_prefill(model, ids)
            line += (f": TTFT mapped {mapped_s:.2f}s vs re-prefill {full_s:.2f}s ({full_s / mapped_s:.1f}x); "
                     f"first tokens {'agree' if mapped_token == full_token else 'differ'} "
                     f"({tokenizer.decode([mapped_token])!r} / {tokenizer.decode([full_token])!r})")
            if args.refresh:
                # the new turn (everything after the history the source model already had) is the probe
                history = tokenizer.apply_chat_template(messages[:-1], return_tensors="pt", return_dict=True)
                probe = min(ids.shape[1] - history["input_ids"].shape[1], ids.shape[1] - 3)
                token, seconds = first_token_after_switch(source_cache, maps[(previous, active)], model, ids,
                                                          refresh_tokens=args.refresh, probe_tokens=probe)
                line += (f"; refreshed ({args.refresh} positions, {probe}-token probe) {seconds:.2f}s "
                         f"({full_s / seconds:.1f}x), first tokens {'agree' if token == full_token else 'differ'}")
            line += f" [source cache rebuilt for the demo in {setup:.1f}s, not counted]"
        elif previous is None:
            line += ": first turn, ordinary prefill"
        else:
            line += ": same model as before, its cache continues"
        out = model.generate(ids, max_new_tokens=40, do_sample=False)
        reply = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        print(line)
        print(f"   {active}: {reply.strip()[:160]!r}")
        previous = active


if __name__ == "__main__":
    main()
