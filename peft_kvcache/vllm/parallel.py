"""The engine's parallelism as the connector sees it. Under tensor parallelism each rank holds a slice of the KV heads
(contiguous, or one replicated head when there are fewer KV heads than ranks); its store keeps its own slice, and a
mapped load gathers every source head across the group first, since a map mixes heads (each rank then writes its own
target heads), unless the map was fitted per shard for this split (``head_shards``: each target head from its own
shard's source heads), which a rank applies to its own heads alone. Pipeline parallelism (a stage holds some of the
layers, a map mixes layers) is refused at start."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CacheMismatchError


@dataclass(frozen=True)
class Shard:
    """This rank's place in the tensor-parallel group: ``rank`` of ``world``, holding a slice of ``total_heads`` KV
    heads."""

    rank: int = 0
    world: int = 1
    total_heads: int = 1

    @property
    def replicas(self) -> int:
        """Ranks holding each KV head (more than one when the model has fewer KV heads than ranks)."""
        return max(1, self.world // self.total_heads)

    @property
    def heads(self) -> slice:
        """The KV heads this rank holds, as a slice of all of them."""
        per_rank = max(1, self.total_heads // self.world)
        first = (self.rank // self.replicas) * per_rank
        return slice(first, first + per_rank)

    @property
    def groups(self) -> int:
        """The distinct slices of KV heads the ranks hold (the ``head_shards`` of a map this split needs no gather for)."""
        return self.total_heads // max(1, self.total_heads // self.world)

    def place(self, shards: list[torch.Tensor], ok: bool) -> list[torch.Tensor]:
        """Each layer's ``[heads of this rank, tokens, head_dim]`` in place among zeros for the other ranks' heads:
        all a map fitted per shard for this split reads to predict this rank's heads (no collective)."""
        if not ok:
            raise CacheMismatchError("the stored prefix is missing")
        if self.world == 1:
            return shards
        out = []
        for t in shards:
            full = t.new_zeros((self.total_heads, *t.shape[1:]))
            full[self.heads] = t
            out.append(full)
        return out

    def gather(self, shards: list[torch.Tensor], ok: bool) -> list[torch.Tensor]:
        """Every KV head of each layer's ``[heads of this rank, tokens, head_dim]`` (all ranks call it together, in
        the same order); `CacheMismatchError` on every rank when any rank lacked its part (``ok`` False: it sends
        zeros of the same shape), so no rank waits for another that gave up."""
        if self.world == 1:
            if not ok:
                raise CacheMismatchError("the stored prefix is missing")
            return shards
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        flags = group.all_gather(torch.tensor([float(ok)], device=shards[0].device), dim=0)
        if not bool((flags > 0).all()):
            raise CacheMismatchError(f"ranks {[i for i, f in enumerate(flags.tolist()) if not f]} lack their part of "
                                     "the stored prefix")
        gathered = [group.all_gather(t.contiguous(), dim=0) for t in shards]  # [world * heads_per_rank, ...]
        return [t[:: self.replicas] if self.replicas > 1 else t for t in gathered]


def shard_of(vllm_config) -> Shard:
    """This process's `Shard` (rank 0 of 1 outside a tensor-parallel group)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    world = parallel.tensor_parallel_size
    if world == 1:
        return Shard(0, 1, model.get_total_num_kv_heads())
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return Shard(get_tensor_model_parallel_rank(), world, model.get_total_num_kv_heads())


def head_groups(vllm_config) -> int:
    """The distinct slices of KV heads this engine's tensor-parallel ranks hold (`Shard.groups`)."""
    return Shard(0, vllm_config.parallel_config.tensor_parallel_size,
                 vllm_config.model_config.get_total_num_kv_heads()).groups


def unsupported_parallelism(vllm_config) -> str | None:
    """Why the connector cannot serve this engine's parallelism, or None."""
    stages = vllm_config.parallel_config.pipeline_parallel_size
    if stages > 1:
        return (f"pipeline parallelism ({stages} stages): each stage holds some of the layers and a map mixes layers; "
                "the connector serves tensor parallelism only")
    return None
