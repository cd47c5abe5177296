"""Paged attention in one kernel for every step: prefill chunks and decode tokens of all sequences in one launch.

The grid is flat over query blocks: each sequence's queries are cut into blocks of BLOCK_Q tokens, and a program
takes one block and one KV head, with the GQA group's query heads packed into the tile rows (BLOCK_M =
BLOCK_Q * group rows), so each K/V tile is read once per group. Keys are read in tiles of TILE_N positions, each
through its own block-table entry, so the tile does not depend on the page size. When the programs are fewer than
the GPU's SMs, the context is split over NUM_SPLITS programs and a reduce kernel merges their partial softmaxes.
Loads past a sequence's length return 0 and never touch its unused block-table entries; cache offsets are int64.
"""
import functools

import torch
import triton
import triton.language as tl

from kernels.fp8 import E4M3_FP16_GAP, e4m3_to_fp16
from kernels.metadata import DOT_FP32, UNSPECIALIZED_ARGS, AttentionMetadata
from kernels.quant import cache_format

TILE_N = 64                                       # keys per tile
MAX_SPLITS = 16
MAX_IDLE = 0.25                               # of a step's SM slots; a model, not yet tuned on a GPU
MAX_PARTIAL_BYTES = 256 << 20                     # split only while the partial results stay this small


@triton.jit
def _find_sequence(query_starts_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence of flat query block q_block: sequence s owns blocks from query_starts[s] // BLOCK_Q + s on
    (one spare block each, so that no block is shared), found by binary search."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_starts_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=UNSPECIALIZED_ARGS["_attention_kernel"])
def _attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr, block_tables_ptr,
                      query_starts_ptr, seq_lens_ptr, num_seqs, scale, v_scale, window, softcap, stride_qt, stride_qh,
                      stride_ot, stride_oh, stride_ch, stride_cb, stride_cs, stride_bt, GROUP: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, QUANT: tl.constexpr):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_sequence(query_starts_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_starts_ptr + seq)
    q_len = tl.load(query_starts_ptr + seq + 1) - q_start
    first_q = (q_block - q_start // BLOCK_Q - seq) * BLOCK_Q      # this block's first query within the sequence
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len                                 # positions cached before this step
    rows = tl.arange(0, BLOCK_M)
    q_off = first_q + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (q_off < q_len)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    tokens = (q_start + q_off).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)               # [BLOCK_M, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = context_len + q_off
    key_end = tl.minimum(context_len + first_q + BLOCK_Q, seq_len)
    key_start = tl.where(window > 0, tl.maximum(context_len + first_q - window + 1, 0), 0)
    first_tile = key_start // TILE_N
    num_tiles = tl.cdiv(key_end, TILE_N) - first_tile
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = first_tile + split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, first_tile + num_tiles)
    kv_base = kv_head.to(tl.int64) * stride_ch
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE_N + offs_n
        inside = k_pos < seq_len
        block_id = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=inside, other=0).to(tl.int64)
        kv_rows = kv_base + block_id * stride_cb + (k_pos % BLOCK_SIZE).to(tl.int64) * stride_cs
        kv_mask = inside[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)   # [TILE_N, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if QUANT == 2:                                     # FP8: e4m3 / 2^8 as fp16, exact (the scales take 2^8)
            k = e4m3_to_fp16(k)
            v = e4m3_to_fp16(v)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif QUANT:                                        # INT8 or FP8 values, exact in q's dtype
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale                 # [BLOCK_M, TILE_N]
        if SOFTCAP:                                        # softcap * tanh(s / softcap), as 1 - 2 / (e^2x + 1)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        visible = (k_pos[None, :] <= q_pos[:, None]) & inside[None, :]
        if window > 0:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # rows that have seen no key yet stay at zero
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    if QUANT:
        acc = acc * v_scale
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    else:                                         # partial results: [num_tokens, num_heads, NUM_SPLITS, ...]
        part = ((tokens * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split).to(tl.int64)
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=row_mask[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_mask)


@triton.jit
def _reduce_kernel(out_ptr, part_acc_ptr, part_ml_ptr, stride_ot, stride_oh, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (token * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    m = tl.load(part_ml_ptr + part * 2)
    l = tl.load(part_ml_ptr + part * 2 + 1)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :])
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)    # a row with no key at all (a graph's padding row)
    w = tl.exp(m - m_max)                        # splits that saw no key have m = -inf: weight 0
    denominator = tl.sum(l * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denominator == 0.0, 1.0, denominator)    # such a row: zeros
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def attention_config(head_dim: int, block_size: int, group: int, max_query_len: int) -> dict:
    """Tile rows: 16 (tl.dot's minimum) for decode steps, 64 once a step holds prompt chunks long enough to fill
    them (32 for heads wider than 128: 64 rows of 256 spill on sm_90, scripts/compile_kernels.py); at least the whole
    GQA group."""
    rows = max(16, triton.next_power_of_2(group))
    if max_query_len * group >= 64:
        rows = max(rows, 64 if head_dim <= 128 else 32)
    return {"GROUP": group, "BLOCK_SIZE": block_size, "HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim),
            "BLOCK_M": rows, "BLOCK_Q": rows // group, "TILE_N": TILE_N}


def num_query_blocks(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Grid size over query blocks: enough for any split of num_tokens into num_seqs sequences."""
    return num_tokens // block_q + num_seqs


def num_kv_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """The smallest split count (a power of two up to MAX_SPLITS, each split at least one key tile of the longest
    context) whose programs leave at most MAX_IDLE of the SM slots of their waves idle, else the one that leaves
    the fewest: 8 programs on 132 SMs split 16 ways (one wave, 3% idle), 160 programs 2 ways (3 waves, 19% idle,
    where one split leaves 39% of 2 waves idle), 264 (two whole waves) and 100 (24%) do not split."""
    def idle(splits: int) -> float:
        slots = -(-num_programs * splits // num_sms) * num_sms
        return 1 - num_programs * splits / slots
    allowed = [s for s in (1 << i for i in range(MAX_SPLITS.bit_length())) if s == 1 or max_seq_len >= s * TILE_N]
    good = [s for s in allowed if idle(s) <= MAX_IDLE]
    return good[0] if good else min(allowed, key=idle)


@functools.cache
def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; 1 elsewhere (the interpreter gains nothing from splits)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_graph_splits(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                        max_seq_len: int, device: torch.device) -> int:
    """The split count of a decode step of num_seqs sequences whose contexts may reach max_seq_len, fixed once for
    a CUDA graph (splits that find no keys cost one early exit)."""
    cfg = attention_config(head_dim, block_size, num_heads // num_kv_heads, 1)
    return num_kv_splits(num_query_blocks(num_seqs, num_seqs, cfg["BLOCK_Q"]) * num_kv_heads, max_seq_len,
                         sm_count(device))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, softcap: float | None = None,
                    num_splits: int | None = None, kv_scales: tuple[float, float] | None = None) -> torch.Tensor:
    """Semantics:
        for s in range(num_seqs):
            tokens = range(query_starts[s], query_starts[s + 1]); L = seq_lens[s]
            K, V = the first L cached positions of sequence s (through block_tables[s]), head h reads KV head h // group
            (an INT8 or FP8 cache: dequantize_kv(K, kv_scales[0]), dequantize_kv(V, kv_scales[1]); kernels.quant)
            S = q[tokens] @ K^T * scale; if softcap: S = softcap * tanh(S / softcap)
            out[tokens] = softmax(S, causal: query i sits at position L - len(tokens) + i, and sees keys within
                                  sliding_window of it) @ V
    q: [num_tokens, num_heads, head_dim]; caches: [num_kv_heads, num_blocks, block_size, head_dim] -> like q.
    One launch (two with split-K); num_splits (or meta.num_splits, CUDA graphs) fixes the split count, else it
    follows the SM count.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    num_seqs = meta.seq_lens.shape[0]
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.dtype == v_cache.dtype
    quant = cache_format(k_cache.dtype, q.dtype, kv_scales)
    k_scale, v_scale = (1.0, 1.0) if kv_scales is None else kv_scales
    if quant == 2:
        k_scale, v_scale = k_scale * E4M3_FP16_GAP, v_scale * E4M3_FP16_GAP
    assert num_heads % num_kv_heads == 0
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.stride(1) == 1
    out = torch.empty_like(q)
    group = num_heads // num_kv_heads
    cfg = attention_config(head_dim, block_size, group, meta.max_query_len)
    num_blocks = num_query_blocks(num_tokens, num_seqs, cfg["BLOCK_Q"])
    num_splits = num_splits or meta.num_splits
    if num_splits is None:
        num_splits = num_kv_splits(num_blocks * num_kv_heads, meta.max_seq_len, sm_count(q.device))
        while num_splits > 1 and num_tokens * num_heads * num_splits * cfg["BLOCK_D"] * 4 > MAX_PARTIAL_BYTES:
            num_splits //= 2
    num_parts = num_tokens * num_heads * num_splits if num_splits > 1 else 0
    part_acc = torch.empty(num_parts, cfg["BLOCK_D"], dtype=torch.float32, device=q.device)
    part_ml = torch.empty(num_parts, 2, dtype=torch.float32, device=q.device)
    if num_tokens == 0:
        return out
    _attention_kernel[(num_blocks, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_acc, part_ml, meta.block_tables, meta.query_starts, meta.seq_lens, num_seqs,
        scale * k_scale, v_scale, sliding_window or 0,
        softcap or 0.0, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), meta.block_tables.stride(0), NUM_SPLITS=num_splits, SOFTCAP=bool(softcap),
        DOT_FP32=DOT_FP32, QUANT=quant, **cfg)
    if num_splits > 1:
        _reduce_kernel[(num_tokens, num_heads)](out, part_acc, part_ml, out.stride(0), out.stride(1),
                                                HEAD_DIM=head_dim, BLOCK_D=cfg["BLOCK_D"], NUM_SPLITS=num_splits)
    return out
