"""The block manager: allocation grows block tables, free returns every block, reference counts hold."""
import pytest

from backend.core.kv_cache import BlockManager, num_kv_blocks
from backend.core.request import SamplingParams, Sequence


def make_seq(num_tokens: int, request_id: int = 0) -> Sequence:
    return Sequence(request_id, list(range(num_tokens)), SamplingParams())


@pytest.mark.parametrize("block_size", [4, 16])
def test_allocate_covers_exactly_the_tokens(block_size):
    blocks = BlockManager(num_blocks=10, block_size=block_size)
    seq = make_seq(block_size + 1)
    assert blocks.num_blocks_needed(seq, seq.num_tokens) == 2
    blocks.allocate(seq, seq.num_tokens)
    assert len(seq.block_table) == 2 and blocks.num_free_blocks == 8
    seq.num_computed_tokens = seq.num_tokens
    assert blocks.num_blocks_needed(seq, 1) == 0          # the second block still has room
    seq.num_computed_tokens = 2 * block_size
    assert blocks.num_blocks_needed(seq, 1) == 1


def test_free_returns_blocks_and_ref_counts():
    blocks = BlockManager(num_blocks=6, block_size=4)
    a, b = make_seq(9, 0), make_seq(4, 1)
    blocks.allocate(a, 9)
    blocks.allocate(b, 4)
    assert sorted(a.block_table + b.block_table) == [0, 1, 2, 3]
    assert all(blocks.ref_counts[i] == 1 for i in a.block_table + b.block_table)
    blocks.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert blocks.num_free_blocks == 5
    blocks.free(b)
    assert blocks.num_free_blocks == blocks.num_blocks and set(blocks.ref_counts) == {0}


def test_can_allocate_is_a_pure_predicate_and_respects_the_watermark():
    blocks = BlockManager(num_blocks=10, block_size=4, watermark=0.2)
    seq = make_seq(36)
    assert not blocks.can_allocate(make_seq(41), 41)      # 11 blocks > 10
    assert blocks.can_allocate(seq, 36)                   # 9 blocks <= 10
    assert not blocks.can_allocate(seq, 36, keep_watermark=True)   # 9 blocks > 10 - 2 kept free
    assert blocks.num_free_blocks == 10 and seq.block_table == []
    with pytest.raises(RuntimeError, match="blocks needed"):
        blocks.allocate(make_seq(48), 48)


def test_pool_size_follows_the_memory_budget():
    per_block = 2 * 30 * 16 * 3 * 64 * 2                   # K and V, 30 layers, 16 tokens, 3 heads x 64, bf16
    assert num_kv_blocks(per_block * 7 + 1, 16, 30, 3, 64, 2) == 7
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        BlockManager(num_blocks=0, block_size=16)
