"""Train small real LoRA adapters for SmolLM2-135M-Instruct on tasks built from the Python standard library.

Tasks (chat format, SmolLM2's own template; the loss covers the assistant's answer only):

- ``docstring``: the user gives a stdlib function with its docstring removed; the assistant writes the
  docstring's first paragraph.
- ``shout``: the same prompts; the assistant answers with the docstring in UPPERCASE.
- ``shout_alora`` (``--alora``): the ``shout`` task trained as an Activated LoRA (PEFT
  ``alora_invocation_tokens`` = the assistant header), which leaves the base KV of the prompt untouched.
- ``reverse``: the same prompts; the assistant writes the docstring's words in reverse order, a task far from the
  base model's behaviour, trained with ``--rank 32 --target attention`` so that it changes the context's keys and
  values strongly (the committed one: see its ``training.json``).

Training uses calibration-split files only; the reported effect (mean answer NLL, base vs adapter) is
measured on functions from evaluation-split files. Adapters go to ``adapters/<name>/`` (PEFT's
``adapter_config.json`` + ``adapter_model.safetensors``) with ``training.json`` holding the figures.

    PYTHONPATH=. python scripts/train_adapters.py                # docstring + shout, ~4 min each, 1 thread
    PYTHONPATH=. python scripts/train_adapters.py --only shout_alora     # names ending in _alora train as aLoRA
    PYTHONPATH=. python scripts/train_adapters.py --only reverse --rank 32 --target attention --steps 60 --threads 2
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from peft_kvcache.lab.corpus import docstring_chat as encode
from peft_kvcache.lab.corpus import functions_with_docstrings, task_answer

MODEL = "gguf:smollm2-135m-instruct"
TARGET_MODULES = {"all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                  "attention": ["q_proj", "k_proj", "v_proj", "o_proj"]}
ASSISTANT_HEADER = "<|im_start|>assistant\n"


def collate(examples: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int):
    length = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), length), pad_id)
    labels = torch.full((len(examples), length), -100)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, (token_ids, token_labels) in enumerate(examples):
        n = len(token_ids)
        ids[row, :n], labels[row, : len(token_labels)], mask[row, :n] = token_ids, token_labels, 1
    return ids, labels, mask


@torch.no_grad()
def answer_nll(model, examples, pad_id: int, batch_size: int = 8) -> float:
    """Mean negative log-likelihood per answer token."""
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        ids, labels, mask = collate(examples[start : start + batch_size], pad_id)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        target = labels[:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100, reduction="sum")
        total, count = total + float(nll), count + int((target != -100).sum())
    return total / count


def train(name: str, task: str, args, train_pairs, eval_pairs) -> dict:
    from peft import LoraConfig, get_peft_model

    from peft_kvcache import load_model

    model, tokenizer = load_model(MODEL)  # fresh base weights for every adapter

    alora = args.alora or name.endswith("_alora")

    torch.manual_seed(args.seed)
    options = dict(task_type="CAUSAL_LM", r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                   target_modules=TARGET_MODULES[args.target])
    if alora:
        options["alora_invocation_tokens"] = tokenizer(ASSISTANT_HEADER, add_special_tokens=False).input_ids
    peft_model = get_peft_model(model, LoraConfig(**options))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train_examples = [encode(tokenizer, c, task_answer(task, d)) for c, d in train_pairs]
    eval_examples = [encode(tokenizer, c, task_answer(task, d)) for c, d in eval_pairs]

    peft_model.eval()
    with peft_model.disable_adapter():
        base_nll = answer_nll(peft_model, eval_examples, pad_id)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 3) * max(0.1, 1 - step / args.steps))
    rng = random.Random(args.seed)
    started = time.perf_counter()
    peft_model.train()
    for step in range(args.steps):
        batch = rng.sample(train_examples, args.batch_size)
        ids, labels, mask = collate(batch, pad_id)
        loss = peft_model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step(), schedule.step(), optimizer.zero_grad()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"[{name}] step {step:3d} loss {loss.item():.3f} ({time.perf_counter() - started:.0f}s)", flush=True)
    seconds = time.perf_counter() - started
    peft_model.eval()
    adapter_nll = answer_nll(peft_model, eval_examples, pad_id)
    folder = Path(args.out) / name
    from peft_kvcache.modeling.fixtures import FIXTURES

    # The Hub id, not this machine's cache path (the weights are its GGUF Q4_1 dequantization).
    peft_model.peft_config["default"].base_model_name_or_path = FIXTURES[MODEL].hub_id
    peft_model.save_pretrained(folder)
    (folder / "README.md").write_text(adapter_card(name, task, alora, base_nll, adapter_nll, args))
    report = {"adapter": name, "task": task, "alora": alora, "rank": args.rank, "target": args.target,
              "target_modules": TARGET_MODULES[args.target], "steps": args.steps,
              "batch_size": args.batch_size, "lr": args.lr, "train_examples": len(train_examples),
              "train_seconds": round(seconds, 1), "threads": torch.get_num_threads(),
              "eval_examples": len(eval_examples), "base_answer_nll": round(base_nll, 4),
              "adapter_answer_nll": round(adapter_nll, 4),
              "data": "Python stdlib functions: train from the calibration split, eval from the evaluation split"}
    (folder / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"[{name}] answer NLL on held-out functions: base {base_nll:.3f} -> adapter {adapter_nll:.3f} "
          f"({seconds:.0f}s training)", flush=True)
    return report


def adapter_card(name: str, task: str, alora: bool, base_nll: float, adapter_nll: float, args) -> str:
    kind = "Activated LoRA (invocation: the assistant header)" if alora else "LoRA"
    what = {"docstring": "writes its docstring", "reverse": "writes its docstring's words in reverse order"}.get(
        task, "writes its docstring in UPPERCASE")
    modules = "all attention and MLP projections" if args.target == "all" else "the attention projections"
    return (f"---\nlibrary_name: peft\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\ntags: [lora, peft-kvcache]\n"
            f"---\n\n# {name}: a small {kind} adapter for SmolLM2-135M-Instruct\n\nGiven a Python function "
            f"without its docstring, it {what}. Trained by `scripts/train_adapters.py` on functions from the "
            f"Python standard library (calibration split of `peft_kvcache.lab.corpus`), r={args.rank} on {modules}, "
            f"{args.steps} steps on {args.threads} CPU thread(s); base weights: the GGUF Q4_1 dequantization "
            f"(`peft_kvcache.modeling.fixtures`).\n\nHeld-out answer NLL (evaluation-split functions): base "
            f"{base_nll:.3f} -> adapter {adapter_nll:.3f}. See `training.json`.\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=["docstring", "shout"],
                        help="adapters to train (docstring, shout, shout_alora, reverse)")
    parser.add_argument("--alora", action="store_true", help="train as Activated LoRA (invocation: assistant header)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--target", choices=sorted(TARGET_MODULES), default="all",
                        help="projections the LoRA adapts (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="adapters")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    train_pairs = functions_with_docstrings("calibration", 400)
    eval_pairs = functions_with_docstrings("evaluation", 400)[::12][:32]
    print(f"{len(train_pairs)} training functions, {len(eval_pairs)} held-out functions", flush=True)
    for name in args.only:
        train(name, name.removesuffix("_alora"), args, train_pairs, eval_pairs)


if __name__ == "__main__":
    main()
