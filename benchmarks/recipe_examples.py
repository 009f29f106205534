"""The sibling recipes' examples (`benchmarks.recipes`): continuation windows of the role's code files, each window's
tokens once, and recall cases per kind and depth, tasks interleaved so that a stopped run has some of every task."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from peft_kvcache.lab.corpus import prose_texts, stdlib_texts, token_ids

from . import siblings
from .tasks import ANSWER_TOKENS, DEPTHS, recall_examples

CONTINUATION = 128  # scored continuation tokens per window


@dataclass(frozen=True)
class Example:
    """One scored window: its id, the file it comes from (the bootstrap's cluster), its task and tokens."""

    id: str
    file: str
    task: str
    ids: torch.Tensor
    continuation: int

    @property
    def digest(self) -> str:
        """What its records carry of its tokens: a resumed run refuses records of the same id on other tokens."""
        return hashlib.sha256(self.ids.to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def distinct_texts(texts: dict[str, str]) -> dict[str, str]:
    """``texts`` with each text once, under its first name (the same file under two paths is one file to a bootstrap
    that resamples files, for continuation windows and recall fillers alike).

    Example:
        >>> distinct_texts({"a.py": "x = 1", "b/a.py": "x = 1", "c.py": "y = 2"})
        {'a.py': 'x = 1', 'c.py': 'y = 2'}
    """
    kept, seen = {}, set()
    for name, text in texts.items():
        if text not in seen:
            seen.add(text)
            kept[name] = text
    return kept


def examples(tokenizer, role: str, context: int, windows: int, per_file: int, recall_cases: int) -> list[Example]:
    """The role's examples, tasks interleaved (a stopped run has some of every task): up to ``windows`` continuation
    windows of ``context + CONTINUATION`` tokens, at most ``per_file`` per file, none repeating another's tokens or
    text; and ``recall_cases`` recall examples per kind (code, prose) and depth."""
    (code_from, code_to), (prose_from, prose_to) = siblings.ROLES[role]["code"], siblings.ROLES[role]["prose"]
    code = distinct_texts(stdlib_texts("evaluation", code_to - code_from, code_from))
    seen: set[str] = set()
    by_task: dict[str, list[Example]] = {"continuation": []}
    length = context + CONTINUATION
    for name, text in code.items():
        ids = token_ids(tokenizer, text)
        for start in range(0, min(per_file, ids.numel() // length) * length, length):
            window = ids[start:start + length]
            digest = hashlib.sha256(window.numpy().tobytes()).hexdigest()
            if len(by_task["continuation"]) < windows and digest not in seen:
                seen.add(digest)
                by_task["continuation"].append(Example(f"continuation/{name}@{start}", name, "continuation",
                                                       window, CONTINUATION))
    if recall_cases:
        prose = distinct_texts(prose_texts(prose_to - prose_from, prose_from))
        for seed, (depth_name, depth) in enumerate(DEPTHS.items()):
            for kind, fillers in (("code", code), ("prose", prose)):
                task = f"recall-{kind}-{depth_name}"
                ids, names = recall_examples(tokenizer, fillers, context, recall_cases, depth, kind == "prose",
                                             seed=seed)
                by_task[task] = [Example(f"{task}/{n}", n, task, x, ANSWER_TOKENS) for x, n in zip(ids, names)]
    order = sorted((i, t) for t, items in by_task.items() for i in range(len(items)))
    return [by_task[t][i] for i, t in order]
