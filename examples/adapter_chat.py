"""A scripted chat with SmolLM2-135M-Instruct that switches LoRA adapters turn by turn without re-prefilling.

Each turn is answered by the base model or one of the committed adapters (``docstring``: writes a
function's docstring; ``shout``: writes it in capitals). The session keeps the base model's cache of the
conversation and, on a switch, maps it into the next adapter's KV space with the published base -> adapter
map (hub_cards/), so the adapter computes only the new message. Per turn it prints the time to the first
token with the mapped cache and with a full re-prefill of the whole conversation under that adapter, and
whether their first tokens agree.

    PYTHONPATH=. python examples/adapter_chat.py        # a few minutes on 2 CPU cores, nothing to set up

The model comes from PyPI wheels (peft_kvcache.fixtures), the adapters from adapters/, the maps from
hub_cards/ (calibrated here and saved if missing or not matching).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from calibrate_adapter_maps import ensure_maps, load_peft_smollm2  # noqa: E402
from train_adapters import INSTRUCTION, functions_with_docstrings  # noqa: E402

from peft_kvcache.corpus import evaluation_texts  # noqa: E402
from peft_kvcache.peft_maps import adapter_active  # noqa: E402
from peft_kvcache.sessions import AdapterSession, SharedPeftModel, FirstTokenTimer  # noqa: E402

COMPARE = 8  # first tokens compared between the mapped cache and a full re-prefill


def script() -> list[tuple[str | None, str]]:
    """(adapter, user message) per turn; functions come from held-out (evaluation-split) stdlib files."""
    functions = functions_with_docstrings("evaluation", 400)
    module = evaluation_texts(1)[0][:3000]
    return [
        (None, f"Here is the start of a module from Python's standard library:\n```python\n{module}\n```\n"
               "What is this module for? Answer in two sentences."),
        ("docstring", INSTRUCTION.format(code=functions[3][0])),
        ("shout", INSTRUCTION.format(code=functions[40][0])),
        ("shout", "Now say what the first function in this conversation returns."),
        ("docstring", INSTRUCTION.format(code=functions[77][0])),
        (None, "Thanks! In one sentence, what did we talk about?"),
    ]


def user_ids(tokenizer, message: str, history: torch.Tensor) -> torch.Tensor:
    """The templated user turn, continuing ``history`` (the system prompt only at the start)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)
    if history.numel():
        text = text.split("<|im_end|>\n", 1)[1]  # drop the system prompt
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        text = ("\n" if int(history[0, -1]) == end else "<|im_end|>\n") + text
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


@torch.no_grad()
def full_reprefill(model, prompt: torch.Tensor, adapter: str | None, **generation) -> tuple[torch.Tensor, float]:
    """What a serving stack keyed by adapter does on a switch: prefill the whole conversation again."""
    started = time.perf_counter()
    streamer = FirstTokenTimer(started)
    with adapter_active(model, adapter):
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), streamer=streamer, **generation)
    return out[:, prompt.shape[1]:], streamer.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--keep-base", choices=["prefill", "reverse_map"], default="reverse_map")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print("loading SmolLM2-135M-Instruct and the adapters ...", flush=True)
    model, tokenizer, adapters = load_peft_smollm2()
    maps = ensure_maps(model, tokenizer, adapters)
    generation = dict(max_new_tokens=args.max_new_tokens, do_sample=False,
                      eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id)
    session = AdapterSession(SharedPeftModel(model, maps), keep_base=args.keep_base, **generation)
    warm = user_ids(tokenizer, "Hello", session.ids)
    full_reprefill(model, warm, None, max_new_tokens=2)  # warm-up, not timed

    print(f"\n{'turn':>4} {'adapter':>9} {'history':>7} {'cache':>12} {'TTFT mapped':>11} {'TTFT full':>9} "
          f"{'speedup':>7} {'first ' + str(COMPARE) + ' agree':>14}")
    for i, (adapter, message) in enumerate(script()):
        new = user_ids(tokenizer, message, session.ids)
        prompt = torch.cat([session.ids, new], 1)
        turn = session.turn(new, adapter=adapter)
        reference, full_seconds = full_reprefill(model, prompt, adapter, **generation)
        k = min(COMPARE, turn.new_ids.shape[1], reference.shape[1])
        agree = int((turn.new_ids[0, :k] == reference[0, :k]).sum())
        identical = torch.equal(turn.new_ids[0, :k], reference[0, :k])
        print(f"{i:>4} {adapter or 'base':>9} {prompt.shape[1] - new.shape[1]:>7} {turn.cache_source:>12} "
              f"{turn.first_token_seconds:>10.3f}s {full_seconds:>8.3f}s {full_seconds / turn.first_token_seconds:>6.1f}x "
              f"{agree:>4}/{k} {'same' if identical else 'differ':>6}")
        reply = tokenizer.decode(turn.new_ids[0], skip_special_tokens=True).strip().replace("\n", " ")
        print(f"     {adapter or 'base'}: {reply[:150]}", flush=True)
    print(f"\nconversation: {session.ids.shape[1]} tokens; the history was never prefilled again on a switch "
          f"(base cache kept by {args.keep_base!r})")


if __name__ == "__main__":
    main()
