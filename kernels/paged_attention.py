"""Paged attention: prefill (flash-style online softmax over packed variable-length queries, causal, reading the
earlier context from the paged cache) and decode (one query per sequence, GQA groups share each KV tile read,
optional split-K over the context).

Keys are read in tiles of BLOCK_N positions, each position through its own block-table entry, so the tile
(>= 16, as tl.dot needs) does not depend on the page size. Loads past a sequence's length return 0 and never
touch its unused block-table entries; cache offsets are computed in int64.
"""
import os

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata

# triton 3.7's interpreter computes garbage for bf16 tl.dot: there (only) the dots run in fp32
DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc):
    """Fold one tile of scores s [rows, keys] (-inf where hidden) and values v [keys, d] into the running max
    m_i, sum l_i and output acc; rows that have seen no visible key yet stay at zero."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, kv_base, k_pos, seq_len, d, d_mask, stride_cb, stride_cs,
                  BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr):
    """K and V [BLOCK_N, BLOCK_D] at key positions k_pos of one sequence (table_ptr: its block-table row);
    positions outside [0, seq_len) load 0 without reading their table entry."""
    inside = (k_pos >= 0) & (k_pos < seq_len)
    block_id = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=inside, other=0).to(tl.int64)
    rows = kv_base + block_id * stride_cb + (k_pos % BLOCK_SIZE).to(tl.int64) * stride_cs
    mask = inside[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=mask, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_starts_ptr, seq_lens_ptr,
                    scale, window, stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_cb, stride_cs,
                    stride_bt, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_starts_ptr + seq)
    q_len = tl.load(query_starts_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_q_pos = seq_len - q_len
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = first_q_pos + offs_m
    kv_base = (head // GROUP).to(tl.int64) * stride_ch
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    key_end = tl.minimum(first_q_pos + (m_block + 1) * BLOCK_M, seq_len)
    key_start = tl.where(window > 0, tl.maximum(first_q_pos + m_block * BLOCK_M - window + 1, 0), 0)
    offs_n = tl.arange(0, BLOCK_N)
    for tile_start in range((key_start // BLOCK_N) * BLOCK_N, key_end, BLOCK_N):
        k_pos = tile_start + offs_n
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, kv_base, k_pos, seq_len, d, d_mask, stride_cb,
                             stride_cs, BLOCK_SIZE, DOT_FP32)                   # [BLOCK_N, BLOCK_D] each
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale             # [BLOCK_M, BLOCK_N]
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
        if window > 0:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _online_softmax_step(tl.where(visible, s, float("-inf")), v, m_i, l_i, acc)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_rows = (q_start + offs_m).to(tl.int64)
    tl.store(out_ptr + out_rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr, block_tables_ptr,
                   query_starts_ptr, seq_lens_ptr, scale, window, stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_ch, stride_cb, stride_cs, stride_bt, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    token = tl.load(query_starts_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)                 # [GROUP_PAD, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)
    kv_base = kv_head.to(tl.int64) * stride_ch
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    first_tile = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0) // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = first_tile + split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, first_tile + num_tiles)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * BLOCK_N + offs_n
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, kv_base, k_pos, seq_len, d, d_mask, stride_cb,
                             stride_cs, BLOCK_SIZE, DOT_FP32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale             # [GROUP_PAD, BLOCK_N]
        visible = k_pos < seq_len
        if window > 0:
            visible = visible & (k_pos > seq_len - 1 - window)
        m_i, l_i, acc = _online_softmax_step(tl.where(visible[None, :], s, float("-inf")), v, m_i, l_i, acc)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:                                         # partial results: [num_seqs, num_heads, NUM_SPLITS, ...]
        row = ((seq * num_heads + heads) * NUM_SPLITS + split).to(tl.int64)
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(out_ptr, part_acc_ptr, part_ml_ptr, query_starts_ptr, stride_ot, stride_oh,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = ((seq * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = tl.load(part_ml_ptr + row * 2)
    l = tl.load(part_ml_ptr + row * 2 + 1)
    acc = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :])
    m_max = tl.max(m, 0)
    w = tl.exp(m - m_max)                         # empty splits have m = -inf: weight 0
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    token = tl.load(query_starts_ptr + seq).to(tl.int64)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def key_tile(block_size: int) -> int:
    """Keys per tile: at least 16 (tl.dot's minimum), whatever the page size."""
    return min(64, max(16, block_size))


def prefill_config(head_dim: int, block_size: int) -> dict:
    # BLOCK_M 16 keeps the tile count low for short chunks; a GPU build could autotune 32/64 for long prompts
    return {"BLOCK_SIZE": block_size, "HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim),
            "BLOCK_M": 16, "BLOCK_N": key_tile(block_size)}


def decode_config(head_dim: int, block_size: int, group: int, num_seqs: int, num_kv_heads: int,
                  max_seq_len: int) -> dict:
    # split-K only when (sequence, KV head) programs are too few to fill a GPU and contexts are long
    num_splits = 1
    if num_seqs * num_kv_heads < 128 and max_seq_len > 1024:
        num_splits = min(16, triton.next_power_of_2(max_seq_len // 512))
    return {"GROUP": group, "GROUP_PAD": max(16, triton.next_power_of_2(group)), "BLOCK_SIZE": block_size,
            "HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim), "BLOCK_N": key_tile(block_size),
            "NUM_SPLITS": num_splits}


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Semantics:
        for s in range(num_seqs):
            tokens = range(query_starts[s], query_starts[s + 1]); L = seq_lens[s]
            K, V = the first L cached positions of sequence s (through block_tables[s]), head h reads KV head h // group
            out[tokens] = softmax(q[tokens] @ K^T * scale, causal: query i sits at position L - len(tokens) + i,
                                  and sees keys within sliding_window of it) @ V
    q: [num_tokens, num_heads, head_dim]; caches: [num_kv_heads, num_blocks, block_size, head_dim] -> like q.
    Pure decode batches take the decode kernel (split-K when it pays); any prefill takes the prefill kernel.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    num_seqs = meta.seq_lens.shape[0]
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype and num_heads % num_kv_heads == 0
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.stride(1) == 1
    out = torch.empty_like(q)
    window = sliding_window or 0
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    common = (scale, window, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_strides,
              meta.block_tables.stride(0))
    group = num_heads // num_kv_heads
    if meta.max_query_len > 1:
        cfg = prefill_config(head_dim, block_size)
        grid = (triton.cdiv(meta.max_query_len, cfg["BLOCK_M"]), num_heads, num_seqs)
        _prefill_kernel[grid](q, k_cache, v_cache, out, meta.block_tables, meta.query_starts, meta.seq_lens,
                              *common, GROUP=group, DOT_FP32=DOT_FP32, **cfg)
        return out
    cfg = decode_config(head_dim, block_size, group, num_seqs, num_kv_heads, meta.max_seq_len)
    if num_splits is not None:
        cfg["NUM_SPLITS"] = num_splits
    splits = cfg["NUM_SPLITS"]
    part_acc = torch.empty(num_seqs * num_heads * splits, cfg["BLOCK_D"], dtype=torch.float32, device=q.device)
    part_ml = torch.empty(num_seqs * num_heads * splits, 2, dtype=torch.float32, device=q.device)
    _decode_kernel[(num_seqs, num_kv_heads, splits)](q, k_cache, v_cache, out, part_acc, part_ml, meta.block_tables,
                                                     meta.query_starts, meta.seq_lens, *common, DOT_FP32=DOT_FP32,
                                                     **cfg)
    if splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](out, part_acc, part_ml, meta.query_starts, out.stride(0),
                                                     out.stride(1), HEAD_DIM=head_dim, BLOCK_D=cfg["BLOCK_D"],
                                                     NUM_SPLITS=splits)
    return out
