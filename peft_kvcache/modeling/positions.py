"""Rotary position embeddings: reading a model's own rotary parameters, removing them from cached keys
and applying them again at other positions.

Keys in a transformers cache are post-RoPE: ``k = R(theta * p) k0 * s`` where ``s`` is the rotary
``attention_scaling``. Removing the rotation makes keys position-independent, so a mapped cache can be
placed at any offset. Values carry no position.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..errors import UnsupportedPositionalSchemeError

# Rope types whose inverse frequencies do not depend on the sequence length.
STATIC_ROPE_TYPES = {"default", "linear", "yarn", "llama3", "proportional"}
# Rope types that switch frequencies past the original context: usable only below it.
LENGTH_DEPENDENT_ROPE_TYPES = {"dynamic", "longrope"}
# Model types that always use ALiBi (Falcon says so with ``config.alibi``).
ALIBI_MODEL_TYPES = {"bloom", "mpt"}


@dataclass(frozen=True)
class RotarySpec:
    """Everything needed to rotate keys of one model: its frequencies and how much of a head they cover.

    Attributes:
        inv_freq: ``[rotary_dim // 2]`` float32 inverse frequencies, as the model's rotary module holds them.
        attention_scaling: factor folded into cos/sin by the model (yarn, longrope); 1.0 otherwise.
        head_dim: size of one key head.
        rope_type: the config's ``rope_type``.
        max_position: positions at or past this are refused (length-dependent rope types), or ``None``.
    """

    inv_freq: torch.Tensor
    attention_scaling: float
    head_dim: int
    rope_type: str = "default"
    max_position: int | None = None

    @property
    def rotary_dim(self) -> int:
        """Number of leading dims of each head that are rotated (partial rotary rotates fewer than head_dim)."""
        return 2 * self.inv_freq.numel()

    def describe(self) -> "RotaryRecord":
        """The summary a map's config stores (the frequencies themselves go into its safetensors)."""
        return RotaryRecord(rope_type=self.rope_type, head_dim=self.head_dim, rotary_dim=self.rotary_dim,
                            attention_scaling=float(self.attention_scaling), max_position=self.max_position)


@dataclass
class RotaryRecord:
    """A model's RoPE as a map's config records it (its inverse frequencies are in the safetensors)."""

    rope_type: str
    head_dim: int
    rotary_dim: int
    attention_scaling: float
    max_position: int | None = None


def head_dim_of(config) -> int:
    """Head size from a config, derived from hidden size and head count where the config leaves it unset
    (GGUF-loaded Qwen configs have ``head_dim=None``)."""
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def check_positional_scheme(config) -> None:
    """Refuse, naming the scheme, a model whose cached keys cannot be made position-independent.

    Example:
        >>> from transformers import LlamaConfig
        >>> check_positional_scheme(LlamaConfig(num_hidden_layers=1))  # RoPE: accepted
    """
    model_type = getattr(config, "model_type", "unknown")
    if getattr(config, "alibi", False) or model_type in ALIBI_MODEL_TYPES:
        raise UnsupportedPositionalSchemeError(
            f"model type {model_type!r} uses ALiBi attention biases, which live in the attention scores and "
            "cannot be removed from cached keys; only RoPE models are supported"
        )
    pos_type = getattr(config, "position_embedding_type", None)
    if pos_type not in (None, "rope", "rotary"):
        raise UnsupportedPositionalSchemeError(
            f"model type {model_type!r} uses position_embedding_type={pos_type!r}; only RoPE models are supported"
        )
    layer_types = getattr(config, "layer_types", None) or []
    windowed = sorted({t for t in layer_types if t != "full_attention"})
    # Mistral-style configs slide whenever sliding_window is set; Qwen2-style ones only with use_sliding_window.
    slides = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False
    if windowed or slides:
        raise UnsupportedPositionalSchemeError(
            f"model type {model_type!r} has {windowed or ['sliding_attention']} layers: their caches keep only a "
            "window of tokens, and mapped windows were measured to give wrong output; only full-attention "
            "models are supported"
        )
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope.get("mrope_section") or rope_type not in STATIC_ROPE_TYPES | LENGTH_DEPENDENT_ROPE_TYPES:
        raise UnsupportedPositionalSchemeError(
            f"model type {model_type!r} uses rope_type={rope_type!r}"
            f"{' with multimodal sections' if rope.get('mrope_section') else ''}, which peft-kvcache cannot "
            f"invert; supported: {sorted(STATIC_ROPE_TYPES | LENGTH_DEPENDENT_ROPE_TYPES)}"
        )


_ROTARY_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def find_rotary_embedding(model: torch.nn.Module) -> torch.nn.Module:
    """The model's own rotary embedding module (the first module holding ``inv_freq``), remembered per model
    object: the walk over every module would otherwise run at every switch (its parameters are read afresh)."""
    found = _ROTARY_MODULES.get(model)
    if found is not None:
        return found
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "attention_scaling"):
            _ROTARY_MODULES[model] = module
            return module
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    raise UnsupportedPositionalSchemeError(
        f"no rotary embedding module found in model {model_type!r}: its positional scheme (learned absolute, "
        "ALiBi or none) cannot be removed from cached keys; only RoPE models are supported"
    )


def rotary_spec_of(model: torch.nn.Module) -> RotarySpec:
    """Read a model's rotary parameters from its own rotary module, after checking the scheme is supported.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
        ...                                      intermediate_size=64, vocab_size=32))
        >>> rotary_spec_of(model).rotary_dim
        16
    """
    config = model.config
    check_positional_scheme(config)
    rotary = find_rotary_embedding(model)
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    max_position = None
    if rope_type in LENGTH_DEPENDENT_ROPE_TYPES:
        max_position = int(getattr(rotary, "original_max_seq_len", None) or config.max_position_embeddings)
    # original_inv_freq: dynamic rope mutates inv_freq after long inputs; below max_position both agree.
    inv_freq = getattr(rotary, "original_inv_freq", rotary.inv_freq)
    return RotarySpec(
        inv_freq=inv_freq.detach().float().cpu().clone(),
        attention_scaling=float(rotary.attention_scaling),
        head_dim=head_dim_of(config),
        rope_type=rope_type,
        max_position=max_position,
    )


def rotary_spec_of_config(config) -> RotarySpec:
    """The rotary parameters a model built from ``config`` has, computed by transformers' own rope initialisation
    for the config's rope type without building the model (for a model the library does not hold, such as a
    serving engine's). Agrees with `rotary_spec_of` on the model itself.

    Example:
        >>> from transformers import LlamaConfig
        >>> rotary_spec_of_config(LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1)).rotary_dim
        16
    """
    check_positional_scheme(config)
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":  # the one formula every RoPE model shares; transformers keeps it on each rotary class
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        inv_freq, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    max_position = int(config.max_position_embeddings) if rope_type in LENGTH_DEPENDENT_ROPE_TYPES else None
    return RotarySpec(inv_freq=inv_freq.detach().float().cpu(), attention_scaling=float(scaling),
                      head_dim=head_dim_of(config), rope_type=rope_type, max_position=max_position)


# How close two models' RoPE frequencies must be to count as the same: bfloat16's precision, since model.to(bfloat16)
# rounds the rotary buffers too. The one tolerance every place that matches maps to models uses.
ROTARY_RTOL = 1e-2


def same_rotary(a: RotarySpec, b: RotarySpec) -> bool:
    """Whether keys rotated with ``a`` can be un-rotated with ``b``: the same rotated dims, frequencies within
    `ROTARY_RTOL` and the same attention scaling.

    Example:
        >>> spec = RotarySpec(torch.tensor([1.0, 0.1]), 1.0, 4)
        >>> same_rotary(spec, RotarySpec(spec.inv_freq.bfloat16().float(), 1.0, 4))
        True
    """
    return (a.rotary_dim == b.rotary_dim and torch.allclose(a.inv_freq.float(), b.inv_freq.float(), rtol=ROTARY_RTOL)
            and abs(a.attention_scaling - b.attention_scaling) <= ROTARY_RTOL * abs(b.attention_scaling))


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Absolute position of every token from a (left-padded) mask: ``cumsum - 1``, padding at 0.

    Example:
        >>> positions_from_mask(torch.tensor([[0, 0, 1, 1, 1]])).tolist()
        [[0, 0, 0, 1, 2]]
    """
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp_min(0)


def check_rotary_reach(spec: RotarySpec, last_position: int) -> None:
    """Refuse (`UnsupportedPositionalSchemeError`) a cache reaching ``last_position`` where ``spec``'s frequencies
    have changed (``dynamic``, ``longrope``: past the model's original length)."""
    if spec.max_position is not None and last_position >= spec.max_position:
        raise UnsupportedPositionalSchemeError(
            f"rope_type={spec.rope_type!r} changes its frequencies past position {spec.max_position}, and this "
            f"cache reaches position {last_position}; keep contexts below {spec.max_position} tokens"
        )


def rotary_cos_sin(spec: RotarySpec, positions: torch.Tensor, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (``[batch, seq, rotary_dim]``, float32, scaled like the model's) at ``positions``."""
    if positions.numel():
        check_rotary_reach(spec, int(positions.max()))
    device = positions.device if device is None else device
    inv_freq = spec.inv_freq.to(device=device, dtype=torch.float32)
    freqs = positions.to(device=device, dtype=torch.float32)[..., None] * inv_freq  # [batch, seq, rotary_dim/2]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos() * spec.attention_scaling, angles.sin() * spec.attention_scaling


def _rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """``keys * cos +- rotate_half(keys) * sin`` on the first ``rotary_dim`` dims, written half by half into one
    output (no concatenation). The two halves of `rotary_cos_sin`'s cos/sin are equal by construction, so one
    half of each is read."""
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    c, s = cos[:, None, :, :half].to(keys.dtype), sin[:, None, :, :half].to(keys.dtype)
    if inverse:
        s = -s
    x1, x2 = keys[..., :half], keys[..., half:rotary_dim]
    out = torch.empty_like(keys)
    out[..., :half] = x1 * c - x2 * s
    out[..., half:rotary_dim] = x2 * c + x1 * s
    if rotary_dim < keys.shape[-1]:  # partial rotary: the rest passes through
        out[..., rotary_dim:] = keys[..., rotary_dim:]
    return out


def rotate_(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` in place on ``keys`` (float32, ``[batch, kv_heads, seq, head_dim]``), in four passes over half
    the dims and one copy of a half: what a mapping runs per layer."""
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    c, s = cos[:, None, :, :half], sin[:, None, :, :half]
    x1, x2 = keys[..., :half], keys[..., half:rotary_dim]
    first = x1.clone()
    x1.mul_(c).addcmul_(x2, s, value=-1.0)
    x2.mul_(c).addcmul_(first, s)
    return keys


def remove_rotary_float(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        attention_scaling: float) -> torch.Tensor:
    """`remove_rotary` into a new float32 tensor, read from ``keys`` in their own dtype: two passes per half of the
    rotary dims and no float copy first (what a mapping runs per source layer)."""
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    c, s = cos[:, None, :, :half], sin[:, None, :, :half]
    x1, x2 = keys[..., :half], keys[..., half:rotary_dim]
    out = torch.empty(keys.shape, dtype=torch.float32, device=keys.device)
    torch.mul(x1, c, out=out[..., :half]).addcmul_(x2, s)
    torch.mul(x2, c, out=out[..., half:rotary_dim]).addcmul_(x1, s, value=-1.0)
    if attention_scaling != 1.0:
        out[..., :rotary_dim] /= attention_scaling**2
    if rotary_dim < keys.shape[-1]:  # partial rotary: the rest passes through
        out[..., rotary_dim:] = keys[..., rotary_dim:]
    return out


def apply_rotary(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate position-free keys ``[batch, kv_heads, seq, head_dim]`` with cos/sin ``[batch, seq, rotary_dim]``.

    Partial rotary: only the first ``rotary_dim`` dims rotate, the rest pass through (as the models do).
    """
    return _rotate(keys, cos, sin, inverse=False)


def position_free_keys(keys: torch.Tensor, spec: RotarySpec, positions: torch.Tensor) -> torch.Tensor:
    """Remove RoPE from cached keys ``[batch, kv_heads, seq, head_dim]`` at ``positions`` ``[batch, seq]``,
    in float32."""
    cos, sin = rotary_cos_sin(spec, positions, device=keys.device)
    return remove_rotary(keys.float(), cos, sin, spec.attention_scaling)


def remove_rotary(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_scaling: float) -> torch.Tensor:
    """Invert `apply_rotary`: rotate back by the same angles and divide out ``attention_scaling ** 2``.

    With scaled ``c = s cos``, ``n = s sin``: ``k c - rot(k) n = s^2 R(-theta) k``; round-trips to float rounding.
    """
    out = _rotate(keys, cos, sin, inverse=True)
    if attention_scaling != 1.0:
        rotary_dim = cos.shape[-1]
        out[..., :rotary_dim] /= attention_scaling**2
    return out
