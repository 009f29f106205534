"""The quality gate: predict, before deployment and without an evaluation run, whether a map will work.

On held-out text each sequence is split into a context and its last ``query_tokens`` tokens. The target runs the
query tokens on top of its own prefill of the context; at every layer a forward hook replays that layer's attention
module on the very same input three times, attending to (a) the target's own context keys/values, (b) the mapped
ones (as `MappedCache.from_source` builds them, sink included, no refresh) and (c) no context (the sink only). Per
layer we record the cosine between (a) and (b) and between (a) and (c).

Predicted retention mirrors normalized retention per layer: the share of the no-context cosine gap the mapped cache
closes, ``(cos_mapped - cos_none) / (1 - cos_none)``, averaged over layers (at most 1; below 0 where the map is worse
than no context). Raw cosines sit near 1 whatever the map (attention outputs share a large common part: the sink,
the query token itself), so the gap to the no-context cosine, which the target would get for free, is what
separates maps. It is a heuristic, not fitted to measured retention. `meets_quality` reads it at switch time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import EvaluationError
from ..maps.config import DataRecord, GateRecord
from ..modeling._compat import replay_attention
from ..modeling.capture import CapturedKV, cache_states, forward, run_with_cache
from ..modeling.layout import decoder_layers
from ..runtime.mapped import MappedCache


def _prefix_mask(prefix: int, queries: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask ``[1, 1, queries, prefix + queries]``: the whole prefix, causal among the queries."""
    mask = torch.zeros(queries, prefix + queries, dtype=dtype, device=device)
    causal = torch.ones(queries, queries, dtype=torch.bool, device=device).triu(1)
    mask[:, prefix:].masked_fill_(causal, torch.finfo(dtype).min)
    return mask[None, None]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over tokens of the cosine between attention outputs ``[batch, tokens, hidden]``."""
    return float(F.cosine_similarity(a.float().flatten(0, -2), b.float().flatten(0, -2), dim=-1).mean())


@torch.no_grad()
def attention_cosines(target_model, own: CapturedKV, mapped: CapturedKV, query_ids: torch.Tensor,
                      query_positions: torch.Tensor, sink_tokens: int = 1) -> tuple[list[float], list[float]]:
    """Per target layer, cosine between the attention output over the target's own context KV and (1) over
    the mapped KV, (2) over the sink only; the queries ``query_ids`` ``[1, W]`` continue the context at
    ``query_positions`` ``[1, W]``. Every layer sees the target's own residual stream, so each cosine
    measures that layer's mapped keys/values alone. Needs the eager or sdpa attention implementation."""
    layers = decoder_layers(target_model)
    mapped_cos, none_cos = [0.0] * len(layers), [0.0] * len(layers)
    busy = [False]

    def hook_for(index: int):
        def hook(module, args, kwargs, output):
            if busy[0]:
                return None
            busy[0] = True
            try:
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                mask = lambda prefix: _prefix_mask(prefix, hidden.shape[1], hidden.dtype, hidden.device)  # noqa: E731
                own_k, own_v = own.keys[index], own.values[index]
                reference = replay_attention(module, args, kwargs, own_k, own_v, mask(own_k.shape[2]))
                m_k, m_v = mapped.keys[index], mapped.values[index]
                mapped_cos[index] = _cosine(replay_attention(module, args, kwargs, m_k, m_v, mask(m_k.shape[2])),
                                            reference)
                none = replay_attention(module, args, kwargs, own_k[:, :, :sink_tokens], own_v[:, :, :sink_tokens],
                                        mask(sink_tokens))
                none_cos[index] = _cosine(none, reference)
            finally:
                busy[0] = False
            return None
        return hook

    handles = [layer.self_attn.register_forward_hook(hook_for(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        forward(target_model, query_ids, MappedCache(own), position_ids=query_positions)
    finally:
        for handle in handles:
            handle.remove()
    return mapped_cos, none_cos


def predicted_retention(mapped_cosines: Sequence[float], no_context_cosines: Sequence[float]) -> float:
    """Mean over layers of ``(cos_mapped - cos_none) / (1 - cos_none)``, each at most 1.

    Example:
        >>> predicted_retention([1.0, 0.9], [0.8, 0.8])
        0.75
    """
    shares = [min(1.0, (m - n) / max(1.0 - n, 1e-6)) for m, n in zip(mapped_cosines, no_context_cosines)]
    return sum(shares) / len(shares)


@torch.no_grad()
def measure_quality(kv_map, source_model, target_model, sequences: Sequence[torch.Tensor], *,
                    query_tokens: int = 16, data: DataRecord | None = None, write: bool = True,
                    progress: bool = True) -> GateRecord:
    """The quality gate on held-out ``sequences`` (1-D token ids, each longer than ``query_tokens`` plus the
    sink; ``data`` says which texts they are): per-layer attention-output cosines and the predicted retention
    (see the module docstring). With ``write=True`` the record goes into ``kv_map.config.quality.gate`` (saved
    with the map, shown on its card, read by `meets_quality`).

    Example:
        >>> gate = measure_quality(kv_map, source, target, heldout_ids, progress=False)  # doctest: +SKIP
        >>> gate.predicted_retention                                                     # doctest: +SKIP
    """
    sink = kv_map.config.sink_tokens
    usable = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    usable = [s for s in usable if s.numel() > query_tokens + sink]
    if not usable or query_tokens < 1:
        raise EvaluationError(f"the quality gate needs sequences longer than query_tokens + sink "
                              f"({query_tokens} + {sink}) tokens and query_tokens >= 1")
    kv_map.check_models(source_model, target_model)
    layers = kv_map.config.target_layout.num_layers
    mapped_sum, none_sum = [0.0] * layers, [0.0] * layers
    for ids in tqdm(usable, desc="quality gate", disable=not progress):
        context, queries = ids[None, :-query_tokens], ids[None, -query_tokens:]
        own = run_with_cache(target_model, context)
        mapped = MappedCache.from_source(source_model, kv_map, target_model, input_ids=context, refresh_tokens=0,
                                         verify_models=False)
        positions = torch.arange(context.shape[1], ids.numel())[None]
        m_cos, n_cos = attention_cosines(target_model, own, cache_states(mapped), queries, positions, sink)
        mapped_sum = [a + b for a, b in zip(mapped_sum, m_cos)]
        none_sum = [a + b for a, b in zip(none_sum, n_cos)]
    mapped_cos = [v / len(usable) for v in mapped_sum]
    none_cos = [v / len(usable) for v in none_sum]
    gate = GateRecord(predicted_retention=round(predicted_retention(mapped_cos, none_cos), 6),
                      attention_cosine_per_layer=[round(v, 6) for v in mapped_cos],
                      no_context_cosine_per_layer=[round(v, 6) for v in none_cos], sequences=len(usable),
                      query_tokens=query_tokens, data=data or DataRecord())
    if write:
        kv_map.config.quality.gate = gate
    return gate


__all__ = ["attention_cosines", "measure_quality", "predicted_retention"]
