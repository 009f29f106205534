"""Keeping approximate KV out of vLLM's prefix cache (the scheduler half's block-pool side).

vLLM's prefix cache serves any block it holds under a hash as exact. Blocks the connector wrote from mapped (or
naive) KV, and blocks a request computed on top of them, must never be: they are taken out of it (``evict_blocks``)
once vLLM has hashed them. Hashes are what a later request would match, so every block cached under one is taken
out, not only the request's own (one it computed before a preemption, say).
"""

from __future__ import annotations

from .pairs import Variant

COPIES_PER_HASH = 8  # vLLM hands out one block per hash at a time; a few stale copies are the most seen


class PrefixCacheEvictions:
    """Evictions from vLLM's prefix cache. ``pool`` is vLLM's block pool, bound after construction (None: vLLM never
    handed it over, and nothing approximate may be written)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.pool = None
        self.later: dict[str, tuple[Variant, tuple[int, ...]]] = {}  # async loads: blocks vLLM hashes at promotion

    def blocks(self, block_ids) -> None:
        """Take blocks out of vLLM's prefix cache: never an exact hit for a later request."""
        if self.pool is not None and block_ids:
            self.pool.evict_blocks(set(block_ids))

    def hashes(self, block_hashes) -> set:
        """Take every block cached under one of ``block_hashes`` out; the hashes some block was cached under."""
        found = set()
        if self.pool is not None:
            for block_hash in block_hashes:
                for _ in range(COPIES_PER_HASH):
                    cached = self.pool.get_cached_block(block_hash, [0])
                    if not cached:
                        break
                    found.add(block_hash)
                    self.blocks({block.block_id for block in cached})
        return found

    def request(self, request, first: int, block_ids=()) -> set:
        """Take the request's blocks from block ``first`` on out: those it holds (``block_ids``: all of them) and
        every block cached under their hashes; the hashes some block was cached under."""
        found = self.hashes(getattr(request, "block_hashes", ())[first:])
        self.blocks(block_ids[first:])
        return found

    def later_for(self, request_id: str, variant: Variant, block_ids: tuple[int, ...]) -> None:
        """An asynchronous load's approximate blocks: taken out once vLLM has hashed them (`hashed_later`, or when
        vLLM calls again after the load or the request ends, `take_later`)."""
        self.later[request_id] = (variant, block_ids)

    def take_later(self, request_id: str) -> None:
        """Take the request's pending blocks out now (vLLM has hashed them, or the request ended before it called
        again)."""
        self.blocks(self.later.pop(request_id, (None, ()))[1])

    def cancel_later(self, request_id: str) -> None:
        """The request's load failed: vLLM computes those blocks itself, exactly."""
        self.later.pop(request_id, None)

    def hashed_later(self, variant: Variant) -> set:
        """Take out the pending blocks of ``variant``'s asynchronous loads that vLLM has hashed already, before their
        requests' next call; the hashes they were cached under."""
        if self.pool is None:
            return set()
        from vllm.v1.core.kv_cache_utils import get_block_hash  # the hash without the group id a block carries

        hashed = {block: self.pool.blocks[block].block_hash for owner, ids in self.later.values() if owner == variant
                  for block in ids if self.pool.blocks[block].block_hash is not None}
        self.blocks(set(hashed))
        return {get_block_hash(block_hash) for block_hash in hashed.values()}

__all__ = ["PrefixCacheEvictions"]
