"""Helpers of the chat server tests: a tiny PEFT stack with a chat template, and an `openai` client."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import torch
from conftest import char_tokenizer, tiny_model
from peft import get_peft_model
from test_peft import lora

# One token per character; every turn closed by [EOS], so a reply (which ends on [EOS] or at max_tokens)
# re-rendered in the next request extends the ids a session holds.
TEMPLATE = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<a>{% endif %}")
VOCAB = 100  # the char tokenizer's size
SINK = 4  # > the "<u>" every conversation starts with: a session's first catch-up prefills, as the server's does


def tiny_tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def tiny_peft(seed: int = 0):
    """A tiny Llama (vocabulary = the char tokenizer's) with adapters ``first`` and ``second`` of real effect.
    [UNK] and [PAD] get zero logits so greedy replies decode to the ids they were made of."""
    base = tiny_model("llama", seed=seed, vocab_size=VOCAB)
    with torch.no_grad():
        base.lm_head.weight[:2] = 0
    model = get_peft_model(base, lora(10), adapter_name="first")
    model.add_adapter("second", lora(11, 0.5))
    return model.eval()


def calibration_ids(count: int = 16, length: int = 48, seed: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=generator) for _ in range(count)]


def client(url: str, **options):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60, **options)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def concurrently(work: Callable[[int], object], count: int, timeout: float = 120) -> dict[int, object]:
    """``{i: work(i)}`` for ``i < count``, each in its own thread, all at once; an error in any is raised here, and
    every thread is waited for at most ``timeout`` seconds."""
    results, errors = {}, []

    def run(i: int) -> None:
        try:
            results[i] = work(i)
        except Exception as err:  # raised below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    if errors or len(results) < count:
        raise AssertionError(f"{count - len(results)} of {count} did not finish: {errors}")
    return results
