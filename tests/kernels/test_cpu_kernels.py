"""The compiled CPU kernels (kernels/cpu_ext.py, through kernels/cpu_ops.py) against the torch reference."""
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kernels import cpu_ext, cpu_ops, reference
from kernels.metadata import AttentionMetadata
from kernels.quant import quantize_weight
from tests.helpers import cpu_kernels_build
from tests.kernels.test_fused import assert_within_a_step
from tests.kernels.test_paged_attention import (CACHE_KINDS, TOL, check_ignores_stale_cache, make_batch,
                                               quantized_caches)

pytestmark = pytest.mark.skipif(not cpu_kernels_build(), reason="the compiled CPU kernels do not build here "
                                                                "(python -m kernels.cpu_ext says why)")


def check(q, k_cache, v_cache, meta, dtype, sliding_window=None, softcap=None):
    scale = q.shape[-1] ** -0.5
    want = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale, sliding_window,
                                     softcap)
    got = cpu_ops.paged_attention(q, k_cache, v_cache, meta, scale, sliding_window, softcap)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


SEQ_LENS = [1, 17, 45, 70, 300]
QUERY_LENS = {"decode": [1, 1, 1, 1, 1], "whole prompts": SEQ_LENS, "prompt chunks": [1, 9, 1, 32, 64]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("rows", QUERY_LENS)
def test_rows_match_reference(dtype, head_dim, group, block_size, rows):
    check(*make_batch(SEQ_LENS, QUERY_LENS[rows], 2 * group, 2, head_dim, block_size, dtype), dtype)


@pytest.mark.parametrize("group", [2, 5, 6, 7, 8, 16])
@pytest.mark.parametrize("head_dim", [8, 16, 96])
@pytest.mark.parametrize("cache", ["fp32", "bf16", "int8"])
def test_decode_rows_of_every_group_size_match_reference(group, head_dim, cache):
    """A decode row's GQA group goes in runs of 8, 4 and the rest, each K and V row loaded once a run; V's columns
    in passes of up to 4 x 8 (the last moved back to end at head_dim), one 8 at a time where head_dim is narrower."""
    q, k_cache, v_cache, meta = make_batch([1, 17, 45, 70], [1] * 4, 2 * group, 2, head_dim, 16, torch.float32)
    scales = None
    if cache == "bf16":
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    elif cache == "int8":
        k_cache, v_cache, scales = quantized_caches(k_cache, v_cache, cache)
    want = reference.paged_attention(q, k_cache, v_cache, meta, 0.125, kv_scales=scales)
    got = cpu_ops.paged_attention(q, k_cache, v_cache, meta, 0.125, kv_scales=scales)
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.parametrize("cache", ["fp32", "bf16", "int8", "fp8"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window,softcap", [(None, None), (700, None), (None, 2.0)])
def test_long_decode_rows_in_parts_match_reference(cache, group, window, softcap):
    """A decode row's context past 512 positions goes in parts of about equal length, their sums merged by their
    maxima; beside a prompt chunk and short rows, and bit for bit the same alone as in the batch."""
    seq_lens, query_lens = [513, 1100, 40, 2049, 300], [1, 1, 1, 1, 24]
    q, k_cache, v_cache, meta = make_batch(seq_lens, query_lens, 2 * group, 2, 64, 16, torch.float32)
    scales = None
    if cache == "bf16":
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    elif cache != "fp32":
        k_cache, v_cache, scales = quantized_caches(k_cache, v_cache, cache)
    q = q * 3                                                       # peaked: the parts' maxima differ
    want = reference.paged_attention(q, k_cache, v_cache, meta, 0.125, window, softcap, kv_scales=scales)
    got = cpu_ops.paged_attention(q, k_cache, v_cache, meta, 0.125, window, softcap, kv_scales=scales)
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    row = 3                                                         # the 2049-position row, alone
    alone = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2049], dtype=torch.int32),
                              meta.block_tables[row:row + 1], torch.zeros(0, dtype=torch.int32), [0, 1], [2049], 1,
                              2049)
    assert torch.equal(cpu_ops.paged_attention(q[row:row + 1], k_cache, v_cache, alone, 0.125, window, softcap,
                                               kv_scales=scales), got[row:row + 1])


@pytest.mark.parametrize("query_lens", [[37, 18, 1, 1], [1, 1, 1, 30]])
def test_decode_rows_beside_prefill_chunks_match_reference(query_lens):
    seq_lens = [37, 50, 21, 40]
    check(*make_batch(seq_lens, query_lens, 6, 2, 64, 16, torch.float32), torch.float32)


@pytest.mark.parametrize("window", [1, 12, 100])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [40, 7, 5]])
def test_sliding_window_matches_reference(window, query_lens):
    seq_lens = [40, 29, 5]
    check(*make_batch(seq_lens, query_lens, 4, 2, 64, 16, torch.float32), torch.float32, sliding_window=window)


@pytest.mark.parametrize("rows", QUERY_LENS)
@pytest.mark.parametrize("window", [None, 12])
def test_soft_capped_scores_match_reference(rows, window):
    """Gemma 2's scores soft-capped before the mask and the softmax, on the decode rows' path and the tiles'."""
    q, k_cache, v_cache, meta = make_batch(SEQ_LENS, QUERY_LENS[rows], 4, 2, 64, 16, torch.float32)
    check(q * 4, k_cache, v_cache, meta, torch.float32, sliding_window=window, softcap=1.5)


@pytest.mark.parametrize("rows", ["decode", "prompt chunks"])
def test_attention_reads_q_as_a_view_of_the_steps_qkv(rows):
    """The model hands q over as a view into each token's [q | k | v] row; no copy, the same result."""
    q, k_cache, v_cache, meta = make_batch(SEQ_LENS, QUERY_LENS[rows], 6, 2, 64, 16, torch.float32)
    qkv = torch.cat([q.flatten(1), torch.randn(q.shape[0], 2 * 2 * 64)], dim=1)
    view = qkv[:, :q[0].numel()].view(q.shape)
    assert not view.is_contiguous()
    check(view, k_cache, v_cache, meta, torch.float32)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [5, 1, 1]])
def test_compiled_path_never_lets_stale_cache_values_reach_a_result(query_lens):
    check_ignores_stale_cache(cpu_ops.paged_attention, query_lens, "cpu")


@pytest.mark.parametrize("kind", list(CACHE_KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 4)])
@pytest.mark.parametrize("rows", QUERY_LENS)
@pytest.mark.parametrize("window,softcap", [(None, None), (12, 2.0)])
def test_a_quantized_cache_matches_reference(kind, dtype, head_dim, group, rows, window, softcap):
    """An INT8 or FP8 cache (kv_scales): the values converted as they load (FP8 through fp16's bits), K's scale
    folded into the scores' and V's applied to the sums, on the decode rows' path and the tiles'."""
    q, k_cache, v_cache, meta = make_batch(SEQ_LENS, QUERY_LENS[rows], 2 * group, 2, head_dim, 16, dtype)
    k8, v8, scales = quantized_caches(k_cache, v_cache, kind)
    want = reference.paged_attention(q, k8, v8, meta, 0.125, window, softcap, kv_scales=scales)
    got = cpu_ops.paged_attention(q, k8, v8, meta, 0.125, window, softcap, kv_scales=scales)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 4)])
@pytest.mark.parametrize("rows", QUERY_LENS)
@pytest.mark.parametrize("window,softcap", [(None, None), (12, 2.0)])
def test_a_bf16_cache_beside_fp32_rows_matches_reference(head_dim, group, rows, window, softcap):
    """dtype auto on a CPU without bf16 arithmetic: fp32 queries over a bf16 cache, widened as it loads, on the
    decode rows' path and the tiles'; as the reference computes over the cache's values in fp32."""
    q, k_cache, v_cache, meta = make_batch(SEQ_LENS, QUERY_LENS[rows], 2 * group, 2, head_dim, 16, torch.float32)
    k16, v16 = k_cache.bfloat16(), v_cache.bfloat16()
    want = reference.paged_attention(q, k16.float(), v16.float(), meta, 0.125, window, softcap)
    got = cpu_ops.paged_attention(q, k16, v16, meta, 0.125, window, softcap)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    assert torch.equal(reference.paged_attention(q, k16, v16, meta, 0.125, window, softcap), want)


@pytest.mark.parametrize("cache", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window,softcap", [(None, None), (12, 2.0)])
def test_a_decode_row_alone_is_the_same_as_beside_others(cache, group, window, softcap):
    """A decode row's attention does not depend on the rows decoding beside it (how the step's items fall to the
    threads): alone it is bit for bit what it is in a batch of five, and the reference's within tolerance."""
    seq_lens = [300, 70, 45, 17, 1]
    q, k_cache, v_cache, meta = make_batch(seq_lens, [1] * 5, 2 * group, 2, 64, 16, torch.bfloat16)
    scales = None
    if cache != "bf16":
        k_cache, v_cache, scales = quantized_caches(k_cache, v_cache, cache)
    batch = cpu_ops.paged_attention(q, k_cache, v_cache, meta, 0.125, window, softcap, kv_scales=scales)
    for i, n in enumerate(seq_lens):
        alone = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                                  meta.block_tables[i:i + 1], torch.zeros(0, dtype=torch.int32), [0, 1], [n], 1, n)
        got = cpu_ops.paged_attention(q[i:i + 1], k_cache, v_cache, alone, 0.125, window, softcap, kv_scales=scales)
        assert torch.equal(got, batch[i:i + 1]), i
        want = reference.paged_attention(q[i:i + 1], k_cache, v_cache, alone, 0.125, window, softcap,
                                         kv_scales=scales)
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ELEMENTWISE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 576), (7, 64), (40, 960)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_reference(dtype, num_tokens, hidden, with_residual):
    x, weight = torch.randn(num_tokens, hidden).to(dtype), (1 + 0.1 * torch.randn(hidden)).to(dtype)
    residual = torch.randn(num_tokens, hidden).to(dtype) if with_residual else None
    want, want_sum = reference.add_rms_norm(x, None if residual is None else residual.clone(), weight, 1e-5)
    got, got_sum = cpu_ops.add_rms_norm(x, residual, weight, 1e-5)
    tol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.equal(got_sum, want_sum) and (residual is None or got_sum is residual)   # the sum, in place


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,width", [(1, 1536), (9, 64), (300, 64), (3, 37)])   # the last: a tail
def test_silu_and_mul_matches_reference(dtype, num_tokens, width):
    gate_up = (3 * torch.randn(num_tokens, 2 * width)).to(dtype)
    tol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(cpu_ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), atol=tol, rtol=tol)


def test_silu_and_mul_holds_over_the_whole_float_range():
    """The vectorized exp: tiny, huge, infinite and NaN gates as torch computes them."""
    gate = torch.cat([torch.linspace(-120, 120, 4001), torch.tensor([-torch.inf, torch.inf, torch.nan, 0.0] * 2)])
    gate_up = torch.cat([gate, torch.ones_like(gate)]).unsqueeze(0)
    torch.testing.assert_close(cpu_ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), atol=1e-6,
                               rtol=2e-7, equal_nan=True)


@pytest.mark.parametrize("dtype,cache", [(dtype, cache) for dtype in DTYPES for cache in (None, "int8", "fp8")] +
                         [(torch.float32, "bf16")])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 9, 3), (128, 4, 1), (80, 4, 4)])
def test_rotary_and_cache_matches_reference(dtype, head_dim, num_heads, num_kv_heads, cache):
    """RoPE rounded op by op as torch rounds; an INT8 or FP8 cache (kv_scales): K and V quantized as the reference
    does (K within one step, where the rotation's rounding differs); a bf16 cache beside fp32: rounded as torch
    rounds."""
    kv_scales = None if cache in (None, "bf16") else (0.05, 0.03)
    from backend.model.checkpoint import ModelConfig
    from backend.model.rope import cos_sin as rope_cos_sin
    cfg = ModelConfig("LlamaForCausalLM", 32, head_dim * num_heads, 64, 1, num_heads, num_kv_heads, head_dim, 256,
                      1e-5, 10000.0, None, False, False, None, None, None)
    cos_sin = rope_cos_sin(cfg)
    positions = torch.tensor([0, 1, 2, 7, 100, 255, 3, 40], dtype=torch.int32)
    slots = torch.randperm(6 * 16)[:len(positions)].int()
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(len(positions), q_size + 2 * kv_size).to(dtype)     # q, k, v: views of one row, as in the model
    cache_dtype = {None: dtype, "bf16": torch.bfloat16}[cache] if kv_scales is None else CACHE_KINDS[cache][0]
    caches = [torch.zeros(num_kv_heads, 6, 16, head_dim, dtype=cache_dtype) for _ in range(4)]

    def views(t):
        q, k, v = t.split([q_size, kv_size, kv_size], dim=-1)
        return (q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
                v.reshape(-1, num_kv_heads, head_dim))
    want_q = reference.rotary_and_cache(*views(qkv.clone()), positions, cos_sin, caches[0], caches[1], slots,
                                        kv_scales=kv_scales)
    got_q = cpu_ops.rotary_and_cache(*views(qkv), positions, cos_sin, caches[2], caches[3], slots,
                                     kv_scales=kv_scales)
    tol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(got_q, want_q, atol=tol, rtol=tol)
    if kv_scales is None:
        tol = ELEMENTWISE_TOL[cache_dtype]
        torch.testing.assert_close(caches[2], caches[0], atol=tol, rtol=tol)
    else:
        assert_within_a_step(caches[2], caches[0])
        assert caches[2].any()
    assert torch.equal(caches[3], caches[1])                              # v is copied (or quantized) as it is


MANY_SEGMENTS = [(1 + i % 3, [0, 1, 2, -1, 3][i % 5]) for i in range(23)]     # (tokens, slot), -1: base only


def projection_and_widened(band_ranks, max_rank, in_dim, widths, weight_dtype, dtype):
    """A projection as DeviceSlots stores it for the compiled path (A row-major, B rank-major) in weight_dtype, and
    the same weights in dtype for the reference."""
    from tests.kernels.test_lora import random_projection
    proj = random_projection(band_ranks, max_rank, in_dim, widths, weight_dtype, rank_major=True, a_rank_major=False)
    widened = random_projection(band_ranks, max_rank, in_dim, widths, dtype, rank_major=True, a_rank_major=False)
    widened.a.copy_(proj.a)
    widened.b.copy_(proj.b)
    return proj, widened


@pytest.mark.parametrize("dtype,weight_dtype", [(d, d) for d in DTYPES] + [(torch.float32, torch.float16),
                                                                         (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("in_dim,widths", [(64, [96]), (70, [20, 8, 12]), (576, [1536, 1536]), (96, [2304])])
@pytest.mark.parametrize("ranks", [(4, 64, 8), (16, 32, 48), (8,), (13, 6, 1)])      # rows left past 4s and 8s
@pytest.mark.parametrize("layout", ["decode", "mixed", "many", "long"])
def test_lora_apply_matches_reference(dtype, weight_dtype, in_dim, widths, ranks, layout):
    """A projection as DeviceSlots stores it for this path (A row-major, B rank-major; weights past each rank and
    outside each band random, so reading them fails), each band at its own ranks: one band (o, down), three (qkv),
    two wide ones (gate_up) and one past an expand item's 2048 columns, widths past multiples of 16 and 8; adapters in
    the model's dtype, or in 16 bits beside fp32 (the reference gets them widened). Layouts: decode tokens, prompt
    chunks (tiles of 4 and 6 tokens and what is left of them), many short segments, which the threads share by cost,
    and segments past a piece's 64 tokens."""
    from tests.kernels.test_lora import segments_for
    num_slots, max_rank = 4, 64
    slot_ranks = list(ranks) + [0] * (num_slots - len(ranks))
    band_ranks = [slot_ranks[i:] + slot_ranks[:i] for i in range(len(widths))]     # each band its own ranks
    proj, widened = projection_and_widened(band_ranks, max_rank, in_dim, widths, weight_dtype, dtype)
    last = len(ranks) - 1
    tokens = {"decode": [(1, 0), (2, -1), (1, last), (1, 3)],            # slot 3 has rank 0 (or is unused)
              "mixed": [(5, 0), (3, -1), (19, last), (1, min(1, last)), (7, -1), (2, 0)],
              "many": MANY_SEGMENTS,
              "long": [(150, 0), (3, -1), (65, last), (64, min(1, last))]}[layout]
    segments = segments_for(tokens)
    x = torch.randn(sum(n for n, _ in tokens), in_dim).to(dtype)
    out = torch.randn(x.shape[0], sum(widths) + 5).to(dtype)
    want, got = out.clone()[:, 5:], out.clone()[:, 5:]                                  # rows apart, as views
    reference.lora_apply(x, widened, segments, want)
    cpu_ext.lora_apply(x, proj, segments, got)
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_rows", [0, 1, 5, 6, 7, 32, 130])             # tiles of 6 rows and the rest
@pytest.mark.parametrize("in_dim,out_dim", [(576, 960), (70, 48), (1536, 576), (64, 9 * 16 * 16)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("panel_dtype", [torch.float32, torch.bfloat16])
def test_panel_linear_matches_f_linear(num_rows, in_dim, out_dim, with_bias, panel_dtype):
    """Panel counts that split unevenly between threads and groups, K not a multiple of 8, a strided x; panels in
    fp32, or in bf16 (values a bf16 holds, widened exactly)."""
    weight, bias = torch.randn(out_dim, in_dim).to(panel_dtype).float(), torch.randn(out_dim) if with_bias else None
    x = torch.randn(num_rows, in_dim + 3)[:, 3:]
    panels = cpu_ext.pack_linear(weight).to(panel_dtype)
    assert torch.equal(panels.float(), weight.view(-1, 16, in_dim).transpose(1, 2))
    torch.testing.assert_close(cpu_ext.panel_linear(x, panels, bias), torch.nn.functional.linear(x, weight, bias),
                               atol=1e-4, rtol=1e-4)


needs_amx = pytest.mark.skipif(not (cpu_kernels_build() and cpu_ext.amx_available()),
                               reason="no AMX-BF16 tiles here (CPU, build or kernel): bf16 weights go to oneDNN")


@needs_amx
@pytest.mark.parametrize("num_rows", [0, 1, 5, 16, 17, 32, 33, 130])       # rows blocks of 16 and 32, and tails
@pytest.mark.parametrize("in_dim,out_dim", [(576, 960), (64, 48), (1536, 576), (32, 16)])   # 48, 16: a lone panel
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_matches_f_linear(num_rows, in_dim, out_dim, with_bias):
    """bf16 on AMX tiles over pair panels: the fp32 sums of bf16 products rounded once into bf16 (within a bf16
    rounding of the fp32 GEMM: a bf16 result's half ulp plus the sums' order), x a strided view."""
    weight, bias = torch.randn(out_dim, in_dim).bfloat16(), torch.randn(out_dim) if with_bias else None
    x = torch.randn(num_rows, in_dim + 3).bfloat16()[:, 3:]
    pairs = cpu_ext.pack_pairs(weight)
    assert pairs.shape == (out_dim // 16, in_dim // 2, 16, 2) and torch.equal(cpu_ext.unpack_pairs(pairs), weight)
    got = cpu_ext.amx_linear(x, pairs, bias)
    want = torch.nn.functional.linear(x.float(), weight.float(), bias)
    assert got.dtype == torch.bfloat16 and got.shape == (num_rows, out_dim)
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-3 * in_dim ** 0.5)


@needs_amx
def test_an_amx_row_is_the_same_alone_or_beside_others():
    """Every row's tiles sum over k in the same order, whatever rows block holds it: bit for bit alone, in a block
    of 16, of 32 and beside more."""
    pairs = cpu_ext.pack_pairs(torch.randn(80, 576).bfloat16())
    x = torch.randn(70, 576).bfloat16()
    alone = torch.cat([cpu_ext.amx_linear(x[i:i + 1], pairs, None) for i in range(70)])
    for num_rows in (2, 15, 16, 17, 31, 32, 33, 70):
        assert torch.equal(cpu_ext.amx_linear(x[:num_rows], pairs, None), alone[:num_rows]), num_rows


@needs_amx
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_bf16_projections_are_prepared_for_amx(x_dtype):
    """cpu_ops.prepare_weight keeps a bf16 projection in pair panels where the tiles run (K a multiple of 32; else
    the panel GEMM's bf16 panels), and cpu_ops.linear reads them: bf16 x on the tiles, other dtypes through the
    weight unpacked."""
    weight, bias = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    prepared = cpu_ops.prepare_weight("gate_proj", weight)
    assert prepared.dim() == 4 and cpu_ops.prepare_weight("gate_proj", torch.randn(96, 48).bfloat16()).dim() == 3
    x = torch.randn(3, 64).to(x_dtype)
    got = cpu_ops.linear(x, prepared, bias)
    assert got.dtype == x_dtype
    want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("num_rows", [1, 7, 70])
def test_bf16_projections_without_amx_are_bf16_panels(monkeypatch, num_rows):
    """Without AMX tiles (an AVX-512 or AVX2 CPU) a bf16 projection goes into the panel GEMM's bf16 panels, not
    oneDNN's layout (faster at every row count measured), and cpu_ops.linear reads them for bf16 x == F.linear."""
    monkeypatch.setattr(cpu_ext, "amx_available", lambda: False)
    weight, bias = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    prepared = cpu_ops.prepare_weight("layers.0.o_proj", weight)
    assert prepared.dim() == 3 and prepared.dtype == torch.bfloat16
    assert torch.equal(prepared.transpose(1, 2).reshape(96, 64), weight)
    x = torch.randn(num_rows, 64).bfloat16()
    got = cpu_ops.linear(x, prepared, bias)
    want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-2)


PANEL_KINDS = ["fp32", "bf16", "int8", "int4", "fp8"]


def panel_gemm(kind: str, weight: torch.Tensor):
    """x -> x @ weight.T by the panel GEMM over weight's panels in `kind`, packed once."""
    if kind in ("fp32", "bf16"):
        panels = cpu_ext.pack_linear(weight).to(torch.float32 if kind == "fp32" else torch.bfloat16)
        return lambda x: cpu_ext.panel_linear(x, panels, None)
    q = quantize_weight(weight, kind).panels()
    if kind == "int8":
        return lambda x: cpu_ext.int8_panel_linear(x, q.data, q.scale, None)
    if kind == "int4":
        return lambda x: cpu_ext.int4_panel_linear(x, q.data, q.scale, q.zero, q.group_size, None)
    return lambda x: cpu_ext.fp8_panel_linear(x, q.data, q.scale, q.group_size, None)


@pytest.mark.parametrize("kind", PANEL_KINDS)
@pytest.mark.parametrize("in_dim", [576, 70])
def test_a_panel_gemm_row_is_the_same_alone_or_beside_others(kind, in_dim):
    """Each row's sums run in the same order whatever tile of rows holds it (kernels/cpu/linear.cpp's tile, whose
    several sums a row, or on AVX2 its few rows' sums over several panels at once, keep one decode row's FMAs from
    waiting on each other): a request's logits do not depend on the requests decoding beside it. Bit for bit, for
    every count of rows a tile takes and more, over 5 panels (a tile of 4 panels and one alone, or 2, 2 and 1), and
    for prompt chunks' rows (on AVX2 each group of narrow panels widened into fp32 first)."""
    if kind == "int4" and in_dim % 32:
        pytest.skip("int4: groups of 32s")
    gemm = panel_gemm(kind, torch.randn(80, in_dim).bfloat16().float())
    x = torch.randn(40, in_dim)
    alone = torch.cat([gemm(x[i:i + 1]) for i in range(40)])
    for num_rows in [*range(2, 14), 25, 31, 40]:
        assert torch.equal(gemm(x[:num_rows]), alone[:num_rows]), num_rows


@pytest.mark.parametrize("kind", PANEL_KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows", [2, 32, 40])            # the thread's buffers up to 32 rows, tensors beyond
def test_a_panel_gemm_over_narrow_x_rounds_as_torch_does(kind, dtype, num_rows):
    """x in bf16 or fp16 is widened exactly and y's fp32 sums rounded to nearest even: the same bits as the GEMM
    over x in fp32 converted by torch, NaN and (fp16) sums past the format's range among them."""
    gemm = panel_gemm(kind, torch.randn(64, 96).bfloat16().float())
    x = torch.randn(num_rows, 96) * 4
    x[0, 0] = float("nan")
    x[-1] *= 2000.0                                       # fp16: sums past its largest value, finite in fp32
    x = x.to(dtype)
    got, want = gemm(x), gemm(x.float()).to(dtype)
    assert got.dtype == dtype and bool(got[0].isnan().all())
    assert bool(got[-1].isinf().any()) == (dtype == torch.float16)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)           # (NaN's bits are torch's own)


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8", "fp8 every value"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantized_panels_are_the_values_the_panel_gemm_reads(kind, dtype):
    """cpu_ext.dequantize_panels (the amx tiles' oracle below): INT8 and FP8 the format's
    values rounded into dtype, bit for bit; INT4 within a rounding of (q - zero) * scale (the panel GEMM's INT4
    lines are 1 + q / 16, from which the value is exact)."""
    from tests.kernels.test_quant import quantized_weight
    weight = quantized_weight(kind, 96, 256)
    got = cpu_ext.dequantize_panels(weight.panels(), dtype)
    want = weight.dequantize(torch.float32)
    assert got.dtype == dtype and got.shape == (96, 256)
    if kind == "int4":
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got.float(), want, rtol=eps, atol=1e-6 * float(want.abs().max()))
    else:
        assert torch.equal(got, want.to(dtype))


@needs_amx
@pytest.mark.parametrize("kind", ["int8", "int4", "fp8", "fp8 every value"])
@pytest.mark.parametrize("num_rows", [1, 8, 17, 33, 130])
@pytest.mark.parametrize("out_dim", [48, 96, 1536])           # 48: a lone panel; 1536: groups of panels in turn
def test_a_quantized_weight_on_amx_tiles_is_its_dequantized_weight_on_them(kind, num_rows, out_dim):
    """cpu_ext.amx_dequantized_linear dequantizes each group of panels into bf16 pair rows in the thread's buffer:
    bit for bit amx_linear over the whole weight dequantize_panels gives, in pair panels (bias included); and it is
    what cpu_ops.linear runs from TILE_ROWS rows of bf16."""
    from tests.kernels.test_quant import quantized_weight
    weight, bias = quantized_weight(kind, out_dim, 256).panels(), torch.randn(out_dim)
    x = torch.randn(num_rows, 256).bfloat16()
    got = cpu_ext.amx_dequantized_linear(x, weight, bias)
    want = cpu_ext.amx_linear(x, cpu_ext.pack_pairs(cpu_ext.dequantize_panels(weight, torch.bfloat16)), bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    if num_rows >= cpu_ops.TILE_ROWS:
        assert torch.equal(cpu_ops.linear(x, weight, bias), got)


@pytest.mark.parametrize("layout", ["decode", "mixed", "many"])
@pytest.mark.parametrize("num_base_rows", [0, 7])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("panel_dtype", [torch.float32, torch.bfloat16])
def test_linear_lora_matches_linear_then_lora(layout, num_base_rows, with_bias, panel_dtype):
    """cpu_ext.linear_lora, whose GEMM prefetches the adapter rows of the LoRA after it, against F.linear and the
    reference LoRA: three bands (qkv) at their own ranks, fp16 adapters beside fp32, base-only rows before them;
    the weight's panels in fp32 or bf16 (a bf16 checkpoint's values)."""
    from tests.kernels.test_lora import segments_for
    in_dim, widths = 96, [64, 16, 16]
    band_ranks = [[8, 16, 0, 4], [0, 3, 0, 0], [8, 13, 16, 0]]
    proj, widened = projection_and_widened(band_ranks, 16, in_dim, widths, torch.float16, torch.float32)
    tokens = [(num_base_rows, -1)] * bool(num_base_rows) + {
        "decode": [(1, 0), (2, 1), (1, 2), (1, 3)], "mixed": [(5, 0), (3, -1), (19, 2), (1, 1)],
        "many": MANY_SEGMENTS}[layout]
    segments = segments_for(tokens)
    x = torch.randn(sum(n for n, _ in tokens), in_dim)
    weight = torch.randn(sum(widths), in_dim).to(panel_dtype).float()
    bias = torch.randn(sum(widths)) if with_bias else None
    want = torch.nn.functional.linear(x, weight, bias)
    reference.lora_apply(x, widened, segments, want)
    got = cpu_ext.linear_lora(x, cpu_ext.pack_linear(weight).to(panel_dtype), bias, proj, segments)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_claims_give_a_thread_its_share_in_order_then_the_back_of_the_others():
    """Shares of equal cost ([5, 1, 1, 1] and [2, 2, 2, 2]); a thread alone takes its own, then the other's from
    the back, and -1 once every item is taken."""
    assert cpu_ext.claim_order([5, 1, 1, 1, 2, 2, 2, 2], 2, [1] * 9) == [4, 5, 6, 7, 3, 2, 1, 0, -1]
    assert cpu_ext.claim_order([5, 1, 1, 1, 2, 2, 2, 2], 2, [0, 1, 0, 0, 0, 1]) == [0, 4, 1, 2, 3, 5]


def test_claims_steal_from_the_share_with_the_most_cost_left():
    # shares of three threads: [0, 1] (cost 6), [2] (cost 6), [3, 4, 5] (cost 6); thread 2 takes its own, then
    # the back of thread 0's (6 left) before thread 1's (6, not more), then thread 1's (6 against 1)
    assert cpu_ext.claim_order([1, 5, 6, 2, 2, 2], 3, [2, 2, 2, 2, 2, 2, 2]) == [3, 4, 5, 1, 2, 0, -1]


@pytest.mark.parametrize("seed", range(20))
def test_claims_hand_out_every_item_once_however_the_threads_take_turns(seed):
    rng = random.Random(seed)
    costs = [rng.randint(1, 50) for _ in range(rng.randint(1, 40))]
    num_threads = rng.randint(1, 6)
    present = rng.sample(range(num_threads), rng.randint(1, num_threads))      # the others never come
    items = cpu_ext.claim_order(costs, num_threads, [rng.choice(present) for _ in range(len(costs) + 5)])
    assert sorted(items[:len(costs)]) == list(range(len(costs))) and items[len(costs):] == [-1] * 5


@pytest.mark.parametrize("op", ["panel_linear", "paged_attention", "lora_apply"])
def test_kernels_match_reference_when_more_threads_than_cores_claim_unevenly(op):
    """Seven threads on this machine's cores run unevenly, so they take items from each other's shares."""
    before = torch.get_num_threads()
    torch.set_num_threads(7)
    try:
        if op == "panel_linear":
            test_panel_linear_matches_f_linear(130, 576, 960, True, torch.float32)
        elif op == "paged_attention":
            test_rows_match_reference(torch.float32, 64, 3, 16, "whole prompts")
        else:
            test_lora_apply_matches_reference(torch.float32, torch.float16, 576, [1536, 1536], (16, 32, 48), "long")
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("op", ["panel_linear", "add_rms_norm"])
def test_compiled_ops_let_other_python_threads_run_while_they_compute(op):
    """A server parses uploads and sends answers on Python threads beside the stepping one: while an op computes,
    another thread's Python keeps running. Holding the GIL, the op left that thread one gap as long as itself."""
    if op == "panel_linear":
        x, panels = torch.randn(2048, 1536), cpu_ext.pack_linear(torch.randn(8192, 1536))
        call = lambda: cpu_ext.panel_linear(x, panels, None)            # noqa: E731
    else:
        x, residual, weight = torch.randn(1 << 22, 64), torch.randn(1 << 22, 64), torch.randn(64)
        call = lambda: cpu_ext.add_rms_norm(x, residual, weight, 1e-6)  # noqa: E731
    call()
    window = []

    def timed():
        start = time.perf_counter()
        call()
        window.extend([start, time.perf_counter()])
    worker = threading.Thread(target=timed)
    ticks = [time.perf_counter()]
    worker.start()
    while worker.is_alive():                     # wakes every millisecond, and needs the GIL to note it
        time.sleep(0.001)
        ticks.append(time.perf_counter())
    worker.join()
    duration = window[1] - window[0]
    longest_gap = max(b - a for a, b in zip(ticks, ticks[1:]))
    assert duration > 0.05 and longest_gap < duration / 2, (duration, longest_gap)


@pytest.mark.parametrize("dtype,out_dim,layout", [(torch.float32, 960, "panels"), (torch.float32, 40, "dense"),
                                                  (torch.float16, 960, "dense"), ("bf16 values", 960, "bf16 panels")])
def test_prepare_weight_puts_projections_in_panels_where_the_kernel_takes_them(dtype, out_dim, layout):
    """fp32 with out_features a multiple of 16 goes into panels, in bf16 where every value is a bf16's (a bf16
    checkpoint served in fp32); the rest keeps a layout F.linear or oneDNN reads, and ops.linear gives F.linear's
    result either way."""
    weight = torch.randn(out_dim, 64)
    weight = weight.to(torch.bfloat16).float() if dtype == "bf16 values" else weight.to(dtype)
    dtype = weight.dtype
    norm = torch.randn(64)
    got = cpu_ops.prepare_weight("layers.0.qkv_proj", weight)
    assert (got.dim() == 3) == layout.endswith("panels")
    assert (got.dtype == torch.bfloat16) == (layout == "bf16 panels")
    assert cpu_ops.prepare_weight("layers.0.input_norm", norm) is norm
    x = torch.randn(3, 64).to(dtype)
    want = torch.nn.functional.linear(x.float(), weight.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(cpu_ops.linear(x, got, None).float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("out_dim", [96, 40])                    # bf16 panels; no panel (not a multiple of 16)
@pytest.mark.parametrize("num_rows", [1, 7, 70])
@pytest.mark.parametrize("packable", [False, True])              # oneDNN's bf16 layout where the CPU has it
def test_bf16_projections_serve_fp32_x(monkeypatch, out_dim, num_rows, packable):
    """dtype auto on a CPU without bf16 arithmetic: bf16 weights (backend.device.projection_dtype) beside fp32
    activations, in bf16 panels widened as the GEMM loads them, or (no panel) converted at the call; y in fp32. Also
    where the CPU has AMX tiles but ATen is held at AVX2 (its fp32 rows would unpack pair panels at every call)."""
    monkeypatch.setattr(cpu_ext, "amx_available", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    if packable and not cpu_ops._packable(torch.bfloat16):
        pytest.skip("oneDNN has no bf16 here")
    monkeypatch.setattr(cpu_ops, "_packable", lambda dtype: packable and dtype == torch.bfloat16)
    weight, bias = torch.randn(out_dim, 64).bfloat16(), torch.randn(out_dim)
    prepared = cpu_ops.prepare_weight("lm_head", weight)
    assert prepared.dtype == torch.bfloat16 and (prepared.dim() == 3) == (out_dim % 16 == 0)
    x = torch.randn(num_rows, 64)
    got = cpu_ops.linear(x, prepared, bias)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight.float(), bias), atol=1e-4, rtol=1e-4)


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_load(monkeypatch):
    lock = cpu_ext.BUILD_DIR / "lock"
    lock.touch()
    an_hour_ago = time.time() - 3600
    os.utime(lock, (an_hour_ago, an_hour_ago))
    monkeypatch.setattr(cpu_ext, "_module", None)
    assert cpu_ext.load() is not None and not lock.exists()


def test_a_process_that_finds_another_ninja_first_on_path_neither_uses_it_nor_rebuilds(tmp_path):
    marker = tmp_path / "other_ninja_ran"
    other = tmp_path / "ninja"
    other.write_text(f'#!/bin/sh\n[ "$1" = --version ] && echo 1.11.1 && exit 0\ntouch {marker}\nexit 1\n')
    other.chmod(0o755)
    built = cpu_ext.BUILD_DIR / f"{cpu_ext.NAME}.so"
    before = built.stat().st_mtime_ns
    env = os.environ | {"PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = subprocess.run([sys.executable, "-c", "from kernels import cpu_ext; cpu_ext.load()"], env=env,
                         cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert not marker.exists() and built.stat().st_mtime_ns == before


def test_a_build_lock_left_by_a_killed_build_is_taken_over_at_once():
    """torch's lock file outlives a build killed midway; the next load used to wait for it up to 10 minutes."""
    import subprocess
    import sys
    import time
    lock = cpu_ext.BUILD_DIR / "lock"
    lock.write_text("")                                          # as a killed build leaves it, fresh
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "from kernels import cpu_ext; cpu_ext.load()"], check=True, timeout=120,
                   cwd=cpu_ext.BUILD_DIR.parent.parent)
    assert time.monotonic() - started < 60 and not lock.exists()
    assert (cpu_ext.BUILD_DIR / "owner.lock").read_text().strip().isdigit()


@pytest.mark.skipif("avx512f" not in Path("/proc/cpuinfo").read_text(), reason="the native build is AVX2's already")
def test_the_kernels_built_for_avx2_pass_these_tests_too():
    """The kernels' AVX2 code (kernels/cpu/linear.cpp's two-register lines, its wide decode tiles, its INT4 lines)
    runs only on CPUs without AVX-512: built for x86-64-v3 (AVX2, FMA, F16C) in a directory of its own, this module's
    tests and the quantized formats' run again over that build (the build's own tests aside: locks and ninja, which
    watch the native build)."""
    if cpu_ext.ARCH_FLAGS == cpu_ext.AVX2:
        pytest.skip("this is the AVX2 run")
    tests = ["tests/kernels/test_cpu_kernels.py", "tests/kernels/test_quant.py", "-k", "not build_lock and not ninja"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                          "tests.kernels.avx2_build", *tests], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1] and " failed" not in run.stdout.splitlines()[-1]
