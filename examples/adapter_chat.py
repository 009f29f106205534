"""A chat with SmolLM2-135M-Instruct that switches LoRA adapters turn by turn without re-prefilling the history.

The user first shares a ~1.5k-token module; then each turn is answered by the base model or one of the committed
adapters (``docstring`` writes a function's docstring, ``shout`` writes it in capitals). The session keeps the
base model's cache of the conversation and, on a switch, maps it into the next adapter's KV space with the
published map (hub_cards/), so the adapter computes only the new message. For every mapped switch it prints the
time to first token against a full re-prefill of the conversation under that adapter (what a serving stack whose
prefix cache is keyed by adapter does), and how many of the first greedy tokens agree with that re-prefill, for
the mapped cache and for the base cache reused as is (naive reuse).

    python examples/adapter_chat.py        # about a minute on 2 CPU cores; the model comes from a PyPI wheel
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from peft_kvcache import (
    AdapterMaps,
    AdapterSession,
    MappedCache,
    SharedPeftModel,
    adapter_active,
    load_adapters,
    run_with_cache,
)
from peft_kvcache.lab.corpus import DOCSTRING_INSTRUCTION, functions_with_docstrings, stdlib_texts, token_ids
from peft_kvcache import load_model

ROOT = Path(__file__).resolve().parents[1]
COMPARE = 8  # first greedy tokens compared with the adapter's own re-prefill


def script() -> list[tuple[str | None, str]]:
    """(adapter, user message) per turn; code comes from held-out (evaluation-split) stdlib files."""
    module = next(iter(stdlib_texts("evaluation", 1).values()))[:6000]
    functions = functions_with_docstrings("evaluation", 200)
    return [
        (None, f"Here is a module from Python's standard library:\n```python\n{module}\n```\nWhat is it for? "
               "Answer in two sentences."),
        ("docstring", DOCSTRING_INSTRUCTION.format(code=functions[3][0])),
        ("shout", DOCSTRING_INSTRUCTION.format(code=functions[40][0])),
        ("shout", "Now say what the first function in this conversation returns."),
        ("docstring", DOCSTRING_INSTRUCTION.format(code=functions[77][0])),
        (None, "Thanks! In one sentence, what did we talk about?"),
    ]


def user_ids(tokenizer, message: str, history: torch.Tensor) -> torch.Tensor:
    """The templated user turn continuing ``history`` (the system prompt only at the start)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)
    if history.numel():
        text = text.split("<|im_end|>\n", 1)[1]  # drop the system prompt
        text = ("\n" if int(history[0, -1]) == tokenizer.convert_tokens_to_ids("<|im_end|>") else "<|im_end|>\n") + text
    return token_ids(tokenizer, text)[None]


@torch.no_grad()
def reference(model, prompt: torch.Tensor, adapter: str, **generation) -> tuple[torch.Tensor, float]:
    """The adapter's own full re-prefill of the whole conversation: first tokens and time to the first one."""
    with adapter_active(model, adapter):
        started = time.perf_counter()
        first = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=1,
                               do_sample=False, pad_token_id=generation["pad_token_id"])
        seconds = time.perf_counter() - started
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **generation)
    assert torch.equal(out[:, : first.shape[1]], first)
    return out[:, prompt.shape[1]:], seconds


@torch.no_grad()
def naive(model, base_cache_ids: torch.Tensor, prompt: torch.Tensor, adapter: str, **generation) -> torch.Tensor:
    """What a prefix cache that ignores the adapter does: the base model's cache of the history, reused as is."""
    with adapter_active(model, None):
        cache = MappedCache(run_with_cache(model, base_cache_ids))
    with adapter_active(model, adapter):
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), cache=cache, **generation)
    return out[:, prompt.shape[1]:]


def agree(a: torch.Tensor, b: torch.Tensor) -> str:
    k = min(COMPARE, a.shape[1], b.shape[1])
    return f"{int((a[0, :k] == b[0, :k]).sum())}/{k}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print("loading SmolLM2-135M-Instruct, its adapters and their published maps ...", flush=True)
    base, tokenizer = load_model("gguf:smollm2-135m-instruct")
    model = load_adapters(base, {name: ROOT / "adapters" / name for name in ("docstring", "shout")})
    maps = AdapterMaps.from_pretrained(ROOT / "hub_cards", model, ["docstring", "shout"])
    generation = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    session = AdapterSession(SharedPeftModel(model, maps), **generation)
    reference(model, user_ids(tokenizer, "Hello", session.ids), "docstring", **generation)  # warm-up, not timed

    print(f"\n{'turn':>4} {'adapter':>9} {'history':>7} {'context from':>13} {'TTFT':>8} {'re-prefill':>10} "
          f"{'speedup':>7}  {'first ' + str(COMPARE) + ' tokens agree: mapped / naive reuse'}")
    speedups, mapped_agree, naive_agree = [], 0, 0
    for i, (adapter, message) in enumerate(script()):
        new = user_ids(tokenizer, message, session.ids)
        prompt = torch.cat([session.ids, new], 1)
        history = session.ids
        turn = session.turn(new, adapter=adapter)
        line = f"{i:>4} {adapter or 'base':>9} {history.shape[1]:>7} {turn.context_source:>13} {turn.first_token_seconds:>7.3f}s"
        if turn.context_source == "mapped":  # a switch: compare with what a serving stack would do
            own, full_seconds = reference(model, prompt, adapter, **generation)
            reused = naive(model, prompt[:, : turn.cached_tokens], prompt, adapter, **generation)
            speedups.append(full_seconds / turn.first_token_seconds)
            mapped_agree += int(agree(turn.new_ids, own).split("/")[0])
            naive_agree += int(agree(reused, own).split("/")[0])
            line += (f" {full_seconds:>9.3f}s {speedups[-1]:>6.1f}x  {agree(turn.new_ids, own)} / {agree(reused, own)}")
        print(line)
        reply = tokenizer.decode(turn.new_ids[0], skip_special_tokens=True).strip().replace("\n", " ")
        print(f"     {adapter or 'base'}: {reply[:150]}", flush=True)
    print(f"\n{len(speedups)} adapter switches over a history of {session.ids.shape[1]} tokens: time to first token "
          f"{statistics.median(speedups):.1f}x faster than re-prefilling (median); first {COMPARE} tokens agreeing with "
          f"the adapter's own re-prefill: {mapped_agree}/{COMPARE * len(speedups)} with the mapped cache, "
          f"{naive_agree}/{COMPARE * len(speedups)} reusing the base cache as is.")


if __name__ == "__main__":
    main()
