"""The traffic of the vLLM load benchmark (`benchmarks.vllm_load`), one function per experiment, each on a server
already started (`benchmarks.vllm_servers`). Every text comes from the evaluation split of the standard-library
corpus (disjoint from every map's calibration text); every request is greedy."""

from __future__ import annotations

import collections
import random
import threading
import time

from peft_kvcache.lab.corpus import stdlib_texts

from .serve_load import functions, load_run
from .vllm_servers import ADAPTERS, NAME, ask, ask_labelled, client

ROTATION = (None, *ADAPTERS)  # the model of each turn, rotated: every turn switches
THRESHOLD_LENGTHS = (128, 256, 512, 1024)
PAUSE = 0.5  # seconds between a history and the request that follows it (own_versus_mapped)


def modules(history_chars: int) -> list[str]:
    """Evaluation-split modules of at least ``history_chars`` characters with two short documented functions."""
    return [t for t in stdlib_texts("evaluation", 83).values() if len(t) >= history_chars and len(functions(t)) == 2]


def turn_messages(text: str, history_chars: int) -> list[str]:
    first, second = functions(text)
    return [f"Here is part of a module from Python's standard library:\n```python\n{text[:history_chars]}\n```\n"
            "What is this code for?",
            f"Write the docstring of this function:\n```python\n{first}\n```",
            "What does that function return?",
            f"Write the docstring of this function:\n```python\n{second}\n```"]


def scripts(texts: list[str], turns: int, history_chars: int) -> list[list[tuple[str | None, str]]]:
    """(adapter, message) per turn, one conversation per text: a module shared first with the base model (1,500+
    tokens), then docstring requests and follow-ups; the model changes at every turn: base, an adapter (rotated from
    the text's place, so that the first switches of the first conversations go to every adapter), base, the next."""
    out = []
    for i, text in enumerate(texts):
        messages = turn_messages(text, history_chars)
        out.append([(None if t % 2 == 0 else ADAPTERS[(i + t // 2) % len(ADAPTERS)], messages[t % len(messages)])
                    for t in range(turns)])
    return out


def warm_up(url: str) -> None:
    """One short request to the base model (untimed): first-call allocations. It teaches the connector nothing about
    any adapter: the first switch to each is as cold as after any start."""
    ask(client(url), NAME, [{"role": "user", "content": "Hello"}], 2, logprobs=False)


def fallback_counts(url: str) -> dict[str, int]:
    """The connector's fallbacks since the server started, by reason (`parse_fallbacks` of its ``/metrics``)."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
        return parse_fallbacks(reply.read().decode())


def parse_fallbacks(exposition: str) -> dict[str, int]:
    """The ``vllm:peft_kvcache_fallbacks`` counter of a Prometheus text exposition, summed by reason over its other
    labels (engines, models); empty without the connector."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == "vllm:peft_kvcache_fallbacks_total":
                reason = sample.labels["reason"]
                counts[reason] = counts.get(reason, 0) + int(sample.value)
    return counts


def mark_cold(records: list[dict]) -> list[dict]:
    """``cold``: the first request to its adapter since the server started (by the time it was sent)."""
    seen = set()
    for r in sorted(records, key=lambda r: r["started"]):
        r["cold"] = r["adapter"] is not None and r["adapter"] not in seen
        seen.add(r["adapter"])
    return records


def conversations(url: str, script, max_tokens: int, deadline: float, starts: list[float] | None = None):
    """The conversations of ``script`` at once (closed loop) or beginning at ``starts`` (open loop): per-turn records
    (TTFT, token arrivals, first-token top log-probabilities, usage, ``cold``) and the wall time."""
    def turn(api, model, messages):
        return {"messages": list(messages), **ask(api, model, messages, max_tokens)}

    records, wall = load_run(url, script, NAME, max_tokens, deadline, turn, starts)
    return mark_cold(records), wall


def poisson_starts(count: int, rate: float, seed: int) -> list[float]:
    """Arrival times (seconds) of ``count`` conversations as a Poisson process of ``rate`` per second."""
    generator, now, out = random.Random(seed), 0.0, []
    for _ in range(count):
        out.append(now)
        now += generator.expovariate(rate)
    return out


STREAM_CONDITIONS = {
    "none": "to the base model again, on a history it computed (the same load without switches)",
    "switch": "to an adapter, on a history the base model computed (a switch: the connector maps it)",
    "own": "to an adapter, on a history that adapter computed (its own prefix cache: no mapping, the same new tokens "
           "through the adapter)",
}


def streams(url: str, texts: list[str], history_chars: int, repetitions: int, background: int = 2,
            background_tokens: int = 384, foreground: int = 3, conditions: tuple[str, ...] = ("none", "switch")
            ) -> list[dict]:
    """Inter-token latency of ``background`` long base-model streams while ``foreground`` requests arrive one after
    another, each on a history computed before the streams began, as each of ``conditions`` says
    (`STREAM_CONDITIONS`), conditions alternating ``repetitions`` times. Returns per window the background streams'
    token gaps that fell inside it, the foreground TTFTs and cached prompt tokens, and the connector's fallbacks by
    reason during the window."""
    unknown = set(conditions) - set(STREAM_CONDITIONS)
    if unknown:
        raise ValueError(f"unknown stream conditions {sorted(unknown)}; known: {sorted(STREAM_CONDITIONS)}")
    api, out, k = client(url), [], 0
    for repetition in range(repetitions):
        for condition in conditions:
            histories, models = [], []
            for j in range(foreground):
                text = texts[k % len(texts)]
                k += 1
                model = NAME if condition == "none" else ADAPTERS[j % len(ADAPTERS)]
                history = [{"role": "user", "content": f"Window {repetition}-{condition}-{j}. "
                                                       + turn_messages(text, history_chars)[0]}]
                # the history's KV, stored / cached: the base model's, or (own) the adapter's
                ask(api, model if condition == "own" else NAME, history, 1, logprobs=False)
                models.append(model)
                histories.append(history + [{"role": "assistant", "content": "Part of the standard library."},
                                            {"role": "user", "content": turn_messages(text, history_chars)[1]}])
            arrivals: list[list[float]] = []

            def stream(i: int) -> None:
                reply = ask(client(url), NAME, [{"role": "user", "content": f"Count slowly, stream {i}: one, two,"}],
                            background_tokens, logprobs=False, ignore_eos=True)
                arrivals.append(reply["arrivals"])

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(background)]
            for thread in threads:
                thread.start()
            time.sleep(2.0)  # the streams are decoding
            before = fallback_counts(url)
            opened, replies = time.perf_counter(), []
            for model, messages in zip(models, histories):
                replies.append(ask(api, model, messages, 1, logprobs=False))
                time.sleep(0.5)
            closed = time.perf_counter()
            after = fallback_counts(url)
            for thread in threads:
                thread.join(600)
            gaps = [b - a for times in arrivals for a, b in zip(times, times[1:]) if opened <= a and b <= closed]
            out.append({"repetition": repetition, "condition": condition, "gaps": gaps,
                        "foreground_ttft": [reply["ttft"] for reply in replies],
                        "foreground_tokens": [[reply["prompt_tokens"], reply["cached"]] for reply in replies],
                        "fallbacks": dict(collections.Counter(after) - collections.Counter(before)),
                        "window_seconds": closed - opened})
    return out


def long_conversation(url: str, text: str, turns: int, history_chars: int, max_tokens: int) -> list[dict]:
    """One conversation switching at every turn (base and each adapter, rotated), whole responses with the
    connector's label: per turn the prompt tokens, how many were cached, the label and the first-token top list."""
    api, messages, out = client(url), [], []
    follow_ups = turn_messages(text, history_chars)[1:]
    for t in range(turns):
        messages.append({"role": "user", "content": turn_messages(text, history_chars)[0] if t == 0
                         else follow_ups[(t - 1) % len(follow_ups)] + f" (turn {t})"})
        adapter = ROTATION[t % len(ROTATION)]
        answer = ask_labelled(api, adapter or NAME, messages, max_tokens)
        out.append({"turn": t, "adapter": adapter, "messages": list(messages), **answer})
        messages.append({"role": "assistant", "content": answer["reply"]})
    return out


def references(url: str, prompts: list[dict]) -> list[dict]:
    """The exact first-token top lists of ``prompts`` (each with ``adapter`` and ``messages``) from a server without
    the connector (vLLM's own prefill)."""
    api = client(url)
    return [ask_labelled(api, p["adapter"] or NAME, p["messages"], 1)["top"] for p in prompts]


def switch_samples(texts: list[str], history_chars: int) -> list[dict]:
    """Single switches, one per held-out text and map (all six): a history (a module and an answer) computed by the
    map's source, then a docstring request to its target."""
    samples = []
    for i, text in enumerate(texts):
        history = [{"role": "user", "content": turn_messages(text, history_chars)[0]}]
        switch = history + [{"role": "assistant", "content": "It is part of Python's standard library."},
                            {"role": "user", "content": turn_messages(text, history_chars)[1]}]
        for adapter in ADAPTERS:
            for source, target in ((None, adapter), (adapter, None)):
                samples.append({"text": i, "source": source, "target": target, "history": history, "switch": switch})
    return samples


def switch_answers(url: str, samples: list[dict]) -> list[dict]:
    """Each sample's history by its source, then its switch (each sample with a cache salt of its own, so that no two
    share a block): the switch's first-token top list and cached tokens."""
    api, out = client(url), []
    for k, sample in enumerate(samples):
        salt = {"cache_salt": f"sample-{k}"}
        ask(api, sample["source"] or NAME, sample["history"], 1, logprobs=False, extra=salt)
        answer = ask(api, sample["target"] or NAME, sample["switch"], 1, extra=salt)
        out.append({"top": answer["top"], "cached": answer["cached"], "ttft": answer["ttft"]})
    return out


def own_versus_mapped(url: str, tokenizer, module: str, tokens: int, repeats: int) -> list[dict]:
    """At ``tokens`` of history, an adapter's reply TTFT when it continues (1) its own cached prefix (vLLM's prefix
    cache), (2) the base model's prefix mapped by the connector, (3) nothing (``reuse: none``, its own prefill); the
    first-token top lists of (2) and (3), which see the same prompt. Every timed request asks for the same top list,
    and each follows its history by ``PAUSE`` seconds (a user reading the reply; the history's copy into the store
    is done by then, as it would be)."""
    api, rows = client(url), []
    for k in range(repeats):
        def conversation(kind: str) -> tuple[list[dict], list[dict]]:
            ids = tokenizer(f"Session {tokens}-{k}-{kind}.\n{module}", add_special_tokens=False).input_ids[:tokens]
            history = [{"role": "user", "content": tokenizer.decode(ids) + "\nWhat is this?"}]
            return history, history + [{"role": "assistant", "content": "Python code."},
                                       {"role": "user", "content": "Summarise it in one line."}]

        history, follow = conversation("own")
        ask(api, ADAPTERS[0], history, 1, logprobs=False)
        time.sleep(PAUSE)
        own = ask(api, ADAPTERS[0], follow, 1)
        history, follow = conversation("switch")
        ask(api, NAME, history, 1, logprobs=False)
        time.sleep(PAUSE)
        mapped = ask(api, ADAPTERS[0], follow, 1)
        exact = ask(api, ADAPTERS[0], follow, 1, extra={"kv_transfer_params": {"peft_kvcache": {"reuse": "none"}},
                                                        "cache_salt": f"exact-{k}"})
        rows.append({"own_ttft": own["ttft"], "own_cached": own["cached"], "mapped_ttft": mapped["ttft"],
                     "mapped_cached": mapped["cached"], "prefill_ttft": exact["ttft"], "prefill_cached": exact["cached"],
                     "prompt_tokens": mapped["prompt_tokens"], "mapped_top": mapped["top"], "exact_top": exact["top"]})
    return rows


def threshold(url: str, tokenizer, module: str, repeats: int) -> list[dict]:
    """With the connector mapping any length: single switches mapping about L tokens against the same request
    prefilled (``reuse: none``), every TTFT."""
    api, rows = client(url), []
    for length in THRESHOLD_LENGTHS:
        mapped, prefilled = [], []
        for k in range(repeats):
            # a history of about `length` tokens that no earlier request shared (its first words differ)
            ids = tokenizer(f"Session {length}-{k}.\n{module}", add_special_tokens=False).input_ids[:length]
            messages = [{"role": "user", "content": tokenizer.decode(ids) + "\nWhat is this?"}]
            ask(api, NAME, messages, 1, logprobs=False)  # the base model's prefix, kept by the connector
            mapped.append(ask(api, ADAPTERS[0], messages, 1, logprobs=False)["ttft"])
            exact = {"kv_transfer_params": {"peft_kvcache": {"reuse": "none"}}}
            prefilled.append(ask(api, ADAPTERS[0], messages, 1, logprobs=False, extra=exact)["ttft"])
        rows.append({"tokens": length, "mapped_runs": mapped, "prefill_runs": prefilled})
    return rows
