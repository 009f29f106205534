"""Shared test fixtures: tiny randomly initialised Llama- and Qwen2-style models built from configs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()
# One thread: tiny models gain nothing from two, and two threads stall badly when the CPU is shared.
torch.set_num_threads(1)

VOCAB = 128


def tiny_model(kind: str = "qwen2", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random causal LM; ``overrides`` change the config (layers, widths, heads, rope...)."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    base.update(overrides)
    config = (Qwen2Config if kind == "qwen2" else LlamaConfig)(**base)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.config._name_or_path = f"tiny-{kind}-{seed}"
    return model


def random_ids(count: int, length: int, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=generator) for _ in range(count)]


@pytest.fixture(params=["llama", "qwen2"])
def same_model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def sibling_pair():
    """A source and a differently shaped target (depth, width, head_dim and KV heads all differ)."""
    source = tiny_model("qwen2", seed=0)
    target = tiny_model("qwen2", seed=1, hidden_size=96, num_hidden_layers=3, num_attention_heads=3,
                        num_key_value_heads=3, intermediate_size=160)
    return source, target


@pytest.fixture(scope="session")
def sibling_map(sibling_pair):
    from peft_kvcache import KVMap

    source, target = sibling_pair
    return KVMap.calibrate(source, target, random_ids(12, 48), progress=False)
