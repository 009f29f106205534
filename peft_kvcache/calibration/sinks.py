"""The target's own attention sink, shipped in a map: a mapped cache starts with the KV the target itself computes for
a conversation's first tokens (the sink, whose huge-norm keys a map reproduces worst). The library computes it with
the target model at hand; a serving engine (vLLM's connector) cannot run the target outside its scheduler, so a map
may ship the sink for the conversation starts its users will send: those of the tokenizer's chat template and its
BOS token. A conversation that starts otherwise falls back as before (the engine learns that sink from the first
request that brings it)."""

from __future__ import annotations

import copy

import torch

from ..maps.kvmap import KVMap
from ..modeling.capture import run_with_cache


def conversation_starts(tokenizer, sink_tokens: int) -> list[list[int]]:
    """The first ``sink_tokens`` token ids of the conversations a chat client sends through ``tokenizer``'s chat
    template (with and without a system message) and of a plain text after the BOS token, without repeats."""
    starts = []
    for messages in ([{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi."}],
                     [{"role": "user", "content": "Hi."}]):
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            starts.append(list(ids[:sink_tokens]))
    if tokenizer.bos_token_id is not None:
        text = tokenizer("Hi.", add_special_tokens=False).input_ids
        starts.append(([tokenizer.bos_token_id] + text)[:sink_tokens])
    return [list(s) for s in dict.fromkeys(tuple(s) for s in starts if len(s) == sink_tokens)]


@torch.no_grad()
def ship_target_sinks(kv_map: KVMap, target_model: torch.nn.Module, starts: list[list[int]]) -> KVMap:
    """``kv_map`` with the target's own KV of each conversation start in ``starts`` shipped (``config.sinks``,
    `KVMap.shipped_sink`); ``target_model`` as the map's target runs (an adapter active for a base -> adapter map).
    The map's weights are unchanged.

    Example:
        >>> with adapter_active(peft_model, "shout"):                                               # doctest: +SKIP
        ...     kv_map = ship_target_sinks(kv_map, peft_model, conversation_starts(tokenizer, 1))
    """
    kv_map.check_models(None, target_model)
    config = copy.deepcopy(kv_map.config)
    tensors = {name: t for name, t in kv_map.tensors.items() if not name.startswith("sink.")}
    config.sinks = [list(map(int, start)) for start in starts]
    for i, start in enumerate(config.sinks):
        own = run_with_cache(target_model, torch.tensor([start]))  # per layer [1, kv_heads, len, head_dim]
        tensors[f"sink.{i}.keys"] = torch.stack([k[0] for k in own.keys]).float().cpu()
        tensors[f"sink.{i}.values"] = torch.stack([v[0] for v in own.values]).float().cpu()
    return KVMap(config, tensors)


__all__ = ["conversation_starts", "ship_target_sinks"]
