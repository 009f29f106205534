"""Evaluation tasks on text never used for calibration: next-token continuation of held-out files, and recall
of a value stated far back in a long context (at its top, middle or end), on code and on prose."""

from __future__ import annotations

import random

import torch

from peft_kvcache.lab.corpus import token_ids

# The context a recall value is hidden in: where in it (share of the context before the value).
DEPTHS = {"top": 0.02, "middle": 0.5, "end": 0.85}
ANSWER_TOKENS = 5


def continuation_examples(tokenizer, texts: dict[str, str], context: int, continuation: int,
                          count: int) -> tuple[list[torch.Tensor], list[str]]:
    """The first ``context + continuation`` tokens of the first ``count`` texts that are that long, and their names."""
    examples, names = [], []
    for name, text in texts.items():
        ids = token_ids(tokenizer, text)
        if ids.numel() >= context + continuation:
            examples.append(ids[: context + continuation])
            names.append(name)
        if len(examples) == count:
            break
    return examples, names


def question_and_answer(tokenizer, asked: str, answer: str) -> tuple[list[int], list[int]]:
    """``asked`` and the first `ANSWER_TOKENS` of ``answer`` tokenized together, as a model reads the whole text: the
    answer starts at the first token that covers one of its characters. A space the tokenizer merges into the answer's
    first token (``" k"``) is the answer's, as it was where the context stated the value; tokenized apart, the answer
    would start with a token (``"k"`` after a lone ``" "``) the context never holds, which no model can copy."""
    encoded = tokenizer(asked + answer, add_special_tokens=False, return_offsets_mapping=True)
    first = next(i for i, (_, end) in enumerate(encoded["offset_mapping"]) if end > len(asked))
    return encoded["input_ids"][:first], encoded["input_ids"][first:first + ANSWER_TOKENS]


def recall_examples(tokenizer, fillers: dict[str, str], context: int, count: int, depth: float, prose: bool = False,
                    seed: int = 0) -> tuple[list[torch.Tensor], list[str]]:
    """``count`` contexts of about ``context`` tokens: a filler text with a random 10-character value stated at
    ``depth`` (share of the filler before it) and asked for at the end; each example ends with the value's first
    `ANSWER_TOKENS` tokens, which are scored. Code states ``NAME_TOKEN = "value"`` and asks
    ``assert NAME_TOKEN == "``; prose states and asks in sentences. Returns the examples and the fillers' names."""
    rng = random.Random(seed)
    usable = [(name, tokenizer(text, add_special_tokens=False).input_ids) for name, text in fillers.items()]
    usable = [(name, ids) for name, ids in usable if len(ids) >= context]
    examples, names = [], []
    for name, filler in usable:
        if len(examples) == count:
            break
        key = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(6))
        value = "".join(rng.choice("abcdefghijkmnpqrstuvwxyz0123456789") for _ in range(10))
        if prose:
            stated = f"\n\nNote: the access code of project {key} is {value}.\n\n"
            asked = f"\n\nQuestion: what is the access code of project {key}?\nAnswer: the access code of project {key} is "
        else:
            stated, asked = f'\n{key}_TOKEN = "{value}"\n\n', f'\n\nassert {key}_TOKEN == "'
        head = tokenizer(stated, add_special_tokens=False).input_ids
        question, answer = question_and_answer(tokenizer, asked, value + ('.' if prose else '"'))
        if len(answer) < ANSWER_TOKENS:
            continue
        body = filler[: context - len(head) - len(question)]
        cut = int(depth * len(body))
        examples.append(torch.tensor(body[:cut] + head + body[cut:] + question + answer))
        names.append(name)
    if len(examples) < count:
        raise ValueError(f"only {len(examples)} fillers have {context} tokens; {count} recall examples were asked for")
    return examples, names
