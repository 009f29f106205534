"""The far-fact recall examples the sibling benchmarks score: the answer is the value as the context states it, token
for token, so a model can copy it (a real tokenizer: SmolLM2's, which merges a space into the next word as Qwen's does)."""

import pytest
import torch
from transformers import AutoTokenizer

from benchmarks.tasks import ANSWER_TOKENS, recall_examples
from peft_kvcache.modeling.fixtures import converted_path, fixture_available

SMOLLM = "gguf:smollm2-135m-instruct"
pytestmark = pytest.mark.skipif(not fixture_available(SMOLLM),
                                reason="run `python -m peft_kvcache.modeling.fixtures` first")
FILLER = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(200))


def _holds(example: torch.Tensor, tokens: torch.Tensor, before: int) -> bool:
    """Whether ``tokens`` occur, in order and side by side, in ``example[:before]``."""
    return any(torch.equal(example[i:i + len(tokens)], tokens) for i in range(before - len(tokens) + 1))


@pytest.mark.parametrize("prose", [False, True], ids=["code", "prose"])
def test_the_scored_answer_is_the_value_as_the_context_states_it(prose):
    tokenizer = AutoTokenizer.from_pretrained(converted_path(SMOLLM))
    fillers = {f"f{i}.txt": FILLER for i in range(8)}
    examples, _ = recall_examples(tokenizer, fillers, 400, 8, 0.5, prose=prose, seed=0)
    for example in examples:
        answer = example[-ANSWER_TOKENS:]
        assert _holds(example, answer, len(example) - ANSWER_TOKENS - 5), tokenizer.convert_ids_to_tokens(answer)
        assert len(example) <= 400 + ANSWER_TOKENS
    starts = tokenizer.convert_ids_to_tokens([int(e[-ANSWER_TOKENS]) for e in examples])
    assert any(s[0].isalpha() or s[1:2].isalpha() for s in starts)  # a value starting with a letter is among them
