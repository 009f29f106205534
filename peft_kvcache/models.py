"""Facts about a transformers (or PEFT) causal LM that a map depends on: its KV layout, the device and dtype
of each decoder layer, and a fingerprint of its weights."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch

from .errors import IncompatibleModelsError
from .positions import head_dim_of


@dataclass(frozen=True)
class KVLayout:
    """Shape of one model's KV cache: ``num_layers`` layers of ``[batch, kv_heads, seq, head_dim]``."""

    num_layers: int
    kv_heads: int
    head_dim: int

    @property
    def layer_width(self) -> int:
        """Features per token in one layer (all KV heads side by side)."""
        return self.kv_heads * self.head_dim

    @classmethod
    def of(cls, model: torch.nn.Module) -> "KVLayout":
        """Layout of a model from its config (``head_dim`` derived where the config leaves it unset)."""
        config = model.config
        return cls(
            num_layers=int(config.num_hidden_layers),
            kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
            head_dim=head_dim_of(config),
        )

    def to_dict(self) -> dict:
        return asdict(self)


def unwrap_peft(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a `PeftModel` (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's list of decoder layers (``model.model.layers`` for Llama/Qwen2-style models)."""
    decoder = unwrap_peft(model).get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise IncompatibleModelsError(f"cannot find the decoder layers of {type(decoder).__name__}")
    return layers


def layer_placements(model: torch.nn.Module) -> list[tuple[torch.device, torch.dtype]]:
    """(device, dtype) of each decoder layer, read from its own parameters, so that accelerate's
    ``device_map`` placement is honoured whether or not ``hf_device_map`` is set."""
    placements = []
    for layer in decoder_layers(model):
        weight = next(p for p in layer.parameters() if p.is_floating_point())
        placements.append((weight.device, weight.dtype))
    return placements


def model_name(model: torch.nn.Module) -> str:
    """Best human-readable id of a model: its Hub id or path, else its architecture."""
    config = unwrap_peft(model).config
    return getattr(config, "_name_or_path", "") or getattr(config, "model_type", type(model).__name__)


# A fixed number of evenly spaced weights per tensor: enough to tell models apart, cheap for any size.
_SAMPLES_PER_TENSOR = 64


def _canonical_name(name: str) -> str:
    """Parameter name independent of PEFT wrapping (``base_model.model.`` prefix, ``.base_layer``)."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def fingerprint(model: torch.nn.Module) -> str:
    """A sha256 that identifies a model's weights, not the way they were loaded.

    Samples a fixed set of elements from every weight and hashes them rounded to bfloat16, so float32 or
    bfloat16 loads, GGUF-dequantized or safetensors copies and any device give the same digest. For a
    `PeftModel`, the active adapter's weights are included (each adapter is its own model); inactive
    adapters are not.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
        ...                   intermediate_size=32, vocab_size=16)
        >>> torch.manual_seed(0); a = LlamaForCausalLM(cfg); torch.manual_seed(1); b = LlamaForCausalLM(cfg)
        >>> fingerprint(a) == fingerprint(a.to(torch.bfloat16)), fingerprint(a) == fingerprint(b)
        (True, False)
    """
    active = active_adapters(model)
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: _canonical_name(item[0])):
        if param.device.type == "meta" or not param.is_floating_point():
            continue
        if ".lora_" in name or "lora_embedding" in name:
            adapter = _adapter_of(name)
            if adapter not in active:
                continue
            name = name.replace(f".{adapter}.", ".adapter.")
        flat = param.detach().reshape(-1)
        count = min(_SAMPLES_PER_TENSOR, flat.numel())
        index = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
        sample = flat[index].to(torch.bfloat16).cpu().view(torch.int16)
        digest.update(_canonical_name(name).encode())
        digest.update(str(tuple(param.shape)).encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def active_adapters(model: torch.nn.Module) -> set[str]:
    """Names of the PEFT adapters that currently act on the model's output (empty for a plain model)."""
    if not hasattr(model, "peft_config"):
        return set()
    active = getattr(model, "active_adapters", None) or getattr(model, "active_adapter", [])
    active = active() if callable(active) else active
    # Under `with model.disable_adapter():` every LoRA layer reports disable_adapters: the model is the base.
    if any(getattr(module, "disable_adapters", False) is True for module in model.modules()):
        return set()
    return {active} if isinstance(active, str) else set(active)


def _adapter_of(param_name: str) -> str:
    # e.g. "...q_proj.lora_A.my_adapter.weight" -> "my_adapter"
    parts = param_name.split(".")
    for i, part in enumerate(parts):
        if part.startswith("lora_") and i + 1 < len(parts):
            return parts[i + 1]
    return ""


def vocab_size_of(model: torch.nn.Module) -> int:
    """Vocabulary size of the model's input embeddings."""
    return int(unwrap_peft(model).get_input_embeddings().weight.shape[0])


def check_pair(source_model: torch.nn.Module, target_model: torch.nn.Module, tokenizer=None) -> None:
    """Refuse a source/target pair that cannot share token ids (different vocabularies or tokenizer)."""
    source_vocab, target_vocab = vocab_size_of(source_model), vocab_size_of(target_model)
    if source_vocab != target_vocab:
        raise IncompatibleModelsError(
            f"source {model_name(source_model)!r} has a vocabulary of {source_vocab} tokens and target "
            f"{model_name(target_model)!r} has {target_vocab}: a KV map needs models that share one tokenizer"
        )
    if tokenizer is not None and len(tokenizer) > source_vocab:
        raise IncompatibleModelsError(
            f"the tokenizer has {len(tokenizer)} tokens but {model_name(source_model)!r} embeds only "
            f"{source_vocab}: it is not these models' tokenizer"
        )
