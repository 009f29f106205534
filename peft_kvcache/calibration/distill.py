"""Distillation: a low-rank correction of a fitted map, trained end to end by the target's next-token KL with the
mapped context in place (the KV-Lingo recipe, arXiv 2609.32610, on top of the ridge fit).

The ridge fit makes each mapped head close to the target's own in squared error, token by token, which weighs every
direction of a key alike; what the target needs is attention that reads the right tokens. Here the map's output is
judged by what the target does with it. Per calibration chunk of ``n`` tokens::

    teacher: the target's own prefill of all n tokens -> next-token distributions at the last ``scored_tokens``
    student: the target's own sink + the map's KV of the context up to n - recent - scored (with the correction)
             + the last ``recent_tokens`` context tokens and the scored tokens computed by the target over them
    loss:    KL(teacher || student) at the scored positions, averaged

which is the hybrid recipe a user runs (the mapped prefix, a recent window computed by the target). Per target layer
and kind the weight becomes ``W + A @ B`` and the bias ``b + c`` (``A`` ``[inputs, rank]``, ``B`` ``[rank, E]``, ``B``
and ``c`` zero at the start, so training starts from the ridge map); the target's weights stay frozen and only the
correction's parameters learn (Adam, a bounded number of steps). In a map with a shared basis the basis stays as
fitted and the correction is of each layer's readout (``A`` ``[rank of the basis, rank]``). Whole calibration texts
held out (the map's own split) choose the step to keep, starting with step 0 (the ridge map itself: a correction that does not lower the
held-out KL is not kept). The kept correction is folded into the dense weights: the artifact and the mapping path are
those of any map, its `DistillationRecord` says what was trained and what it gained.
"""

from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import DynamicCache

from ..errors import CalibrationError
from ..maps.apply import SourceFeatures, map_layer, project_basis
from ..maps.config import KINDS, DistillationRecord, QualityRecord
from ..maps.kvmap import KVMap
from ..modeling._compat import fill_cache, output_cache
from ..modeling.capture import cache_states, forward, run_with_cache
from ..modeling.layout import layer_features, layer_placements, vocab_size_of
from ..modeling.positions import apply_rotary, rotary_cos_sin, rotary_spec_of
from .texts import CalibrationTexts

logger = logging.getLogger(__name__)


@dataclass
class _Example:
    """One chunk, prepared once: the source's position-free features of the mapped part, the target's own sink and
    the teacher's log-probabilities at the scored positions (float32: the KL is a small difference of large sums)."""

    ids: torch.Tensor  # [1, n]
    # what each layer's weight multiplies, [1, mapped_end - sink, width] float32: per (kind, source layer) its
    # features, or in a map with a shared basis per (kind, "basis") the source layers through it (fixed while training)
    features: dict[tuple[str, int | str], torch.Tensor]
    sink: list[tuple[torch.Tensor, torch.Tensor]]  # per target layer, the target's own KV of the sink
    teacher: torch.Tensor  # [scored, vocab] float32 log-probabilities
    mapped_end: int


class Correction(torch.nn.Module):
    """The trainable low-rank correction of every target layer's weight and bias, per kind."""

    def __init__(self, kv_map: KVMap, rank: int, input_scales: dict[tuple[str, int], float], seed: int):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.down, self.up, self.bias = (torch.nn.ParameterDict() for _ in range(3))
        width = kv_map.config.target_layout.layer_width
        for kind in KINDS:
            for t in range(kv_map.config.target_layout.num_layers):
                inputs = kv_map.tensors[f"{kind}.{t}.weight"].shape[0]
                # x @ A of unit scale whatever the features' magnitude, so one learning rate suits every layer
                scale = 1.0 / (inputs ** 0.5 * input_scales[kind, t])
                self.down[f"{kind}_{t}"] = torch.nn.Parameter(torch.randn(inputs, rank, generator=generator) * scale)
                self.up[f"{kind}_{t}"] = torch.nn.Parameter(torch.zeros(rank, width))
                self.bias[f"{kind}_{t}"] = torch.nn.Parameter(torch.zeros(width))

    def weights(self, kv_map: KVMap, kind: str, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The corrected ``(weight, bias)`` of one target layer and kind, float32."""
        name = f"{kind}_{t}"
        return (kv_map.tensors[f"{kind}.{t}.weight"].float() + self.down[name] @ self.up[name],
                kv_map.tensors[f"{kind}.{t}.bias"].float() + self.bias[name])


def _mapped_pairs(kv_map: KVMap, correction: Correction, example: _Example, target_spec,
                  placements) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The student's cache: per target layer, the target's own sink then the corrected map's KV of the context after
    it (differentiable in the correction)."""
    sink = example.sink[0][0].shape[2]
    positions = torch.arange(sink, example.mapped_end)[None]
    cos, sin = rotary_cos_sin(target_spec, positions)
    head_dim = kv_map.config.target_layout.head_dim
    pairs = []
    for t, (device, dtype) in enumerate(placements):
        layer = []
        for k, kind in enumerate(KINDS):
            states = map_layer(_layer_inputs(kv_map, example, kind, t), *correction.weights(kv_map, kind, t), head_dim)
            if kind == "keys":
                states = apply_rotary(states, cos, sin)
            layer.append(torch.cat([example.sink[t][k].float(), states], dim=2).to(device, dtype))
        pairs.append((layer[0], layer[1]))
    return pairs


def _student_kl(target_model, kv_map: KVMap, correction: Correction, example: _Example, target_spec,
                placements) -> torch.Tensor:
    """KL(teacher || student) at the scored positions, averaged over them."""
    cache = fill_cache(DynamicCache(), _mapped_pairs(kv_map, correction, example, target_spec, placements))
    tail = example.ids[:, example.mapped_end:]
    positions = torch.arange(example.mapped_end, example.ids.shape[1])[None]
    scored = example.teacher.shape[0]
    logits = forward(target_model, tail, cache, position_ids=positions, logits_to_keep=scored).logits[0].float()
    student = torch.log_softmax(logits, dim=-1).cpu()
    return (example.teacher.exp() * (example.teacher - student)).sum(-1).mean()


@contextmanager
def _frozen(model: torch.nn.Module):
    """The model's parameters excluded from autograd for the block (as they were after it, even on an error)."""
    previous = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in previous:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in previous:
            p.requires_grad_(flag)


@torch.no_grad()
def _prepare(kv_map: KVMap, source_model, target_model, chunk: torch.Tensor, recent: int, scored: int) -> _Example:
    ids = chunk[None].long()
    mapped_end = ids.shape[1] - recent - scored
    source = run_with_cache(source_model, ids[:, :mapped_end])
    states = SourceFeatures(source.keys, source.values, rotary_spec_of(source_model), torch.arange(mapped_end)[None],
                            torch.float32)
    sink, cpu = kv_map.config.sink_tokens, torch.device("cpu")
    if kv_map.config.basis_rank:  # every layer reads one set of source layers (`KVMapConfig.validate`): inference's
        # own projection of them, once per kind
        features = {(kind, "basis"): layer_features(project_basis(
            [states.heads(*s, cpu)[:, :, sink:] for s in kv_map.source_inputs(kind, 0)],
            kv_map.tensors[f"{kind}.basis"].float())) for kind in KINDS}
    else:
        used = {s for kind in KINDS for t in range(kv_map.config.target_layout.num_layers)
                for s in kv_map.source_inputs(kind, t)}
        features = {s: states.get(*s, cpu)[:, sink:].contiguous() for s in used}
    out = forward(target_model, ids, None, logits_to_keep=scored)
    teacher = torch.log_softmax(out.logits[0].float(), dim=-1).cpu()
    # copies: a view would keep the teacher's whole cache alive for as long as the example
    own = [(keys[:, :, :sink].clone(), values[:, :, :sink].clone())
           for keys, values in cache_states(output_cache(out)).pairs()]
    return _Example(ids, features, own, teacher, mapped_end)


def _layer_inputs(kv_map: KVMap, example: _Example, kind: str, t: int) -> list[torch.Tensor]:
    """What the weight of ``kind`` of target layer ``t`` multiplies: its source layers' features, or the projection
    through the map's shared basis."""
    if kv_map.config.basis_rank:
        return [example.features[kind, "basis"]]
    return [example.features[s] for s in kv_map.source_inputs(kind, t)]


def _input_scales(kv_map: KVMap, example: _Example) -> dict[tuple[str, int], float]:
    """The root-mean-square of each layer's input features on one example (scales the correction's start)."""
    scales = {}
    for kind in KINDS:
        for t in range(kv_map.config.target_layout.num_layers):
            x = torch.cat(_layer_inputs(kv_map, example, kind, t), dim=-1)
            scales[kind, t] = max(float(x.square().mean().sqrt()), 1e-6)
    return scales


def distill_map(
    kv_map: KVMap,
    source_model: torch.nn.Module,
    target_model: torch.nn.Module,
    calibration_data,
    tokenizer=None,
    *,
    rank: int = 8,
    steps: int = 100,
    batch_size: int = 4,
    learning_rate: float = 1e-3,
    recent_tokens: int = 64,
    scored_tokens: int = 64,
    eval_every: int = 20,
    max_heldout: int = 16,
    seed: int = 0,
    progress: bool = True,
) -> KVMap:
    """A new `KVMap`: ``kv_map`` with a rank-``rank`` correction of every layer's weights (and biases) trained by the
    target's next-token KL with the mapped context in place (see the module docstring), folded into the weights.

    ``calibration_data`` is cut and split with the map's own calibration options (whole texts held out): pass the
    map's calibration data so its held-out texts, which choose the step to keep, stay unseen by both fits. Each chunk
    needs more than ``sink + recent_tokens + scored_tokens`` tokens. Cost: one prefill of each model per chunk (the
    teacher and the source, once), then ``steps * batch_size`` forward and backward passes of the target over
    ``recent_tokens + scored_tokens`` tokens, plus a held-out pass every ``eval_every`` steps.

    Example:
        >>> distilled = distill_map(kv_map, source, target, texts, tokenizer, steps=50)   # doctest: +SKIP
        >>> distilled.config.distillation.kept                                            # doctest: +SKIP
        True
    """
    options = kv_map.config.calibration.options
    if rank < 1 or steps < 1 or batch_size < 1 or eval_every < 1 or max_heldout < 1 or learning_rate <= 0:
        raise CalibrationError("distillation needs a positive rank, steps, batch_size, eval_every, max_heldout and "
                               f"learning_rate; got {rank}, {steps}, {batch_size}, {eval_every}, {max_heldout}, "
                               f"{learning_rate}")
    if recent_tokens < 0 or scored_tokens < 1:
        raise CalibrationError(f"recent_tokens must be >= 0 and scored_tokens >= 1, got {recent_tokens}, "
                               f"{scored_tokens}")
    if kv_map.config.mlp_layers("keys") or kv_map.config.mlp_layers("values") or kv_map.residual_rank:
        raise CalibrationError("distillation corrects a map's linear weights; this map has nonlinear heads or runs as "
                               "the identity plus factors (distill a map without them)")
    if options.head_shards > 1:  # the correction mixes every head: the map would no longer split per shard
        raise CalibrationError(f"distillation adds a correction across all heads; this map is fitted per head shard "
                               f"(head_shards {options.head_shards}), which a tensor-parallel engine relies on: "
                               "distill a map fitted with head_shards=1")
    kv_map.check_models(source_model, target_model)
    texts = CalibrationTexts.build(calibration_data, tokenizer, options, vocab_size_of(source_model))
    least = options.sink_tokens + recent_tokens + scored_tokens + 1
    splits = {split: [c for c in texts.split(split) if c.numel() >= least] for split in ("train", "heldout")}
    if not splits["train"] or not splits["heldout"]:
        raise CalibrationError(f"distillation needs chunks of at least {least} tokens (sink + recent_tokens + "
                               f"scored_tokens + 1) in both splits; got {len(splits['train'])} train and "
                               f"{len(splits['heldout'])} held-out: pass longer texts or fewer recent/scored tokens")
    chunks = splits["train"] + splits["heldout"][:max_heldout]
    examples = [_prepare(kv_map, source_model, target_model, c, recent_tokens, scored_tokens)
                for c in tqdm(chunks, desc="teacher", unit="chunk", disable=not progress)]
    train, heldout = examples[: len(splits["train"])], examples[len(splits["train"]):]

    target_spec = rotary_spec_of(target_model)
    placements = layer_placements(target_model)
    correction = Correction(kv_map, rank, _input_scales(kv_map, train[0]), seed)
    optimizer = torch.optim.Adam(correction.parameters(), lr=learning_rate)
    generator = torch.Generator().manual_seed(seed)

    def heldout_kl() -> float:
        with torch.no_grad():
            return float(torch.stack([_student_kl(target_model, kv_map, correction, e, target_spec, placements)
                                      for e in heldout]).mean())

    curve = [(0, heldout_kl())]
    best_step, best_state = 0, copy.deepcopy(correction.state_dict())
    with _frozen(target_model), torch.enable_grad(), \
            tqdm(total=steps, desc="distilling", unit="step", disable=not progress) as bar:
        for step in range(1, steps + 1):
            optimizer.zero_grad()
            for i in torch.randint(len(train), (batch_size,), generator=generator).tolist():
                loss = _student_kl(target_model, kv_map, correction, train[i], target_spec, placements) / batch_size
                loss.backward()
            optimizer.step()
            bar.update()
            if step % eval_every == 0 or step == steps:
                curve.append((step, heldout_kl()))
                bar.set_postfix(heldout_kl=f"{curve[-1][1]:.4f}")
                if curve[-1][1] < min(kl for _, kl in curve[:-1]):
                    best_step, best_state = step, copy.deepcopy(correction.state_dict())
    correction.load_state_dict(best_state)
    tensors = dict(kv_map.tensors)
    with torch.no_grad():
        for kind in KINDS:
            for t in range(kv_map.config.target_layout.num_layers):
                weight, bias = correction.weights(kv_map, kind, t)
                tensors[f"{kind}.{t}.weight"], tensors[f"{kind}.{t}.bias"] = weight.clone(), bias.clone()
    config = copy.deepcopy(kv_map.config)
    config.quality = QualityRecord()  # the gate and figures measured the weights before the correction
    config.distillation = DistillationRecord(
        rank=rank, steps=steps, batch_size=batch_size, learning_rate=learning_rate, recent_tokens=recent_tokens,
        scored_tokens=scored_tokens, train_chunks=len(train), heldout_chunks=len(heldout), kept_step=best_step,
        heldout_kl=[[s, kl] for s, kl in curve])
    logger.info("distillation: held-out KL %.4f at the ridge map, %.4f at step %d (kept)", curve[0][1],
                dict(curve)[best_step], best_step)
    return KVMap(config, tensors)


__all__ = ["Correction", "distill_map"]
