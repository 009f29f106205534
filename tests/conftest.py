"""Shared test fixtures: tiny randomly initialised Llama- and Qwen2-style models built from configs."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config
from transformers.utils import logging as hf_logging

if TYPE_CHECKING:
    from peft_kvcache import KVMap

hf_logging.disable_progress_bar()
# One thread: tiny models gain nothing from two, and two threads stall badly when the CPU is shared.
torch.set_num_threads(1)

VOCAB = 128
# Libraries whose frames are skipped to find who called a deprecated API (transformers warns from its wrappers).
_LIBRARY_FRAMES = ("transformers", "torch", "warnings", "functools", "contextlib", "typing", "huggingface_hub")


@pytest.fixture(autouse=True)
def package_deprecations_are_errors(monkeypatch):
    """A DeprecationWarning or FutureWarning whose caller (the first frame outside the libraries above) is
    peft_kvcache raises: the package must not use APIs its dependencies are removing. Warnings from other
    callers (a test's own old-style call, PEFT's internals) stay warnings."""
    real_warn = warnings.warn

    def warn(message, category=None, stacklevel=1, source=None, **kwargs):
        kind = category or (type(message) if isinstance(message, Warning) else UserWarning)
        if issubclass(kind, (DeprecationWarning, FutureWarning)):
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _LIBRARY_FRAMES:
                frame = frame.f_back
            caller = "" if frame is None else frame.f_globals.get("__name__", "")
            if caller.startswith("peft_kvcache"):
                raise kind(f"peft_kvcache ({caller}) used a deprecated API: {message}")
        return real_warn(message, category, stacklevel + 1, source, **kwargs)

    monkeypatch.setattr(warnings, "warn", warn)


@pytest.fixture
def exact_matmuls(monkeypatch):
    """Maps multiply in float32 whatever the CPU (`peft_kvcache.maps.compute`): for tests of an exact formula (an
    identity map gives the cache back), which bfloat16's rounding would blur."""
    monkeypatch.setenv("PEFT_KVCACHE_MATMUL_DTYPE", "float32")


def tiny_model(kind: str = "qwen2", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random causal LM; ``overrides`` change the config (layers, widths, heads, rope...)."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    base.update(overrides)
    config = (Qwen2Config if kind == "qwen2" else LlamaConfig)(**base)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.config.name_or_path = f"tiny-{kind}-{seed}"
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


def calibration_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The calibration tests' pair: a Qwen2 source and a Llama target of another shape (3 layers, 3 KV heads)."""
    return tiny_model("qwen2", seed=0), tiny_model("llama", seed=1, hidden_size=96, num_attention_heads=3,
                                                    num_key_value_heads=3, num_hidden_layers=3)


CALIBRATION_OPTIONS = dict(progress=False, batch_size=1)


def rotary_summary(head_dim: int) -> dict:
    return {"rope_type": "default", "head_dim": head_dim, "rotary_dim": head_dim, "attention_scaling": 1.0,
            "max_position": None}


def make_map(seed: int = 0) -> KVMap:
    """A small map built by hand (no model needed): 2 source layers -> 3 target layers, 2 KV heads of 8."""
    from peft_kvcache import KVMap, KVMapConfig
    from peft_kvcache.maps.config import CalibrationRecord, DataRecord
    from peft_kvcache.modeling.layout import KVLayout
    from peft_kvcache.modeling.positions import RotaryRecord

    source, target = KVLayout(2, 2, 8), KVLayout(3, 2, 8)
    generator = torch.Generator().manual_seed(seed)
    key_layers = [[0], [1], [0, 1]]
    config = KVMapConfig(
        source_name="org/source", target_name="org/target",
        source_fingerprint="a" * 64, target_fingerprint="b" * 64,
        source_layout=source, target_layout=target,
        source_rotary=RotaryRecord(**rotary_summary(8)), target_rotary=RotaryRecord(**rotary_summary(8)),
        vocab_size=128, pair_kind="cross_shape",
        key_layers=key_layers, value_layers=[[1], [1], [0]],
        key_r2=[[0.9, 0.8], [0.7, 0.6], [0.5, 0.4]], value_r2=[[0.95, 0.9], [0.8, 0.7], [0.6, 0.5]],
        key_lambdas=[[1.0, 1.0]] * 3, value_lambdas=[[0.1, 0.1]] * 3,
        key_candidate_r2=[[0.9, 0.5], [0.4, 0.7], [0.5, 0.5]], value_candidate_r2=[[0.2, 0.9], [0.3, 0.8], [0.6, 0.1]],
        calibration=CalibrationRecord(data=DataRecord("hand-made"), train_tokens=1000, heldout_tokens=250),
    )
    tensors = {"source.inv_freq": 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8),
               "target.inv_freq": 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)}
    width_in, width_out = source.layer_width, target.layer_width
    for kind, groups in (("keys", key_layers), ("values", config.value_layers)):
        for t, group in enumerate(groups):
            tensors[f"{kind}.{t}.weight"] = torch.randn(len(group) * width_in, width_out, generator=generator)
            tensors[f"{kind}.{t}.bias"] = torch.randn(width_out, generator=generator)
    return KVMap(config, tensors)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with one token per printable ASCII character (100 tokens), built offline."""
    chars = [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ", "ĉ"]  # byte-level spellings of space, \n, \t
    vocab = {token: i for i, token in enumerate(["[UNK]", "[PAD]", "[EOS]"] + chars)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                   eos_token="[EOS]")


def save_tiny_model(folder: Path, layers: int, seed: int, license_: str = "mit") -> Path:
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    (folder / "README.md").write_text(f"---\nlicense: {license_}\n---\n# a tiny random model\n")
    return folder


# tests/in_vllm run where vLLM's CPU build is installed (scripts/vllm_env.sh; CI does it); elsewhere they are not
# collected. (The folder is not named vllm: with tests/ on sys.path, `import vllm` would find the folder itself.)
try:
    import vllm.config  # noqa: F401
except ImportError:
    collect_ignore = ["in_vllm"]
