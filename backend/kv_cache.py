"""Paged KV cache bookkeeping: a fixed pool of blocks, per-sequence block tables, reference counts (the samples
of one prompt share its blocks)."""
from collections import deque

from backend.request import Sequence


def num_kv_blocks(memory_bytes: int, block_size: int, num_layers: int, num_kv_heads: int,
                  head_dim: int, dtype_bytes: int) -> int:
    """How many blocks fit a memory budget (K and V, every layer)."""
    block_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes
    return memory_bytes // block_bytes


class BlockManager:
    """Hands out cache blocks. A sequence's block table covers every token it has (or is about to have)
    in the cache; blocks are reference counted so that sequences can share them."""

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0):
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget holds no block of {block_size} tokens: raise kv_cache_memory_bytes")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        num_tokens = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, keep_watermark: bool = False) -> bool:
        reserve = self.watermark_blocks if keep_watermark else 0
        return self.num_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks - reserve

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table so that num_new_tokens more tokens fit."""
        needed = self.num_blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"allocate: {needed} blocks needed, {self.num_free_blocks} free")
        for _ in range(needed):
            seq.block_table.append(self._take())
        seq.metrics.num_new_blocks += needed

    def _take(self) -> int:
        block_id = self.free_block_ids.popleft()
        self.ref_counts[block_id] = 1
        return block_id

    def fork(self, source: Sequence, seq: Sequence, num_tokens: int) -> tuple[int, int] | None:
        """Give `seq` the cache of source's first num_tokens tokens: the blocks they fill are shared, the block
        holding token num_tokens (which seq writes next) is a fresh one. Returns (source block, fresh block) for
        the caller to copy on the device, or None when no block is free (seq then starts from scratch)."""
        if not self.free_block_ids:
            return None
        num_shared = num_tokens // self.block_size
        shared = source.block_table[:num_shared]
        for block_id in shared:
            self.ref_counts[block_id] += 1
        fresh = self._take()
        seq.block_table = shared + [fresh]
        seq.num_computed_tokens = num_tokens
        seq.metrics.num_reused_blocks += num_shared
        seq.metrics.num_new_blocks += 1
        return source.block_table[num_shared], fresh

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
