"""Paged attention: the Triton kernel against the torch reference (interpreter on CPU)."""
from dataclasses import replace

import pytest
import torch

from kernels import reference
from kernels.metadata import AttentionMetadata
from kernels.paged_attention import TILE_N, attention_config, num_kv_splits, num_query_blocks, paged_attention
from kernels.quant import dequantize_kv, quantize_kv
from tests.helpers import DEVICES, KERNEL_DEVICES

TOL = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def make_batch(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device="cpu"):
    """Random caches and queries on the device; each sequence's blocks are scattered through the pool in shuffled
    order; unused block-table entries point at block 0 (another sequence's)."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks).tolist()
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    for s, n in enumerate(blocks_per_seq):
        table[s, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_heads, head_dim).to(dtype)
    meta = AttentionMetadata(torch.tensor(starts, dtype=torch.int32, device=device),
                             torch.tensor(seq_lens, dtype=torch.int32, device=device), table.to(device),
                             torch.zeros(0, dtype=torch.int32, device=device), starts, list(seq_lens), max(query_lens),
                             max(seq_lens))
    return q.to(device), k_cache.to(device), v_cache.to(device), meta


def check(q, k_cache, v_cache, meta, dtype, **kwargs):
    scale = q.shape[-1] ** -0.5
    want = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale,
                                     kwargs.get("sliding_window"), kwargs.get("softcap"))
    got = paged_attention(q, k_cache, v_cache, meta, scale, **kwargs)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_with_cached_context_matches_reference(dtype, head_dim, group, block_size, device):
    # a whole prompt, a later chunk over cached context, a decode step mixed in, and a single-token prompt
    seq_lens, query_lens = [37, 50, 21, 1], [37, 18, 1, 1]
    check(*make_batch(seq_lens, query_lens, 2 * group, 2, head_dim, block_size, dtype, device), dtype)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference(dtype, head_dim, group, block_size, device):
    seq_lens = [1, 17, 45, 70]
    check(*make_batch(seq_lens, [1] * 4, 2 * group, 2, head_dim, block_size, dtype, device), dtype)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("block_size", [1, 4, 8])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [9, 1, 20]])
def test_pages_smaller_than_the_key_tile_match_reference(block_size, query_lens, device):
    seq_lens = [5, 33, 20]
    check(*make_batch(seq_lens, query_lens, 4, 2, 64, block_size, torch.float32, device), torch.float32)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("num_splits", [2, 4])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [3, 1, 70]])
def test_split_k_matches_reference(num_splits, query_lens, device):
    seq_lens = [3, 133, 200]                    # some splits of the short sequences are empty
    check(*make_batch(seq_lens, query_lens, 4, 1, 64, 16, torch.float32, device), torch.float32, num_splits=num_splits)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("group", [5, 8])
def test_a_long_chunk_beside_decodes_at_8b_head_shapes_matches_reference(group, device):
    # one 150-token chunk over 60 cached positions (64-row tiles, many query blocks) beside nine decodes
    seq_lens, query_lens = [210] + [1 + 23 * i for i in range(9)], [150] + [1] * 9
    check(*make_batch(seq_lens, query_lens, 2 * group, 2, 128, 16, torch.bfloat16, device), torch.bfloat16)


def test_query_blocks_cover_every_split_of_the_tokens():
    # each sequence starts a block of its own: query_starts[s] // block_q + s, and needs cdiv(len, block_q) blocks
    for block_q in (1, 2, 4, 16):
        for query_lens in ([1] * 7, [5, 1, 17, 3], [16, 16, 1], [33]):
            starts = [sum(query_lens[:s]) for s in range(len(query_lens) + 1)]
            firsts = [starts[s] // block_q + s for s in range(len(query_lens))]
            ends = [first + -(-n // block_q) for first, n in zip(firsts, query_lens)]
            assert all(end <= nxt for end, nxt in zip(ends, firsts[1:]))
            assert ends[-1] <= num_query_blocks(starts[-1], len(query_lens), block_q)


def test_tiles_and_splits_follow_the_step():
    assert attention_config(128, 16, 4, 1)["BLOCK_M"] == 16 and attention_config(128, 16, 4, 1)["BLOCK_Q"] == 4
    assert attention_config(128, 16, 4, 500)["BLOCK_M"] == 64
    assert attention_config(128, 16, 32, 1)["BLOCK_Q"] == 1
    assert attention_config(64, 1, 1, 1)["TILE_N"] == TILE_N          # the key tile does not follow the page
    assert num_kv_splits(8, 1000, 132) == 8                           # one stream of an 8B model, 1000 tokens
    assert num_kv_splits(8, 100_000, 132) == 16
    assert num_kv_splits(256, 100_000, 132) == 1                       # the grid already fills the GPU
    assert num_kv_splits(8, 100, 132) == 1                             # one key tile: nothing to split
    assert num_kv_splits(160, 100_000, 132) == 2                       # 1.2 waves: a second one 79% idle
    assert num_kv_splits(264, 100_000, 132) == 1                       # two whole waves: splitting gains nothing
    assert num_kv_splits(1, 100_000, 1) == 1                           # the interpreter: one "SM"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("max_query_len", [1, 9])
def test_sliding_window_matches_reference(max_query_len, device):
    seq_lens = [40, 29]
    check(*make_batch(seq_lens, [max_query_len, 1], 4, 2, 64, 16, torch.float32, device), torch.float32,
          sliding_window=12)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("max_query_len", [1, 9])
def test_soft_capped_scores_match_reference(max_query_len, device):
    """Gemma 2's scores soft-capped (softcap * tanh(s / softcap)) before the mask and the softmax."""
    q, k_cache, v_cache, meta = make_batch([40, 29], [max_query_len, 1], 4, 2, 64, 16, torch.float32, device)
    check(q * 4, k_cache, v_cache, meta, torch.float32, sliding_window=12, softcap=1.5)     # scores well past 1.5
    plain = reference.paged_attention(q.float() * 4, k_cache.float(), v_cache.float(), meta, 0.125, 12)
    capped = reference.paged_attention(q.float() * 4, k_cache.float(), v_cache.float(), meta, 0.125, 12, 1.5)
    assert (plain - capped).abs().max() > 0.1                                    # the cap bends these scores


def check_ignores_stale_cache(attention, query_lens, device):
    """NaN everywhere in the cache but each sequence's own positions (its unused table entries point at block 0,
    another sequence's or a NaN block): the result equals the reference on the clean cache."""
    seq_lens = [5, 30, 17]
    q, k_cache, v_cache, meta = make_batch(seq_lens, query_lens, 4, 2, 64, 16, torch.float32, device)
    want = reference.paged_attention(q, k_cache, v_cache, meta, 0.125)
    used = torch.zeros(k_cache.shape[1], k_cache.shape[2], dtype=torch.bool, device=device)
    for s, n in enumerate(seq_lens):
        for p in range(n):
            used[meta.block_tables[s, p // 16], p % 16] = True
    k_cache[:, ~used] = float("nan")
    v_cache[:, ~used] = float("nan")
    meta.torch_plan = None
    got = attention(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [5, 1, 1]])
def test_torch_path_never_lets_stale_cache_values_reach_a_result(query_lens, device):
    check_ignores_stale_cache(reference.paged_attention, query_lens, device)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [5, 1, 1]])
def test_kernels_never_let_stale_cache_values_reach_a_result(query_lens, device):
    check_ignores_stale_cache(paged_attention, query_lens, device)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_llama_8b_decode_with_a_graphs_fixed_split_count_matches_reference(device):
    # 32 query heads on 8 KV heads, head dim 128, bf16; contexts of 3 to 1000 tokens over 8 fixed splits (most
    # splits of the short ones find no key)
    seq_lens = [1000, 517, 64, 3]
    check(*make_batch(seq_lens, [1] * 4, 32, 8, 128, 16, torch.bfloat16, device), torch.bfloat16, num_splits=8)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_a_padding_row_with_no_context_gives_zeros_not_nan(device, num_splits):
    """A CUDA graph pads a decode step with rows of seq_len 0: every split of such a row sees no key. Its output
    is zeros (the reduce used to compute exp(-inf - -inf): NaN), and the real rows still match the reference."""
    q, k_cache, v_cache, meta = make_batch([40, 1], [1, 1], 4, 1, 64, 16, torch.float32, device)
    meta.seq_lens[1] = 0
    meta.seq_lens_list[1] = 0
    got = paged_attention(q, k_cache, v_cache, meta, 0.125, num_splits=num_splits)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    want = reference.paged_attention(q[:1], k_cache, v_cache, replace(meta, query_starts=meta.query_starts[:2],
                                     seq_lens=meta.seq_lens[:1], block_tables=meta.block_tables[:1],
                                     query_starts_list=[0, 1], seq_lens_list=[40]), 0.125)
    torch.testing.assert_close(got[:1], want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


CACHE_KINDS = {"int8": (torch.int8, 127), "fp8": (torch.uint8, 448)}     # kv_cache_dtype -> storage, largest value


def quantized_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, kind: str = "int8"
                     ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """The caches as an INT8 or FP8 cache holds them, against scales of their largest magnitudes / 127 (448)."""
    cache_dtype, largest = CACHE_KINDS[kind]
    scales = (k_cache.float().abs().max().item() / largest, v_cache.float().abs().max().item() / largest)
    return quantize_kv(k_cache, scales[0], cache_dtype), quantize_kv(v_cache, scales[1], cache_dtype), scales


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(CACHE_KINDS))
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [7, 1, 20]])
def test_the_reference_reads_a_quantized_cache_as_its_dequantized_values(query_lens, kind, device):
    q, k_cache, v_cache, meta = make_batch([30, 9, 20], query_lens, 4, 2, 64, 16, torch.bfloat16, device)
    k8, v8, scales = quantized_caches(k_cache, v_cache, kind)
    got = reference.paged_attention(q, k8, v8, meta, 0.125, 12, 3.0, kv_scales=scales)
    want = reference.paged_attention(q.float(), dequantize_kv(k8, scales[0]), dequantize_kv(v8, scales[1]), meta,
                                     0.125, 12, 3.0)
    assert got.dtype == torch.bfloat16 and k8.dtype == CACHE_KINDS[kind][0]
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)          # (rounded once to bf16)


def test_an_fp8_cache_holds_e4m3_rounded_to_nearest():
    """quantize_kv's FP8 values: x / scale clamped to 448 and rounded to e4m3 (torch's rounding), their bits."""
    x = torch.tensor([0.0, 1.0, -3.3, 500.0, -1000.0, 1e-4, 0.0625 + 1e-6])
    got = quantize_kv(x, 0.5, torch.uint8)
    assert got.dtype == torch.uint8
    assert torch.equal(dequantize_kv(got, 0.5), torch.tensor([0.0, 1.0, -3.25, 224.0, -224.0, 0.0, 0.0625]))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("kind", list(CACHE_KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("query_lens,group", [([1, 1, 1, 1], 4), ([37, 18, 1, 1], 3)])
def test_a_quantized_cache_matches_reference(dtype, kind, num_splits, query_lens, group, device):
    """An INT8 or FP8 cache (kv_scales): K's scale folded into the scores' and V's applied to the sums, the values
    converted to q's dtype exactly (FP8 through fp16's bits); decode steps and prompt chunks, split or not,
    soft-capped and windowed."""
    q, k_cache, v_cache, meta = make_batch([37, 50, 21, 100], query_lens, 2 * group, 2, 64, 16, dtype, device)
    k8, v8, scales = quantized_caches(k_cache, v_cache, kind)
    for window, softcap in ((None, None), (12, 2.0)):
        meta.torch_plan = None
        want = reference.paged_attention(q, k8, v8, meta, 0.125, window, softcap, kv_scales=scales)
        got = paged_attention(q, k8, v8, meta, 0.125, window, softcap, num_splits=num_splits, kv_scales=scales)
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
