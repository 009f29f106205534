"""Facts about a transformers (or PEFT) causal LM that a map depends on: its KV layout, its decoder layers and
the device and dtype of each, its vocabulary, and the token ids it can take."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CacheMismatchError, IncompatibleModelsError
from ._compat import unwrap_peft
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
        return cls.of_config(model.config)

    @classmethod
    def of_config(cls, config) -> "KVLayout":
        """Layout of the model a transformers config describes."""
        return cls(
            num_layers=int(config.num_hidden_layers),
            kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
            head_dim=head_dim_of(config),
        )


def layer_features(states: torch.Tensor) -> torch.Tensor:
    """``[batch, kv_heads, seq, head_dim]`` -> ``[batch, seq, kv_heads * head_dim]`` (heads side by side)."""
    batch, heads, seq, dim = states.shape
    return states.transpose(1, 2).reshape(batch, seq, heads * dim)


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


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's inputs go: the device of its first parameter (the embeddings)."""
    return next(model.parameters()).device


def vocab_size_of(model: torch.nn.Module) -> int:
    """Vocabulary size of the model's input embeddings."""
    return int(unwrap_peft(model).get_input_embeddings().weight.shape[0])


def check_token_ids(ids, vocab_size: int | None, name: str = "input_ids", dims: tuple[int, ...] = (2,)
                    ) -> torch.Tensor:
    """Refuse (`CacheMismatchError`, saying what to pass) ids that are not an integer tensor of ``dims`` dimensions,
    are empty, or lie outside ``[0, vocab_size)`` (``None``: any non-negative id); returns them as a long tensor."""
    if not isinstance(ids, torch.Tensor):
        try:
            ids = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError) as err:  # ragged lists, strings, objects
            raise CacheMismatchError(f"{name} must be a tensor of token ids (or a rectangular list): {err}") from None
    shape = " or ".join({1: "[seq]", 2: "[batch, seq]"}[d] for d in dims)
    if ids.dim() not in dims:
        raise CacheMismatchError(f"{name} must be a {shape} tensor of token ids, got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise CacheMismatchError(f"{name} must hold integer token ids, got {ids.dtype}")
    if ids.numel() == 0:
        raise CacheMismatchError(f"{name} is empty; pass at least one token id")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        raise CacheMismatchError(f"{name} holds token id {bad}, outside the vocabulary of {vocab_size} tokens")
    return ids.long()
