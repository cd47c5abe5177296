"""LoRA shrink/expand: Triton kernels (one launch each per projection) against the torch reference, mixed ranks
and base-only tokens in one call."""
import pytest
import torch

from backend.lora.slots import Band, Projection
from kernels import fused, reference, triton_ops
from kernels.lora import reference as lora_reference
from kernels.lora.executor import LoraDelta, TritonLoraExecutor
from kernels.lora.launch import block_m_for, max_work_items, work_items
from kernels.lora.segments import LoraSegments
from kernels.lora.triton_kernels import Prepared, lora_expand, lora_merge, lora_shrink
from tests.helpers import DEVICES, KERNEL_DEVICES, cpu_kernels_build

TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def segments_for(lengths_and_slots, device="cpu", work_dtype: torch.dtype | None = None) -> LoraSegments:
    """work_dtype: with the Triton kernels' work list for activations of that dtype (else the padded grid)."""
    token_slots = [slot for n, slot in lengths_and_slots for _ in range(n)]
    block_m = block_m_for(len(token_slots), work_dtype) if work_dtype is not None else 0
    segments = LoraSegments.from_token_slots(token_slots, block_m)
    segments.use({name: t.to(device) for name, t in segments.tensors.items()})
    return segments


def triton_lora(segments: LoraSegments, proj: Projection, split_k: int | None = None) -> TritonLoraExecutor:
    """A step's Triton LoRA over one projection, layer 0's "p"."""
    return TritonLoraExecutor(triton_ops, segments, [{"p": proj}], split_k=split_k)


def random_weights(num_slots, cap, in_dim, out_dim, dtype, rank_major: bool, device="cpu"):
    """A [num_slots, cap, in_dim] and B [num_slots, out_dim, cap]; rank_major stores them as DeviceSlots does."""
    if rank_major:
        return ((torch.randn(num_slots, in_dim, cap) * 0.2).to(dtype).to(device).transpose(1, 2),
                (torch.randn(num_slots, cap, out_dim) * 0.2).to(dtype).to(device).transpose(1, 2))
    return ((torch.randn(num_slots, cap, in_dim) * 0.2).to(dtype).to(device),
            (torch.randn(num_slots, out_dim, cap) * 0.2).to(dtype).to(device))


def random_projection(ranks: list[list[int]], max_rank: int, in_dim: int, widths: list[int], dtype,
                      rank_major: bool, device="cpu", a_rank_major: bool | None = None,
                      fused: tuple[int, ...] = (), dora: tuple[int, ...] = ()) -> Projection:
    """A projection of len(widths) bands over len(ranks[0]) slots, band i at ranks[i][slot], laid out as DeviceSlots
    lays it out (rank_major: B, and A unless a_rank_major says otherwise, as on CPU); weights past each rank and
    outside each band are random, not zero, so a kernel that reads them fails. `fused` slots hold one band over
    every column (a fused qkv adapter: band 0 at its rank, the others at none); `dora` slots have random
    magnitudes on every band they have a rank in (1 elsewhere, as DeviceSlots keeps them)."""
    num_bands, num_slots, cap = len(widths), len(ranks[0]), len(widths) * max_rank
    a_rank_major = rank_major if a_rank_major is None else a_rank_major
    a = random_weights(num_slots, cap, in_dim, 1, dtype, a_rank_major, device)[0]
    b = random_weights(num_slots, cap, 1, sum(widths), dtype, rank_major, device)[1]
    bounds = [sum(widths[:i]) for i in range(num_bands + 1)]
    slot_bounds = [[0] + [bounds[-1]] * num_bands if slot in fused else bounds for slot in range(num_slots)]
    for slot in fused:
        for band in range(1, num_bands):
            ranks[band][slot] = 0
        with torch.no_grad():                                          # band 0's B past q is read for these
            b[slot, bounds[1]:, max_rank:] = 0
    rank_table = torch.tensor(ranks, dtype=torch.int32, device=device)
    r = max_rank
    spans = [(0, bounds[-1]) if fused else (bounds[0], bounds[1])] + [(bounds[i], bounds[i + 1])
                                                                      for i in range(1, num_bands)]
    if fused:                                                          # what other slots have there is zero
        for slot in set(range(num_slots)) - set(fused):
            b[slot, bounds[1]:, :max_rank] = 0
    m = torch.ones(num_slots, bounds[-1], dtype=dtype, device=device)
    flags = [[slot in dora and ranks[i][slot] > 0 for slot in range(num_slots)] for i in range(num_bands)]
    for i in range(num_bands):
        for slot in range(num_slots):
            if flags[i][slot]:
                m[slot, slice(*spans[i])] = (0.5 + torch.rand(spans[i][1] - spans[i][0])).to(dtype)
    bands = [Band(a[:, i * r:(i + 1) * r], b[:, slice(*spans[i]), i * r:(i + 1) * r], rank_table[i],
                  torch.tensor(ranks[i], dtype=torch.int32), spans[i], m[:, slice(*spans[i])],
                  torch.tensor(flags[i], dtype=torch.int32)) for i in range(num_bands)]
    return Projection(a, b, rank_table, torch.tensor(bounds, dtype=torch.int32, device=device),
                      torch.tensor(slot_bounds, dtype=torch.int32, device=device), r, widths, bands, m,
                      torch.tensor(flags, dtype=torch.int32, device=device))


LAYOUTS = {
    "decode": [(2, -1), (1, 0), (1, 1), (1, 2)],                      # one token per sequence, base rows first
    "mixed": [(5, 0), (3, -1), (19, 2), (1, 1), (7, -1), (2, 0)],     # ragged chunks, a slot twice, base between
}


def float_copy(proj: Projection) -> Projection:
    """The same projection with its weights in fp32 (for the reference)."""
    out = random_projection([list(r) for r in proj.ranks.tolist()], proj.max_rank, proj.a.shape[2], proj.widths,
                            torch.float32, False, proj.a.device)
    out.a, out.b, out.m = proj.a.float(), proj.b.float(), proj.m.float()
    out.bands = [Band(band.a.float(), band.b.float(), band.ranks, band.host_ranks, band.columns, band.m.float(),
                      band.host_dora) for band in proj.bands]
    return out


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)])
@pytest.mark.parametrize("widths,ranks,fused,dora", [
    ([96], [[4, 64, 8, 0]], (), ()),                                           # o/down: one band
    ([64, 16, 16], [[8, 16, 0, 4], [8, 0, 16, 4], [8, 13, 16, 0]], (), ()),    # qkv: each (band, slot) its rank
    ([64, 16, 16], [[8, 16, 0, 4], [8, 0, 16, 4], [8, 13, 16, 0]], (1,), (1,)),   # slot 1 a fused qkv DoRA adapter
    ([80, 80], [[48, 1, 64, 0], [0, 32, 64, 0]], (), (0, 2)),                  # gate_up, two DoRA slots of four
])
@pytest.mark.parametrize("layout,split_k", [("decode", None), ("mixed", 1), ("mixed", 3)])
@pytest.mark.parametrize("rank_major", [False, True])
def test_projection_shrink_then_expand_match_reference(dtype, weight_dtype, widths, ranks, fused, dora, layout,
                                                       split_k, rank_major, device):
    """One shrink and one expand launch for all bands of a projection == the reference band by band; adapters in
    the activations' dtype, or fp16 beside fp32 activations (widened in the kernels); split-K partial sums."""
    check_projection(dtype, weight_dtype, widths, ranks, fused, dora, layout, split_k, rank_major, device)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("widths,ranks,fused,dora", [
    ([344, 344], [[8, 64, 0, 16], [8, 0, 64, 16]], (), (3,)),                  # gate_up of intermediate 344 (8 x 43)
    ([216, 72, 72], [[8, 16, 0, 4], [8, 0, 16, 4], [8, 13, 16, 0]], (1,), ()),    # qkv of head_dim 72, 3 + 1 heads
])
@pytest.mark.parametrize("layout,split_k", [("decode", None), ("mixed", 3)])
def test_band_widths_no_multiple_of_16_match_reference(dtype, widths, ranks, fused, dora, layout, split_k, device):
    """Each band's own expand tiles, its last one masked: no column of a band left to another band's tile."""
    check_projection(dtype, dtype, widths, ranks, fused, dora, layout, split_k, False, device)


def check_projection(dtype, weight_dtype, widths, ranks, fused, dora, layout, split_k, rank_major, device):
    max_rank, in_dim = 64, 384                                         # 3 input blocks at the widest tile
    proj = random_projection([list(r) for r in ranks], max_rank, in_dim, widths, weight_dtype, rank_major, device,
                             fused=fused, dora=dora)
    segments = segments_for(LAYOUTS[layout], device, dtype)
    num_tokens = segments.starts_list[-1]
    x = torch.randn(num_tokens, in_dim).to(dtype).to(device)
    base = torch.randn(num_tokens, sum(widths)).to(dtype).to(device)
    lora = triton_lora(segments, proj, split_k)
    p = lora.prepare(x, proj)
    assert split_k is None or p.launch.split_k == split_k

    h = lora_shrink(x, proj, p)
    assert h.shape == (num_tokens, len(widths) * max_rank) and h.dtype == dtype
    for band, band_ranks in enumerate(proj.ranks.tolist()):
        want_h = lora_reference.lora_shrink(x.float(), proj.bands[band].a.float(), segments, proj.ranks[band],
                                            band_ranks)
        for start, end, slot in zip(segments.starts_list, segments.starts_list[1:], segments.slots_list):
            if slot >= 0 and band_ranks[slot]:
                rows = slice(band * max_rank, band * max_rank + band_ranks[slot])
                torch.testing.assert_close(h[start:end, rows].float(), want_h[start:end, :band_ranks[slot]],
                                           atol=TOL[dtype], rtol=TOL[dtype])

    want = base.float().clone()
    reference.lora_apply(x.float(), float_copy(proj), segments, want)
    got = base.clone()
    lora_expand(h, proj, p, got)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    untouched = torch.tensor([slot < 0 for n, slot in LAYOUTS[layout] for _ in range(n)], device=device)
    assert torch.equal(got[untouched], base[untouched])
    assert not lora.counters.any(), "every counter back at zero for the next launch"


def with_expand(lora: TritonLoraExecutor, x: torch.Tensor, proj, mma: bool) -> Prepared:
    """The step's launches of proj with the expand's product on tensor cores (mma) or row by row."""
    lora.prepare(x, proj)
    lora.use(proj, lora.relaunched(proj, mma=mma))
    return lora.prepare(x, proj)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mma", [True, False])
@pytest.mark.parametrize("layout,widths", [("decode", [72, 24]), ("decode", [80, 48]), ("decode", [2048, 1024]),
                                           ("mixed", [72, 24]), ("mixed", [80, 48])])
def test_expand_paths_and_the_delta_merge_match_in_place(dtype, layout, mma, widths, device):
    """Both expand paths (tensor-core tiles, rows one by one) at any item length == the reference; the product into
    the fp32 delta then lora_merge == the expand in place, bit for bit (what overlapping LoRA with the GEMM runs);
    the executor's linear overlapping == linear then the LoRA in place, bit for bit."""
    ranks = [[48, 1, 64, 0], [0, 32, 64, 8]]
    proj = random_projection([list(r) for r in ranks], 64, 128, widths, dtype, False, device, dora=(2,))
    segments = segments_for(LAYOUTS[layout], device, dtype)
    segments.overlap = True
    num_tokens = segments.starts_list[-1]
    x = torch.randn(num_tokens, 128).to(dtype).to(device)
    base = torch.randn(num_tokens, sum(widths)).to(dtype).to(device)
    p = with_expand(triton_lora(segments, proj), x, proj, mma)
    h = lora_shrink(x, proj, p)
    in_place = base.clone()
    lora_expand(h, proj, p, in_place)
    want = base.float().clone()
    reference.lora_apply(x.float(), float_copy(proj), segments, want)
    torch.testing.assert_close(in_place.float(), want, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    merged = base.clone()
    lora_expand(h, proj, p, None)
    lora_merge(proj, p, merged)
    assert torch.equal(merged, in_place)

    weight = (torch.randn(sum(widths), 128) * 0.1).to(dtype).to(device)
    assert (p.launch.merge_tiles > 1) == (widths[0] > 1000)                      # wider merge groups where they fit
    lora = triton_lora(segments, proj)
    overlapped = lora.linear(x, weight, None, 0, "p")
    assert lora.prepare(x, proj).delta is not None
    with_expand(lora, x, proj, mma)
    overlapped = lora.linear(x, weight, None, 0, "p")
    in_turn = reference.linear(x, weight, None)
    lora_expand(h, proj, p, in_turn)
    assert torch.equal(overlapped, in_turn)


def deferred_and_merged(ranks: list[list[int]], widths: list[int], dtype, layout: str, device) -> tuple:
    """A projection's GEMM and LoRA beside it (a DoRA slot among mixed ranks, base rows), its product left in a delta
    that held NaN before (the executor's linear_deferred), and the same merged: (out, LoraDelta, merged,
    token_slots)."""
    proj = random_projection([list(r) for r in ranks], 64, 128, widths, dtype, False, device, dora=(2,))
    token_slots = [slot for n, slot in LAYOUTS[layout] for _ in range(n)]
    x = torch.randn(len(token_slots), 128).to(dtype).to(device)
    weight = (torch.randn(sum(widths), 128) * 0.1).to(dtype).to(device)
    merged_segments = segments_for(LAYOUTS[layout], device, dtype)
    merged_segments.overlap = True
    merged = triton_lora(merged_segments, proj).linear(x, weight, None, 0, "p")
    segments = segments_for(LAYOUTS[layout], device, dtype)
    segments.overlap = True
    segments.token_slots = torch.tensor(token_slots, dtype=torch.int32, device=device)
    lora = triton_lora(segments, proj)
    lora.prepare(x, proj).delta.fill_(float("nan"))
    out, delta = lora.linear_deferred(x, weight, None, 0, "p")
    assert delta is not None and torch.equal(out, reference.linear(x, weight, None))
    torch.testing.assert_close(reference.add_lora_delta(out, delta), merged, atol=0, rtol=0 if dtype == torch.float32
                               else 2 ** -7)                          # (the interpreter rounds bf16 down)
    return out, delta, merged, token_slots


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["decode", "mixed"])
def test_a_delta_left_for_the_next_op_gives_the_merged_bits(dtype, layout, device):
    """linear_deferred leaves the product in the step's delta (every column of an adapter's rows, 0 in a band of
    rank 0, even over a delta full of NaN from before); the add + RMSNorm and the SiLU-and-mul that add it as they
    load the GEMM's output give the bits of the GEMM, the merge, then the op."""
    ranks = [[48, 0, 64, 8], [0, 32, 64, 8]]                          # a band of rank 0 in slots 0 and 1
    widths = [80, 80]                                                 # gate and up (o, down: one band of the width)
    out, delta, merged, token_slots = deferred_and_merged(ranks, widths, dtype, layout, device)
    assert torch.equal(fused.silu_and_mul(out, delta), fused.silu_and_mul(merged))
    for width in widths:                                              # as a projection of one band feeds the stream
        one_band = slice(0, width)
        band_delta = LoraDelta(delta.delta[:, one_band], delta.m[:, one_band], delta.token_slots)
        residual = torch.randn(len(token_slots), width).to(dtype).to(device)
        norm_weight = (1 + 0.1 * torch.randn(width)).to(dtype).to(device)
        got = fused.add_rms_norm(out[:, one_band], residual.clone(), norm_weight, 1e-5, band_delta)
        want = fused.add_rms_norm(merged[:, one_band].contiguous(), residual.clone(), norm_weight, 1e-5)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    base_rows = torch.tensor([slot < 0 for slot in token_slots], device=device)
    assert torch.equal(fused.silu_and_mul(out, delta)[base_rows], fused.silu_and_mul(out)[base_rows])


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["decode", "mixed"])
def test_the_rotary_op_adds_the_qkv_delta_with_the_merged_bits(dtype, layout, device):
    """qkv's product left in the delta, added by the RoPE + cache-write op as it loads q, k and v: the rotated q and
    both caches as after the merge, bit for bit (a band of rank 0 in three slots, one of them v's)."""
    head_dim, num_heads, num_kv_heads, block_size = 16, 4, 2, 8
    widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    ranks = [[48, 0, 64, 8], [0, 32, 64, 8], [8, 16, 0, 8]]
    out, delta, merged, token_slots = deferred_and_merged(ranks, widths, dtype, layout, device)
    num_tokens = len(token_slots)

    def rotated(qkv: torch.Tensor, delta) -> list[torch.Tensor]:
        q, k, v = qkv.split(widths, dim=1)
        caches = [torch.zeros(num_kv_heads, 8, block_size, head_dim, dtype=dtype, device=device) for _ in range(2)]
        slots = torch.tensor([-1] + list(range(3, num_tokens + 2)), dtype=torch.int32, device=device)  # (one pad)
        q = fused.rotary_and_cache(q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
                                   v.reshape(num_tokens, num_kv_heads, head_dim), positions, cos_sin, *caches, slots,
                                   delta)
        return [q, *caches]
    positions = torch.arange(num_tokens, dtype=torch.int32, device=device) * 3
    cos_sin = torch.randn(3 * num_tokens, head_dim, device=device)
    for got, want in zip(rotated(out, delta), rotated(merged, None)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_results_are_bitwise_the_same_at_every_run(device):
    """The split partials are summed in split order, whatever order their programs finish in."""
    proj = random_projection([[16, 64, 8]], 64, 1024, [64], torch.float32, False, device)
    segments = segments_for([(3, 0), (1, 1), (2, 2)], device, torch.float32)
    x = torch.randn(6, 1024).to(device)
    outs = []
    for _ in range(2):
        out = torch.zeros(6, 64, device=device)
        p = triton_lora(segments, proj, split_k=4).prepare(x, proj)
        lora_expand(lora_shrink(x, proj, p), proj, p, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("layout", ["decode", "mixed"])
@pytest.mark.parametrize("dora", [(), (0, 2)])
def test_compiled_cpu_path_per_projection_matches_reference(layout, dora):
    """The compiled CPU backend's LoRA runs the compiled kernels once per band with a rank: same sums as the reference,
    DoRA slots' columns scaled by their magnitudes."""
    if not cpu_kernels_build():
        pytest.skip("the compiled CPU kernels do not build here")
    from kernels import cpu_ops
    proj = random_projection([[8, 16, 0, 4], [0, 0, 0, 0], [8, 13, 16, 0]], 16, 96, [64, 16, 16], torch.float32,
                             rank_major=True, a_rank_major=False, dora=dora)   # as DeviceSlots stores them here
    segments = segments_for(LAYOUTS[layout])
    x = torch.randn(segments.starts_list[-1], 96)
    base = torch.randn(x.shape[0], 96)
    want, got = base.clone(), base.clone()
    reference.lora_apply(x, proj, segments, want)
    cpu_ops.lora_executor(cpu_ops, segments, [{"p": proj}]).apply(x, proj, got)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[:, 64:80], base[:, 64:80])                   # the band no slot has a rank in


def test_work_items_cover_each_adapter_segment_in_blocks_and_pad_with_idle_ones():
    items = work_items([0, 2, 5, 24, 25], [-1, 0, 2, 1], 16, num_items=5).tolist()
    assert items == [[0, 2, 5], [2, 5, 21], [2, 21, 24], [1, 24, 25], [-1, 0, 0]]
    for num_tokens in (1, 16, 64, 256, 512):
        block_m = block_m_for(num_tokens)
        worst = work_items(list(range(0, num_tokens + 1, 1)), [0] * num_tokens, block_m)     # one token each
        assert len(worst) <= max_work_items(num_tokens, num_tokens, block_m)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [
    [(3, -1), (2, 0), (1, 1), (2, 3)],                # decode-like: base rows first, a slot with no tokens between
    [(9, 1), (7, 2), (12, 3)],                        # short prompt chunks, no base rows
])
def test_padded_grid_matches_segment_loop(dtype, layout, device):
    """The torch path's batched-matmul grid == one matmul per segment, with weights past each rank not zero."""
    num_slots, cap, in_dim, out_dim = 5, 32, 48, 80
    ranks = torch.tensor([8, 32, 4, 16, 0], dtype=torch.int32)
    ranks_list = ranks.tolist()
    ranks = ranks.to(device)
    lora_a, lora_b = random_weights(num_slots, cap, in_dim, out_dim, dtype, rank_major=True, device=device)
    segments = segments_for(layout, device)
    assert segments.padded is not None
    loop = segments_for(layout, device)
    loop.padded = None
    num_tokens = sum(n for n, _ in layout)
    x = torch.randn(num_tokens, in_dim).to(dtype).to(device)
    base = torch.randn(num_tokens, out_dim).to(dtype).to(device)
    h_grid = lora_reference.lora_shrink(x, lora_a, segments, ranks, ranks_list)
    h_loop = lora_reference.lora_shrink(x, lora_a, loop, ranks, ranks_list)
    torch.testing.assert_close(h_grid, h_loop, atol=TOL[dtype], rtol=TOL[dtype])
    got, want = base.clone(), base.clone()
    lora_reference.lora_expand(h_grid, lora_b, segments, ranks, ranks_list, got)
    lora_reference.lora_expand(h_loop, lora_b, loop, ranks, ranks_list, want)
    torch.testing.assert_close(got, want, atol=TOL[dtype] * 4, rtol=TOL[dtype])


def test_padded_grid_only_where_it_pays():
    assert segments_for([(2, 0), (3, -1)]).padded is None               # base rows after adapter rows
    assert segments_for([(2, 1), (2, 0)]).padded is None                # slots out of order
    assert segments_for([(1, 0), (30, 2)]).padded is None               # 90 grid rows for 31 tokens
    assert segments_for([(40, 0), (40, 1)]).padded is None              # long segments
    assert segments_for([(4, 0), (3, 1), (4, 2)]).padded.rows.tolist() == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_llama_8b_qkv_projection_in_a_decode_step_matches_reference(device):
    """in_dim 4096, bands q/k/v of 4096/1024/1024 columns, four adapters of ranks 8-64 (64 = max_rank), bf16,
    split-K as planned for 5 tokens."""
    ranks = [[8, 16, 64, 32]] * 3
    proj = random_projection([list(r) for r in ranks], 64, 4096, [4096, 1024, 1024], torch.bfloat16,
                             rank_major=False, device=device)
    segments = segments_for([(1, -1), (1, 0), (1, 1), (1, 2), (1, 3)], device, torch.bfloat16)
    x = torch.randn(5, 4096).to(torch.bfloat16).to(device)
    base = torch.randn(5, 6144).to(torch.bfloat16).to(device)
    want = base.float().clone()
    reference.lora_apply(x.float(), float_copy(proj), segments, want)
    got = base.clone()
    p = triton_lora(segments, proj).prepare(x, proj)
    launch = p.launch
    assert (launch.split_k, launch.k_per_split, launch.block_n, launch.tiles) == (8, 512, 128, 1)
    lora_expand(lora_shrink(x, proj, p), proj, p, got)
    torch.testing.assert_close(got.float(), want, atol=0.25, rtol=TOL[torch.bfloat16])
