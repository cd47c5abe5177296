"""Paged KV cache bookkeeping: a fixed pool of blocks, per-sequence block tables, reference counts (the samples
of one prompt share its blocks), and with reuse on, a cache of full blocks by content.

Reuse (TensorRT-LLM's enable_kv_cache_reuse): every full block is named by a digest of the tokens up to its end
and of the adapter that computed it (a LoRA's KV never serves another adapter or the base). A block whose last
user leaves keeps its contents and its name, in an LRU of evictable blocks; a new sequence takes the longest run
of named blocks matching its prompt instead of computing them. Blank blocks go out first, then the least
recently used evictable ones.
"""
import hashlib
from collections import OrderedDict, deque

from backend.core.request import Sequence


def num_kv_blocks(memory_bytes: int, block_size: int, num_layers: int, num_kv_heads: int,
                  head_dim: int, dtype_bytes: int) -> int:
    """How many blocks fit a memory budget (K and V, every layer)."""
    block_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes
    return memory_bytes // block_bytes


def block_digest(parent: bytes, adapter_key: bytes, token_ids: list[int]) -> bytes:
    """The name of a full block: its tokens, everything before them (parent) and the adapter (collision-proof:
    a name is all that stands between one tenant's KV and another's)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(adapter_key)
    h.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return h.digest()


class BlockManager:
    """Hands out cache blocks. A sequence's block table covers every token it has (or is about to have)
    in the cache; blocks are reference counted so that sequences can share them."""

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0, enable_reuse: bool = False):
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget holds no block of {block_size} tokens: raise kv_cache_memory_bytes")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_reuse = enable_reuse
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))     # blank
        self.evictable: OrderedDict[int, None] = OrderedDict()          # free, named; least recently used first
        self.named: dict[bytes, int] = {}                               # digest -> block
        self.name_of: dict[int, bytes] = {}                             # and back
        self.num_lookups = 0                                            # prompt blocks looked up
        self.num_hits = 0                                               # and found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        num_tokens = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, keep_watermark: bool = False,
                     num_more: int = 0) -> bool:
        """num_new_tokens more fit, and num_more blocks besides (a beam search's first round: a last block a beam)."""
        reserve = self.watermark_blocks if keep_watermark else 0
        return self.num_blocks_needed(seq, num_new_tokens) + num_more <= self.num_free_blocks - reserve

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table so that num_new_tokens more tokens fit."""
        needed = self.num_blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"allocate: {needed} blocks needed, {self.num_free_blocks} free")
        for _ in range(needed):
            seq.block_table.append(self._take())
        if needed:
            seq.metrics = seq.metrics.copy()         # (outputs sent already hold the old one)
            seq.metrics.num_new_blocks += needed

    def _take(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:                                       # the least recently used named block loses its name
            block_id, _ = self.evictable.popitem(last=False)
            del self.named[self.name_of.pop(block_id)]
        self.ref_counts[block_id] = 1
        return block_id

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no cache yet the named blocks that hold the longest cached prefix of its tokens
        (never its last token, which must run to sample). Returns how many blocks it got."""
        if not self.enable_reuse or seq.block_table or seq.params.reads_prompt_logits:
            return 0                                # (a reused prompt has no logits to return)
        digests = self._digests(seq, (seq.num_tokens - 1) // self.block_size)
        for digest in digests:
            block_id = self.named.get(digest)
            if block_id is None:
                break
            if self.ref_counts[block_id] == 0:
                del self.evictable[block_id]
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)
        num_matched = len(seq.block_table)
        seq.num_computed_tokens = num_matched * self.block_size
        seq.block_digests = digests[:num_matched]
        return num_matched

    def count_reuse(self, seq: Sequence, num_matched: int) -> None:
        """A sequence starts with num_matched blocks from the cache: its figures and the hit rate's."""
        if self.enable_reuse:
            if num_matched:                          # (a sequence preempted has sent outputs holding its figures)
                seq.metrics = seq.metrics.copy()
                seq.metrics.num_reused_blocks += num_matched
            self.num_lookups += (seq.num_tokens - 1) // self.block_size
            self.num_hits += num_matched

    def commit(self, seq: Sequence) -> None:
        """Name the sequence's blocks that its computed tokens now fill (those whose ids the host has: a step ahead
        computes a token still on its way back)."""
        num_full = min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size
        if not self.enable_reuse or num_full == len(seq.block_digests):
            return                                  # (every step: most steps fill no block)
        digests = self._digests(seq, num_full)
        for index in range(len(seq.block_digests), len(digests)):
            block_id = seq.block_table[index]
            if digests[index] not in self.named and block_id not in self.name_of:
                self.named[digests[index]] = block_id
                self.name_of[block_id] = digests[index]
        seq.block_digests = digests

    def _digests(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        digests = list(seq.block_digests[:num_blocks])
        if len(digests) == num_blocks:
            return digests
        tokens, size = seq.token_ids, self.block_size
        for i in range(len(digests), num_blocks):
            digests.append(block_digest(digests[-1] if digests else b"", seq.adapter_key,
                                        tokens[i * size:(i + 1) * size]))
        return digests

    def fork(self, source: Sequence, seq: Sequence, num_tokens: int) -> tuple[int, int] | None:
        """Give `seq` the cache of source's first num_tokens tokens: the blocks they fill are shared, the block
        holding token num_tokens (which seq writes next) is a fresh one. Returns (source block, fresh block) for
        the caller to copy on the device, or None when no block is free (seq then starts from scratch)."""
        if not self.num_free_blocks:
            return None
        num_shared = num_tokens // self.block_size
        shared = source.block_table[:num_shared]
        for block_id in shared:
            self.ref_counts[block_id] += 1
        fresh = self._take()
        seq.block_table = shared + [fresh]
        seq.block_digests = source.block_digests[:num_shared]
        seq.num_computed_tokens = num_tokens
        seq.metrics.num_reused_blocks += num_shared
        seq.metrics.num_new_blocks += 1
        return source.block_table[num_shared], fresh

    def adopt(self, seq: Sequence, source: Sequence) -> tuple[int, int] | None:
        """Give `seq`, which holds no blocks, the cache of another beam's computed tokens: its full blocks shared, its
        partial last one copied into a fresh block. Returns (source block, fresh block) for the caller to copy on the
        device; None where there is nothing to copy, or no free block (seq then computes that block's tokens
        again)."""
        num_tokens, num_shared = source.num_computed_tokens, source.num_computed_tokens // self.block_size
        shared = source.block_table[:num_shared]
        for block_id in shared:
            self.ref_counts[block_id] += 1
        seq.block_table, seq.block_digests = shared, source.block_digests[:num_shared]
        seq.num_computed_tokens = num_shared * self.block_size
        if num_tokens == seq.num_computed_tokens or not self.num_free_blocks:
            return None
        fresh = self._take()
        seq.block_table = shared + [fresh]
        seq.num_computed_tokens = num_tokens
        return source.block_table[num_shared], fresh

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if block_id in self.name_of:
                    self.evictable[block_id] = None
                else:
                    self.free_block_ids.append(block_id)
        seq.block_table = []
        seq.block_digests = []
        seq.num_computed_tokens = 0
