"""A conversation routed between Qwen2.5-Coder 0.5B (easy turns) and 1.5B (hard turns), switching through mapped
caches in both directions instead of re-running prefill over the history.

    python examples/size_router.py

Rule: a turn that asks to write or fix code goes to the 1.5B, anything else to the 0.5B. On a switch the other
model's cache of the history is mapped with the published map (hub_cards/), which applies its recommended refresh
by default (the new turn probes the mapped cache and the target recomputes the history positions it needs). Per
switch it prints the time to first token against a full re-prefill and whether their first tokens agree. A map
whose weights are not here (the 0.5B -> 1.5B map's file is over the size kept in git: see the README) is named
once, and its switches re-run prefill.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from peft_kvcache import KVMap, MappedCache, run_with_cache
from peft_kvcache import load_model

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


@torch.no_grad()
def first_token(model, ids: torch.Tensor, cache=None) -> tuple[int, float]:
    """The model's first new token and the seconds to it: over ``cache`` (the history) or a full prefill."""
    started = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                         **({} if cache is None else {"cache": cache}))
    return int(out[0, -1]), time.perf_counter() - started


@torch.no_grad()
def main() -> None:
    torch.set_num_threads(2)
    small, tokenizer = load_model("gguf:qwen2.5-coder-0.5b-instruct")
    large, _ = load_model("gguf:qwen2.5-coder-1.5b-instruct")
    models = {"small": small, "large": large}
    maps = {pair: KVMap.from_pretrained(CARDS / name) for pair, name in MAPS.items()
            if (CARDS / name / "model.safetensors").is_file()}
    for pair in MAPS.keys() - maps.keys():
        print(f"{MAPS[pair]}: no weights in {CARDS / MAPS[pair]} (kept out of git); {pair[0]} -> {pair[1]} re-prefills")
    messages, previous = [], None
    for turn, text in enumerate(TURNS, 1):
        messages.append({"role": "user", "content": text})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        active = route(text)
        model = models[active]
        line = f"turn {turn} -> {active:5s} ({ids.shape[1]} tokens)"
        if previous is not None and previous != active and (previous, active) in maps:
            # the previous model holds this history; here it is rebuilt for the demo (not timed)
            source_cache = run_with_cache(models[previous], ids[:, :-1])
            started = time.perf_counter()
            cache = MappedCache.from_source(source_cache, maps[(previous, active)], model, input_ids=ids[:, :-1])
            token, _ = first_token(model, ids, cache)
            mapped_seconds = time.perf_counter() - started  # mapping, sink, refresh and the first token
            full_token, full_seconds = first_token(model, ids)
            line += (f": switch {mapped_seconds:.2f}s vs re-prefill {full_seconds:.2f}s "
                     f"({full_seconds / mapped_seconds:.1f}x); first tokens {'agree' if token == full_token else 'differ'} "
                     f"({tokenizer.decode([token])!r} / {tokenizer.decode([full_token])!r})")
        elif previous is None:
            line += ": first turn, ordinary prefill"
        elif previous != active:
            line += ": no map here, ordinary prefill"
        else:
            line += ": same model as before, its cache continues"
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        reply = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        print(line)
        print(f"   {active}: {reply.strip()[:160]!r}")
        previous = active


if __name__ == "__main__":
    main()
