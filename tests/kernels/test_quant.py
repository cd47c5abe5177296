"""Weight-only INT8, INT4 and FP8 weights (kernels/quant.py): the quantization against its definition, and every
backend's linear over them against F.linear over the dequantized weight."""
import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from kernels.quant import Fp8Weight, Int4Weight, quantize_fp8, quantize_int4, quantize_int8
from tests.helpers import CPU_BACKENDS, KERNEL_DEVICES


def ops_of(backend: str):
    if backend == "cpu":
        from kernels import cpu_ops
        return cpu_ops
    return reference


def test_quantize_int8_rounds_each_row_against_its_largest_value():
    """Its own few lines of the definition: scale = max |w| / 127 per row, values round(w / scale); a zero row
    keeps scale 1. Every value within half a step of the weight."""
    w = torch.randn(48, 80) * torch.linspace(0.01, 3.0, 48)[:, None]
    w[5] = 0.0
    q = quantize_int8(w)
    scale = w.abs().amax(dim=1) / 127
    scale[5] = 1.0
    assert q.data.dtype == torch.int8 and q.scale.dtype == torch.float32
    torch.testing.assert_close(q.scale, scale)
    assert torch.equal(q.data, torch.round(w / scale[:, None]).to(torch.int8))
    assert int(q.data.abs().max()) == 127
    assert bool(((q.dequantize(torch.float32) - w).abs() <= scale[:, None] / 2 + 1e-7).all())
    assert q.nbytes == 48 * 80 + 48 * 4


@pytest.mark.parametrize("quantize,in_dim,panel_bytes", [(quantize_int8, 24, 16), (quantize_int4, 64, 8),
                                                          (quantize_fp8, 40, 16)])
def test_panels_hold_the_same_weight(quantize, in_dim, panel_bytes):
    """The compiled CPU GEMM's column panels: PANEL columns a k in panel_bytes (INT4: two values a byte)."""
    q = quantize(torch.randn(32, in_dim))
    panels = q.panels()
    assert panels.data.shape == (2, in_dim, panel_bytes) and panels.shape == (32, in_dim)
    assert torch.equal(panels.dequantize(torch.float32), q.dequantize(torch.float32))


def test_quantize_int4_rounds_each_group_between_its_extremes():
    """Its own lines of the definition: per group of input channels, lo = min(w, 0), hi = max(w, 0), scale =
    (hi - lo) / 15, zero = round(-lo / scale), q = round(w / scale) + zero in 0..15; a zero group keeps scale 1.
    Every value within a step of the weight; two values a byte, the even channel in the low nibble."""
    w = torch.randn(48, 192) * torch.linspace(0.01, 3.0, 48)[:, None]
    w[5, 64:128] = 0.0
    w[6] = w[6].abs()                                        # groups of positives only: lo = 0, zero = 0
    q = quantize_int4(w)
    assert q.group_size == 64 and q.data.dtype == torch.uint8 and q.data.shape == (48, 96)
    groups = w.view(48, 3, 64)
    lo, hi = groups.amin(dim=2).clamp(max=0), groups.amax(dim=2).clamp(min=0)
    scale = (hi - lo) / 15
    scale[5, 1] = 1.0
    zero = torch.round(-lo / scale)
    values = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp(0, 15).view(48, 192)
    torch.testing.assert_close(q.scale, scale.T)
    assert torch.equal(q.zero, zero.T.to(torch.uint8)) and int(q.zero[:, 6].max()) == 0
    assert torch.equal(q.data & 15, values[:, 0::2].to(torch.uint8))
    assert torch.equal(q.data >> 4, values[:, 1::2].to(torch.uint8))
    step = scale.repeat_interleave(64, dim=1)
    assert bool(((q.dequantize(torch.float32) - w).abs() <= step + 1e-6).all())
    assert q.nbytes == 48 * 96 + 3 * 48 * 5


@pytest.mark.parametrize("in_dim,group_size", [(4096, 128), (576, 64), (1536, 128), (96, 32)])
def test_int4_groups_take_the_largest_size_the_width_allows(in_dim, group_size):
    assert quantize_int4(torch.randn(16, in_dim)).group_size == group_size


def test_int4_refuses_a_width_of_no_group_and_a_slice_across_groups():
    with pytest.raises(ValueError, match="40 input channels: INT4 weights group them by 128, 64, 32"):
        quantize_int4(torch.randn(16, 40))
    q = quantize_int4(torch.randn(16, 256))
    torch.testing.assert_close(q.input_slice(128, 256).dequantize(torch.float32),
                               q.dequantize(torch.float32)[:, 128:], atol=0, rtol=0)
    with pytest.raises(ValueError, match="input channels 64:192 cut groups of 128"):
        q.input_slice(64, 192)


def test_quantize_fp8_scales_each_row_to_e4m3s_range():
    """scale = max |w| / 448 per row (a zero row: 1), values w / scale rounded to e4m3 by torch; one group a row."""
    w = torch.randn(48, 80) * torch.linspace(0.01, 3.0, 48)[:, None]
    w[5] = 0.0
    q = quantize_fp8(w)
    scale = w.abs().amax(dim=1) / 448
    scale[5] = 1.0
    assert q.data.dtype == torch.uint8 and q.group_size == 80 and q.scale.shape == (1, 48)
    torch.testing.assert_close(q.scale[0], scale)
    assert torch.equal(q.data.view(torch.float8_e4m3fn).float(), (w / scale[:, None]).to(torch.float8_e4m3fn).float())
    assert q.nbytes == 48 * 80 + 48 * 4


def every_e4m3_value(out_dim: int, in_dim: int) -> Fp8Weight:
    """A weight whose rows run through every finite e4m3 value (subnormals, both zeros, both signs), scaled by
    groups of 32 input channels."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)      # (0x7F: NaN)
    data = codes[torch.arange(out_dim * in_dim) % len(codes)].view(out_dim, in_dim)
    scale = torch.rand(in_dim // 32, out_dim) + 0.5
    return Fp8Weight(data, scale / (448 * in_dim ** 0.5), 32)


QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4, "fp8": quantize_fp8, "fp8 every value": None}


def quantized_weight(kind: str, out_dim: int, in_dim: int):
    """A random weight in the format (INT4 and FP8's blocks: widths of 32s only)."""
    if in_dim % 32 and kind in ("int4", "fp8 every value"):
        pytest.skip(f"{kind}: groups of 32s")
    if kind == "fp8 every value":
        return every_e4m3_value(out_dim, in_dim)
    return QUANTIZERS[kind](torch.randn(out_dim, in_dim) / in_dim ** 0.5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", list(QUANTIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows,out_dim,in_dim", [(1, 64, 96), (7, 48, 256), (7, 48, 40), (33, 160, 576),
                                                     (5, 24, 64), (300, 32, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_over_quantized_weights_matches_the_dequantized_weight(backend, kind, dtype, num_rows, out_dim,
                                                                      in_dim, with_bias):
    """INT8, INT4 (groups of 32, 64, 128) and FP8 (a scale a row; every e4m3 value in groups of 32): decode rows
    and more, out dims of 16s (panels on the compiled backend) and not (24: the reference's way), fp32, bf16 and
    fp16 activations (the panel GEMM's result in theirs); 300 rows of bf16: the AMX tiles where the CPU has them."""
    ops = ops_of(backend)
    weight = quantized_weight(kind, out_dim, in_dim)
    bias = torch.randn(out_dim).to(dtype) if with_bias else None
    x = torch.randn(num_rows, in_dim).to(dtype)
    served = ops.prepare_weight("layers.0.down_proj", weight)
    assert type(served) is type(weight)
    got = ops.linear(x, served, bias)
    want = F.linear(x.float(), weight.dequantize(torch.float32), None if bias is None else bias.float())
    assert got.dtype == dtype and got.shape == (num_rows, out_dim)
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("kind", list(QUANTIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_rows,out_dim,in_dim", [(1, 64, 96), (13, 40, 256), (13, 40, 200), (70, 96, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_triton_gemms_match_the_dequantized_weight(device, kind, dtype, num_rows, out_dim, in_dim, with_bias):
    """A decode step's tile (16 rows) and a prompt chunk's (64): INT8, INT4 groups of 32 (K steps cut to 32), 64
    and 128, FP8 rows of 96, 200 or 576 (a last K step partial), every e4m3 value; N not a multiple of the
    tiles."""
    from kernels import gemm
    weight = quantized_weight(kind, out_dim, in_dim).to(device)
    bias = torch.randn(out_dim).to(device, dtype) if with_bias else None
    x = torch.randn(num_rows, in_dim).to(device, dtype)
    got = gemm.linear(x, weight, bias)
    want = F.linear(x.float(), weight.dequantize(torch.float32), None if bias is None else bias.float())
    assert got.dtype == dtype and got.shape == (num_rows, out_dim)
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("in_dim", [96, 576, 2100])
def test_fp8_rows_quantize_each_row_as_quantize_fp8_does(device, dtype, in_dim):
    """The FP8 dots' activations (kernels/gemm.fp8_rows, bit moves) == torch's e4m3 rounding of x / (max |x| / 448)
    bit for bit: rows from 1e-3 to 1e2 (e4m3 subnormals among them), a zero row, rows wider than a K step."""
    from kernels import gemm
    x = torch.randn(11, in_dim) * torch.logspace(-3, 2, 11)[:, None]
    x[3] = 0.0
    x = x.to(device, dtype)
    values, scale = gemm.fp8_rows(x)
    largest = x.float().abs().amax(dim=1) / 448
    largest[3] = 1.0
    assert torch.equal(scale, largest)
    assert torch.equal(values, (x.float() / largest[:, None]).to(torch.float8_e4m3fn).view(torch.uint8))


def fp8_dots_oracle(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """Its own lines: each row of x on the scale max |row| / 448 rounded to e4m3 by torch, the e4m3 weight on its
    groups' scales, the product in fp32."""
    scale = x.float().abs().amax(dim=1, keepdim=True) / 448
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    rows = (x.float() / scale).to(torch.float8_e4m3fn).float() * scale
    values = weight.data.view(torch.float8_e4m3fn).float()
    w = values * weight.scale.T.repeat_interleave(weight.group_size, dim=1)
    return F.linear(rows, w, None if bias is None else bias.float())


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("kind", ["fp8", "fp8 every value"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_rows,out_dim,in_dim", [(1, 64, 96), (13, 40, 256), (70, 96, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_dots_match_activations_quantized_by_row(device, kind, dtype, num_rows, out_dim, in_dim, with_bias):
    """An FP8 weight with fp8_activations (e4m3 x e4m3 dots, as prepare_weight marks it on sm_89+): the Triton
    GEMM and the torch reference == the oracle, a decode step's tile and a prompt chunk's, a scale a row or groups
    of 32 (every e4m3 value); and within e4m3's rounding of the weight-only product."""
    from dataclasses import replace

    from kernels import gemm
    weight = replace(quantized_weight(kind, out_dim, in_dim), fp8_activations=True).to(device)
    bias = torch.randn(out_dim).to(device, dtype) if with_bias else None
    x = torch.randn(num_rows, in_dim).to(device, dtype)
    want = fp8_dots_oracle(x, weight, bias)
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for got in (gemm.linear(x, weight, bias), reference.linear(x, weight, bias)):
        assert got.dtype == dtype and got.shape == (num_rows, out_dim)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    weight_only = F.linear(x.float(), weight.dequantize(torch.float32), None if bias is None else bias.float())
    assert (want - weight_only).abs().max() < 0.1 * weight_only.abs().max()


def test_only_a_gpu_with_fp8_tensor_cores_prepares_fp8_dots(monkeypatch):
    """prepare_weight marks an FP8 weight for e4m3 dots on sm_89 and later; CPU tensors, older GPUs and other
    formats stay as they are."""
    from kernels import gemm
    weight = quantize_fp8(torch.randn(32, 64))
    assert gemm.prepare_weight("layers.0.o_proj", weight) is weight
    if not torch.cuda.is_available():
        pytest.skip("no GPU here: the capability check on a device needs one")
    on_gpu = weight.to("cuda")
    capability = torch.cuda.get_device_capability()
    assert gemm.prepare_weight("layers.0.o_proj", on_gpu).fp8_activations == (capability >= (8, 9))
    for fake, marked in (((8, 0), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, fake=fake: fake)
        assert gemm.prepare_weight("layers.0.o_proj", on_gpu).fp8_activations == marked
        int8 = quantize_int8(torch.randn(32, 64)).to("cuda")
        assert gemm.prepare_weight("layers.0.o_proj", int8) is int8


def gptq_act_order(out_dim: int, in_dim: int, group_size: int, seed: int = 0):
    """A 4-bit GPTQ weight in act order as its format defines it: groups of group_size input channels picked by a
    permutation (g_idx), q [in, out] packed eight values an int32 along the input channels, zeros packed eight an
    int32 along the output channels (GPTQ's first format: zero - 1 stored), fp16 scales; and the fp32 weight [out,
    in] they encode."""
    g = torch.Generator().manual_seed(seed)
    num_groups = in_dim // group_size
    g_idx = torch.empty(in_dim, dtype=torch.int32)
    g_idx[torch.randperm(in_dim, generator=g)] = (torch.arange(in_dim) // group_size).int()
    q = torch.randint(0, 16, (in_dim, out_dim), generator=g)
    zeros = torch.randint(1, 16, (num_groups, out_dim), generator=g)
    scales = (torch.rand(num_groups, out_dim, generator=g) * 0.02 + 0.01).half()
    shifts = torch.arange(0, 32, 4)
    qweight = (q.view(in_dim // 8, 8, out_dim) << shifts[None, :, None]).sum(1)
    qzeros = ((zeros - 1).view(num_groups, out_dim // 8, 8) << shifts).sum(2)
    weight = (scales.float()[g_idx.long()] * (q - zeros[g_idx.long()]).float()).T
    as_int32 = lambda t: t.to(torch.int64).to(torch.uint32).view(torch.int32)            # noqa: E731
    return as_int32(qweight), as_int32(qzeros), scales, g_idx, weight.contiguous()


def act_order_case(num_rows: int):
    """An act-order GPTQ weight kept packed (int4_from_gptq), checked against the format's definition and
    dequantize_gptq; x and F.linear over the weight it encodes."""
    from kernels.quant import dequantize_gptq, int4_from_gptq
    qweight, qzeros, scales, g_idx, want_w = gptq_act_order(48, 256, 64)
    weight = int4_from_gptq(qweight, qzeros, scales, g_idx, zero_offset=1)
    assert weight.input_order is not None and weight.group_size == 64
    assert torch.equal(g_idx[weight.input_order].long(), torch.arange(256) // 64)
    torch.testing.assert_close(weight.dequantize(torch.float32), want_w, atol=0, rtol=0)
    torch.testing.assert_close(dequantize_gptq(qweight, qzeros, scales, g_idx, 4, 1), want_w, atol=0, rtol=0)
    x = torch.randn(num_rows, 256, dtype=torch.bfloat16)
    return weight, x, F.linear(x.float(), want_w)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("num_rows", [1, 9, 70])
def test_a_gptq_weight_in_act_order_stays_packed_and_reads_x_in_its_order(backend, num_rows):
    """int4_from_gptq keeps an act-order weight packed, its input channels sorted by group (input_order), the same
    values as the format's definition; linear gathers x into that order (the torch reference; the compiled
    panels, AMX tiles from 8 rows, oneDNN over dequantized slices from 48 without them) == F.linear."""
    weight, x, want = act_order_case(num_rows)
    ops = ops_of(backend)
    got = ops.linear(x, ops.prepare_weight("layers.0.down_proj", weight), None)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("num_rows", [1, 70])
def test_the_triton_gemm_reads_x_in_a_gptq_weights_act_order(device, num_rows):
    from kernels import gemm
    weight, x, want = act_order_case(num_rows)
    got = gemm.linear(x.to(device), weight.to(device), None)
    assert got.device.type == device
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)


def test_act_orders_keep_apart_and_refuse_a_slice():
    """Parts stored in different orders do not fuse into one weight; a row-parallel share of one is no run of
    groups (the loader serves those dequantized)."""
    from kernels.quant import int4_from_gptq
    a, b = (int4_from_gptq(*gptq_act_order(32, 128, 32, seed)[:4], zero_offset=1) for seed in (0, 1))
    assert Int4Weight.cat([a, a]).input_order is a.input_order
    with pytest.raises(ValueError, match="stored in different orders"):
        Int4Weight.cat([a, b])
    with pytest.raises(ValueError, match="act order"):
        a.input_slice(0, 64)
    assert a.nbytes == 32 * 64 + 4 * 32 * 5 + 128 * 8


def test_an_fp8_weight_slices_along_its_rows_and_groups():
    q = quantize_fp8(torch.randn(16, 256))
    whole = q.dequantize(torch.float32)
    part = q.input_slice(96, 224)                                           # one group a row: any cut
    assert part.group_size == 128 and torch.equal(part.dequantize(torch.float32), whole[:, 96:224])
    blocks = every_e4m3_value(16, 128)
    assert torch.equal(blocks.input_slice(32, 96).dequantize(torch.float32), blocks.dequantize(torch.float32)[:, 32:96])
    with pytest.raises(ValueError, match="input channels 16:80 cut groups of 32"):
        blocks.input_slice(16, 80)
    rows = Fp8Weight.cat([q.output_rows(slice(0, 5)), q.output_rows(slice(5, 16))])
    assert torch.equal(rows.dequantize(torch.float32), whole)
