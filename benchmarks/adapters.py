"""Base <-> adapter KV maps on SmolLM2-135M-Instruct with the committed adapters (adapters/docstring, shout, reverse).

1. Retention on held-out stdlib files (evaluation split): context C, continuation M, teacher-forced; full
   prefill under the adapter, mapped base cache (sink computed by the adapter), naive reuse of the unmapped
   base cache, window-only control, no context; KL(full || variant); paired 95% bootstrap intervals.
2. The adapters' own task (held-out docstring prompts): answer NLL and top-1 when the prompt's KV comes from
   the adapter's own prefill, the mapped base cache, or the base cache reused as is; Activated LoRA too.
   2b. The same task after a long chat (the function shared first, in a ~1k-token module, asked for by name at
   the end), also as `AdapterSession` switches (history mapped, the adapter computing the request).
3. Session policy after an adapter's turn: base prefill of the new tokens vs the reverse map.

    python -m benchmarks.adapters --maps hub_cards --output adapters

`scripts/publish.py` runs it on the maps it publishes. Writes only under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from peft_kvcache import AdapterMaps, AdapterSession, MappedCache, SharedPeftModel
from peft_kvcache.calibration.retention import RetentionReport, VariantScores, evaluate_retention, token_kl
from peft_kvcache.lab.corpus import DOCSTRING_INSTRUCTION as INSTRUCTION
from peft_kvcache.lab.corpus import docstring_chat as encode
from peft_kvcache.lab.corpus import corpus_description, functions_with_docstrings, stdlib_texts, task_answer, token_ids
from peft_kvcache import load_model
from peft_kvcache.maps.apply import map_cache
from peft_kvcache.maps.config import Refresh
from peft_kvcache.modeling.adapters import adapter_active, is_activated_lora, load_adapters
from peft_kvcache.modeling.capture import forward, run_with_cache
from peft_kvcache.modeling.layout import layer_placements

from .common import ADAPTERS, ROOT, SMOLLM, save, start_run, timed
from .tasks import continuation_examples

PREFIX = "smollm2-135m-instruct"
# the published maps' texts (scripts/publish.py): the first 512 tokens of CALIBRATION_FILES calibration-split files
# and CHATS docstring chats for the fit, the next BLEND_FILES files to choose each map's blend
CALIBRATION_FILES, CHATS, BLEND_FILES = 128, 8, 12


def results_stem(reverse: bool) -> str:
    """The results file (stem) of the base -> adapter maps' retention, or of the adapter -> base maps'."""
    return "adapters-reverse" if reverse else "adapters"


def load_smollm2(adapters: Sequence[str] = ADAPTERS):
    """SmolLM2-135M-Instruct with the committed adapters loaded by name: ``(peft_model, tokenizer)``."""
    base, tokenizer = load_model(SMOLLM)
    return load_adapters(base, {a: str(ROOT / "adapters" / a) for a in adapters}), tokenizer


def calibration_data(tokenizer) -> tuple[dict[str, torch.Tensor], str]:
    """The published adapter maps' fit data and its description: the first 512 tokens of CALIBRATION_FILES
    calibration-split files and CHATS chat-formatted docstring prompts of calibration-split functions."""
    data = {name: token_ids(tokenizer, text, 512) for name, text in stdlib_texts("calibration",
                                                                                CALIBRATION_FILES).items()}
    for i, (code, doc) in enumerate(functions_with_docstrings("calibration", 400)[-CHATS:]):
        data[f"chat:docstring-prompt-{i}"] = encode(tokenizer, code, doc)[0]
    return data, calibration_description()


def calibration_description() -> str:
    """How `calibration_data` describes the published adapter maps' fit data (what their configs record)."""
    return (f"{corpus_description('calibration', CALIBRATION_FILES)}; the first 512 tokens of each; plus "
            f"{CHATS} chat-formatted docstring prompts of calibration-split functions")


# ----- 1. retention -----

def held_out_examples(tokenizer, context: int, continuation: int, count: int) -> tuple[list[torch.Tensor], list[str]]:
    """The retention section's examples: the first ``context + continuation`` tokens of evaluation-split files."""
    return continuation_examples(tokenizer, stdlib_texts("evaluation", 83), context, continuation, count)


def retention(model, base, adapters, maps, sequences, context, continuation, refresh=(), reverse=False) -> dict:
    """Per adapter, the base -> adapter map (``reverse``: the adapter -> base map, the base continuing from the
    adapter's mapped cache) against naive reuse of the unmapped cache, on the same ``sequences``."""
    out = {}
    for adapter in adapters:
        model.set_adapter(adapter)
        started = time.perf_counter()
        source, target, kv_map = (model, base, maps.to_base[adapter]) if reverse else (base, model,
                                                                                       maps.to_adapter[adapter])
        report = evaluate_retention(source, target, kv_map, sequences, context, continuation, refresh=refresh,
                                    progress=False)
        out[adapter] = {"table": report.table(), **report.to_dict(),
                        "mapped_minus_naive_kl": report.paired_difference("mapped@1", "naive@1", metric="kl"),
                        "mapped_minus_naive_normalized": report.paired_difference("mapped@1", "naive@1"),
                        "seconds": round(time.perf_counter() - started, 1)}
        for k in refresh:  # the refreshed map against naive reuse and against the plain map
            for other in ("naive@1", "mapped@1"):
                out[adapter][f"mapped@1+r{k}_minus_{other}"] = {
                    metric: report.paired_difference(f"mapped@1+r{k}", other, metric=metric)
                    for metric in ("normalized", "kl")}
        print(f"\n## {adapter}{' -> base' if reverse else ''}\n{report.table()}", flush=True)
    return out


# ----- 2. task answers -----

@torch.no_grad()
def answer_nll(model, adapter, ids, labels, prompt_cache=None, cached=0) -> tuple[float, int, int]:
    """(summed NLL, top-1 hits, count) over the answer tokens."""
    with adapter_active(model, adapter):
        logits = forward(model, ids[None, cached:], prompt_cache, position_ids=torch.arange(cached, len(ids))[None],
                         logits_to_keep=0).logits[0]
    target = labels[cached + 1:]
    scored = target != -100
    hits = int((logits[:-1].argmax(-1) == target)[scored].sum())
    return float(F.cross_entropy(logits[:-1], target, ignore_index=-100, reduction="sum")), hits, int(scored.sum())


@torch.no_grad()
def task_answers(model, tokenizer, adapters, maps, examples: int) -> dict:
    """Answer NLL (and top-1 accuracy) per adapter when the prompt (all but its last token) comes from various
    caches."""
    pairs = functions_with_docstrings("evaluation", 400)[::12][:examples]
    out = {}
    for adapter in adapters:
        task = adapter.removesuffix("_alora")
        sums: dict[str, list[float]] = {}
        for code, doc in pairs:
            ids, labels = encode(tokenizer, code, task_answer(task, doc))
            prompt_len = int((labels == -100).sum())
            cut = prompt_len - 1  # cached prefix; the model computes the last prompt token itself
            if is_activated_lora(model, adapter):
                cut = prompt_len - 4  # the invocation tokens (assistant header) must be computed by the aLoRA
            variants = {"full prefill": (None, 0)}
            with adapter_active(model, None):
                base_kv = run_with_cache(model, ids[None, :cut])
            if adapter in maps.to_adapter:
                with adapter_active(model, adapter):
                    variants["mapped base cache"] = (
                        MappedCache.from_source(base_kv, maps.to_adapter[adapter], model, input_ids=ids[None, :cut]),
                        cut)
            variants["base cache reused as is"] = (MappedCache(base_kv), cut)
            scored = [(name, answer_nll(model, adapter, ids, labels, cache, cached))
                      for name, (cache, cached) in variants.items()]
            scored.append(("base model (no adapter)", answer_nll(model, None, ids, labels)))
            for name, (total, hits, count) in scored:
                sums.setdefault(name, [0.0, 0, 0])
                sums[name] = [sums[name][0] + total, sums[name][1] + hits, sums[name][2] + count]
        out[adapter] = {name: round(t / c, 4) for name, (t, _, c) in sums.items()}
        out[adapter]["accuracy"] = {name: round(h / c, 4) for name, (_, h, c) in sums.items()}
        out[adapter]["examples"] = len(pairs)
        print(adapter, out[adapter], flush=True)
    return out


def long_chat(tokenizer, kind: str, index: int, code: str, history_tokens: int) -> list[dict]:
    """The messages of a chat about ``history_tokens`` long that ends in a docstring request for ``code``.

    ``"module"``: the user first shares a module of held-out functions (without docstrings) that starts with
    ``code``, the assistant acknowledges it, and the request names the function: the answer depends on
    context ~``history_tokens`` back. ``"docstrings"``: earlier docstring requests answered with the reference
    docstring, then the request with the code (in-context examples of the task itself, which shrink the
    adapter's gain over the base model)."""
    others = functions_with_docstrings("evaluation", 400)[6::12]
    others = others[index % len(others):] + others[: index % len(others)]  # a different history each time
    request = {"role": "user", "content": INSTRUCTION.format(code=code)}
    turns, length = [], 0
    if kind == "module":
        functions = [code]
        for other, _ in others:
            if length >= history_tokens:
                break
            functions.append(other)
            length += len(tokenizer(other, add_special_tokens=False).input_ids)
        name = code.split("def ", 1)[1].split("(", 1)[0]
        module = "\n\n".join(functions)
        return [{"role": "user", "content": f"Here is the module I am working on:\n```python\n{module}\n```"},
                {"role": "assistant", "content": "Thanks, I have read it. What would you like me to do?"},
                {"role": "user", "content": f"Write the docstring of the function `{name}` in that module."}]
    for other, doc in others:
        if length >= history_tokens:
            break
        turn = [{"role": "user", "content": INSTRUCTION.format(code=other)}, {"role": "assistant", "content": doc}]
        turns += turn
        length += len(tokenizer.apply_chat_template(turn, tokenize=True, return_dict=False))
    return turns + [request]


def chat_ids(tokenizer, messages: list[dict], answer: str) -> tuple[torch.Tensor, int]:
    """Token ids of ``messages`` answered with ``answer``; and the prompt's length."""
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    answer_ids = tokenizer(answer + "<|im_end|>", add_special_tokens=False).input_ids
    return torch.tensor(prompt_ids + answer_ids), len(prompt_ids)


@torch.no_grad()
def task_with_history(model, tokenizer, adapters, maps, examples: int, history_tokens: int, kind: str = "module",
                      refresh: Sequence[int] = (), session: bool = False) -> dict:
    """The adapters' own task at the end of a long chat (`long_chat`): the answer tokens of a held-out
    docstring request are scored (teacher-forced) with the prompt's KV (all but its last token) from the
    adapter's own prefill, the mapped base cache (optionally refreshed), the base cache reused as is, and
    two anchors: the adapter given the last request alone ("no context"), and the base model.

    ``session`` adds what `AdapterSession` does at a switch: the history (all but the last request) from the
    mapped base cache or the base cache as is, the adapter computing the request itself."""
    finals = functions_with_docstrings("evaluation", 400)[::12][:examples]
    out = {}
    for adapter in adapters:
        task = adapter.removesuffix("_alora")
        alora = is_activated_lora(model, adapter)
        scores: dict[str, VariantScores] = {}
        lengths, answers, losses = [], [], {}
        for i, (code, doc) in enumerate(finals):
            answer = task_answer(task, doc)
            messages = long_chat(tokenizer, kind, i, code, history_tokens)
            ids, prompt_len = chat_ids(tokenizer, messages, answer)
            lengths.append(prompt_len)
            answers.append(len(ids) - prompt_len)
            cut = prompt_len - (4 if alora else 1)  # an aLoRA computes its invocation tokens itself
            # where the last request starts: in a session the history is mapped and the adapter computes the
            # new turn itself (`AdapterSession.turn`)
            history_ids = token_ids(tokenizer, tokenizer.apply_chat_template(messages[:-1], tokenize=False))
            history = len(history_ids)
            assert torch.equal(ids[:history], history_ids), "the history must tokenize as a prefix of the chat"
            labels = ids[prompt_len:]  # the answer; logits at prompt_len - 1 ... predict it
            with adapter_active(model, adapter):
                full = model(input_ids=ids[None]).logits[0, prompt_len - 1:-1]
            with adapter_active(model, None):
                base_kv = run_with_cache(model, ids[None, :cut])
                logits = {"base model": model(input_ids=ids[None]).logits[0, prompt_len - 1:-1]}
            caches = {"base cache reused as is": (MappedCache(base_kv), cut)}
            if session:
                caches["session: base history reused as is"] = (MappedCache(base_kv.prefix(history)), history)
            with adapter_active(model, adapter):
                if not alora:
                    caches["mapped base cache"] = (MappedCache.from_source(
                        base_kv, maps.to_adapter[adapter], model, input_ids=ids[None, :cut]), cut)
                    for k in refresh:
                        caches[f"mapped + refresh {k}"] = (MappedCache.from_source(
                            base_kv, maps.to_adapter[adapter], model, input_ids=ids[None, :cut],
                            refresh_tokens=Refresh(k, 1)), cut)
                    if session:
                        caches["session: mapped history"] = (MappedCache.from_source(
                            base_kv.prefix(history), maps.to_adapter[adapter], model, input_ids=ids[None, :history]),
                            history)
                for name, (cache, start) in caches.items():
                    logits[name] = forward(model, ids[None, start:-1], cache, logits_to_keep=0,
                                           position_ids=torch.arange(start, len(ids) - 1)[None]
                                           ).logits[0, prompt_len - 1 - start:]
                alone, alone_len = chat_ids(tokenizer, messages[-1:], answer)  # the last request alone
                logits["no_context"] = model(input_ids=alone[None]).logits[0, alone_len - 1:-1]
            for name, value in {"full": full, **logits}.items():
                scores.setdefault(name, VariantScores()).add(value, full, labels)
                losses[name] = losses.get(name, 0.0) + float(F.cross_entropy(value, labels, reduction="sum"))
        report = RetentionReport(scores, round(statistics.mean(lengths)), round(statistics.mean(answers)))
        anchors = {**scores, "no_context": scores["base model"]}  # the adapter's gain over the base model
        gain = RetentionReport(anchors, report.context_length, report.continuation_length)
        loss = {name: total / sum(answers) for name, total in losses.items()}
        out[adapter] = {"examples": len(finals), "history": kind, "mean_prompt_tokens": report.context_length,
                        "rows": report.rows(), "table": report.table(), "answer_loss": loss,
                        "gain_retention_in_loss": {name: (loss["base model"] - value) / (loss["base model"] - loss["full"])
                                                   for name, value in loss.items() if name not in ("full", "base model")},
                        "gain_retention": {name: {"value": float(gain.normalized(name)),
                                                  "interval": gain.interval(lambda idx, n=name: gain.normalized(n, idx))}
                                           for name in scores if name not in ("full", "base model", "no_context")}}
        pairs = {"mapped_minus_naive": ("mapped base cache", "base cache reused as is"),
                 "session_mapped_minus_naive": ("session: mapped history", "session: base history reused as is")}
        for key, (mapped, naive) in pairs.items():
            if mapped in scores:
                out[adapter][key] = {"gain_retention": gain.paired_difference(mapped, naive),
                                     "normalized": report.paired_difference(mapped, naive),
                                     "kl": report.paired_difference(mapped, naive, metric="kl")}
        print(f"\n## {adapter} (own task after ~{history_tokens} tokens of {kind} history)\n{report.table()}\n"
              f"{json.dumps(out[adapter]['gain_retention'])}", flush=True)
    return out


# ----- 3. session policy -----

def chat_script(tokenizer, turns: int):
    """A fixed chat: held-out docstring prompts as user turns, each with a reply, alternating adapters."""
    pairs = functions_with_docstrings("evaluation", 400)[5::12][:turns]
    order = ["docstring", "shout", None, "shout", "docstring", "shout", "docstring", None]
    script = []
    for i, (code, doc) in enumerate(pairs):
        user = tokenizer.apply_chat_template([{"role": "user", "content": f"Write the docstring of this Python "
                                                                          f"function:\n```python\n{code}\n```"}],
                                             tokenize=False, add_generation_prompt=True)
        if i:
            user = user.split("<|im_end|>\n", 1)[1]  # the system prompt only once, at the start
        adapter = order[i % len(order)]
        reply = task_answer(adapter or "docstring", doc) + "<|im_end|>\n"
        script.append((token_ids(tokenizer, user)[None], token_ids(tokenizer, reply)[None], adapter))
    return script


@torch.no_grad()
def session_policies(model, tokenizer, maps, turns: int) -> dict:
    shared = SharedPeftModel(model, maps)
    script = chat_script(tokenizer, turns)
    out = {}
    for policy in ("prefill", "reverse_map"):
        session = AdapterSession(shared, keep_base=policy)
        kls, agree, per_turn = [], [], []
        for user, reply, adapter in script:
            message = torch.cat([user, reply], 1)
            before = session.base_cached_tokens
            logits = session.feed(message, adapter=adapter)
            with adapter_active(model, adapter):
                full = model(input_ids=session.ids).logits[:, -message.shape[1]:]
            kl = token_kl(full[0], logits[0])
            kls.append(float(kl.mean()))
            agree.append(float((full[0].argmax(-1) == logits[0].argmax(-1)).float().mean()))
            per_turn.append({"adapter": adapter, "history": before, "new_tokens": message.shape[1],
                             "kl": round(kls[-1], 5), "top1_agreement": round(agree[-1], 4)})
        out[policy] = {"mean_kl": round(statistics.mean(kls), 5), "mean_top1_agreement": round(statistics.mean(agree), 4),
                       "turns": per_turn}
    # cost: catch up a 96-token turn after a 1k history, both ways
    out["catch_up_seconds"] = catch_up_cost(model, maps, tokenizer)
    print(json.dumps({k: (v if k == "catch_up_seconds" else {kk: vv for kk, vv in v.items() if kk != "turns"})
                      for k, v in out.items()}, indent=1), flush=True)
    return out


@torch.no_grad()
def catch_up_cost(model, maps, tokenizer, history: int = 1024, new: int = 96, repeats: int = 5) -> dict:
    """Seconds to bring the base cache up to date after ``new`` tokens of an adapter's turn: the base model's pass
    over them vs the reverse map of the adapter's KV (median of ``repeats``)."""
    ids = long_ids(tokenizer, history + new)
    adapter = "shout" if "shout" in maps.to_base else next(iter(maps.to_base))
    with adapter_active(model, None):
        base_kv = run_with_cache(model, ids[None, :history])
    with adapter_active(model, adapter):
        adapter_kv = run_with_cache(model, ids[None])
    positions = torch.arange(history, history + new)[None]

    def prefill():
        with adapter_active(model, None):
            forward(model, ids[None, history:], MappedCache(base_kv), position_ids=positions)

    def reverse():
        map_cache(maps.to_base[adapter], [k[:, :, history:] for k in adapter_kv.keys],
                  [v[:, :, history:] for v in adapter_kv.values], positions, positions, layer_placements(model))

    return {"history": history, "new_tokens": new, "base_prefill_of_new_tokens": timed(prefill, repeats),
            "reverse_map_of_new_tokens": timed(reverse, repeats)}


def long_ids(tokenizer, length: int) -> torch.Tensor:
    """``length`` tokens of held-out stdlib text (files concatenated)."""
    texts = stdlib_texts("evaluation", 40)
    return torch.cat([token_ids(tokenizer, t) for t in texts.values()])[:length]


def markdown(results: dict, reverse: bool = False) -> str:
    """The results as markdown; ``reverse``: they are of the adapter -> base maps."""
    title, maps = ("Adapter -> base", f"{PREFIX}-<adapter>-to-base") if reverse else ("Base -> adapter",
                                                                                     f"{PREFIX}-base-to-<adapter>")
    lines = [f"# {title} KV maps: SmolLM2-135M-Instruct with real LoRA adapters", "",
             f"Model {results['model']} (float32); the maps of `{maps}` (same-layer "
             "identity-prior ridge, sink computed by the target). Held-out text and provenance: the JSON beside this.", ""]
    if "retention" in results:
        lines += ["", "## Retention on held-out stdlib files (teacher-forced)", ""]
    for adapter, r in results.get("retention", {}).items():
        d, n = r["mapped_minus_naive_kl"], r["mapped_minus_naive_normalized"]
        lines += [f"### {adapter}", "", r["table"], "",
                  f"mapped - naive: KL {d['difference']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}], normalized "
                  f"retention {n['difference']:+.3f} [{n['low']:+.3f}, {n['high']:+.3f}] (paired 95% bootstrap).", ""]
    for adapter, r in results.get("task_history", {}).items():
        lines += [f"## The own task after a long chat ({r['history']} history, ~{r['mean_prompt_tokens']} prompt "
                  f"tokens): {adapter}", "", r["table"], "",
                  "Normalized retention of the adapter's gain over the base model, (variant - base model) / "
                  "(full - base model), top-1 accuracy on the answer tokens [95% bootstrap]: "
                  + "; ".join(f"{name} {g['value']:.3f} [{g['interval'][0]:.2f}, {g['interval'][1]:.2f}]"
                              for name, g in r["gain_retention"].items()), ""]
        if "answer_loss" in r:
            lines += ["Answer loss (nats/token): " + ", ".join(f"{n} {v:.4f}" for n, v in r["answer_loss"].items())
                      + "; retention of the adapter's gain in loss: "
                      + ", ".join(f"{n} {v:.3f}" for n, v in r["gain_retention_in_loss"].items()), ""]
        for key, label in (("mapped_minus_naive", "mapped - reused as is"),
                           ("session_mapped_minus_naive", "session: mapped history - base history reused as is")):
            if key in r:
                d, k = r[key]["gain_retention"], r[key]["kl"]
                lines += [f"{label}: gain retention {d['difference']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}], KL "
                          f"{k['difference']:+.4f} [{k['low']:+.4f}, {k['high']:+.4f}] (paired).", ""]
    if "task" not in results:
        return "\n".join(lines) + "\n"
    lines += ["## The adapters' own task: answer NLL on held-out docstring prompts", "",
              "The prompt's KV (all but its last token; for the aLoRA all but the invocation tokens) comes from "
              "each source; the adapter computes the rest.", ""]
    names = ["full prefill", "mapped base cache", "base cache reused as is", "base model (no adapter)"]
    lines += ["| adapter | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for adapter, row in results["task"].items():
        lines.append(f"| {adapter} | " + " | ".join(f"{row[n]:.4f}" if n in row else "n/a" for n in names) + " |")
    lines += ["", "Top-1 accuracy on the answer tokens, and normalized retention of the adapter's gain "
              "(variant - base model) / (full prefill - base model):", "",
              "| adapter | " + " | ".join(names) + " | normalized: mapped | normalized: reused as is |",
              "|---|" + "---|" * (len(names) + 2)]
    for adapter, row in results["task"].items():
        acc = row.get("accuracy", {})
        if not acc:
            continue
        gain = acc["full prefill"] - acc["base model (no adapter)"]
        norm = {n: (acc[n] - acc["base model (no adapter)"]) / gain if gain and n in acc else None
                for n in ("mapped base cache", "base cache reused as is")}
        lines.append(f"| {adapter} | " + " | ".join(f"{acc[n]:.4f}" if n in acc else "n/a" for n in names) + " | "
                     + " | ".join(f"{v:.3f}" if v is not None else "n/a" for v in norm.values()) + " |")
    if "session_policy" not in results:
        return "\n".join(lines) + "\n"
    s = results["session_policy"]
    lines += ["", "## Session policy: keeping the base cache after an adapter's turn", "",
              f"A scripted chat of {len(s['prefill']['turns'])} turns switching adapters (teacher-forced); every "
              "turn's logits with the session's cache vs full prefill under that turn's adapter.", "",
              "| policy | mean KL | mean top-1 agreement |", "|---|---|---|"]
    for policy in ("prefill", "reverse_map"):
        lines.append(f"| {policy} | {s[policy]['mean_kl']:.5f} | {s[policy]['mean_top1_agreement']:.4f} |")
    c = s["catch_up_seconds"]
    lines += ["", f"Cost of catching up {c['new_tokens']} new tokens after {c['history']} tokens of history (median): base "
              f"prefill {c['base_prefill_of_new_tokens']['median']:.3f} s, reverse map "
              f"{c['reverse_map_of_new_tokens']['median']:.3f} s.",
              "", "Per turn (KL):", "", "| turn | adapter | history | new | KL prefill | KL reverse_map |",
              "|---|---|---|---|---|---|"]
    for i, (a, b) in enumerate(zip(s["prefill"]["turns"], s["reverse_map"]["turns"])):
        lines.append(f"| {i} | {a['adapter'] or 'base'} | {a['history']} | {a['new_tokens']} | {a['kl']:.5f} | "
                     f"{b['kl']:.5f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maps", default=str(ROOT / "hub_cards"), help="folder holding the adapter map folders")
    parser.add_argument("--examples", type=int, default=48, help="held-out files for continuation")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--task-examples", type=int, default=34)
    parser.add_argument("--history-tokens", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--skip", nargs="*", default=[], choices=["retention", "task", "task_history", "session"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default="adapters")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2(ADAPTERS + ("shout_alora",))
    maps = AdapterMaps.from_pretrained(args.maps, model, ADAPTERS)
    results = run(model, tokenizer, maps, args)
    save(args.output, results, markdown(results), data=results.pop("data"))


def run(model, tokenizer, maps, args) -> dict:
    """Every section not in ``args.skip``; the held-out text each used is under ``data``."""
    base, _ = load_model(SMOLLM)
    examples, names = held_out_examples(tokenizer, args.context, args.continuation, args.examples)
    results = {"model": SMOLLM, "data": {"continuation": names, "docstring_prompts": "evaluation-split functions"}}
    if "retention" not in args.skip:
        results["retention"] = retention(model, base, list(maps.to_adapter), maps, examples, args.context,
                                         args.continuation)
    if "task" not in args.skip:
        results["task"] = task_answers(model, tokenizer, [*maps.to_adapter, "shout_alora"], maps, args.task_examples)
    if "task_history" not in args.skip:
        results["task_history"] = task_with_history(model, tokenizer, list(maps.to_adapter), maps, args.task_examples,
                                                    args.history_tokens, session=True)
    if "session" not in args.skip:
        results["session_policy"] = session_policies(model, tokenizer, maps, args.turns)
    return results


if __name__ == "__main__":
    main()
