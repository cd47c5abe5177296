"""The Triton path's GEMMs: torch's over full-precision weights, ours over weight-only INT8, INT4 and FP8 weights
(kernels/quant.Int8Weight, Int4Weight, Fp8Weight): each [BLOCK_K, BLOCK_N] tile of the weight loaded as int8 (a
quarter of fp32's bytes, half of bf16's), as bytes of two 4-bit values (a quarter of bf16's) or as e4m3 bytes,
converted to the activations' dtype in registers (exact: |q| <= 127, |q - zero| <= 16, e4m3 through fp16 by bit
moves, on any GPU), tensor-core dots accumulated in fp32. INT8's output channels' scales and the bias applied once
at the store; INT4's and FP8's scales a group, so to each K step's dot (a tile never crosses a group: BLOCK_K
divides the group size, or a row is one group). On GPUs with FP8 tensor cores (sm_89+) an FP8 weight is prepared for
e4m3 x e4m3 dots instead (Fp8Weight.fp8_activations): each row of activations quantized to e4m3 on a scale of its
own (fp8_rows), the dot of bytes with bytes, the row's scale applied once at the store."""
from dataclasses import replace

import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.fp8 import e4m3_to_fp16, fp32_to_e4m3
from kernels.metadata import DOT_FP32, UNSPECIALIZED_ARGS
from kernels.quant import Fp8Weight, Int4Weight, Int8Weight, QuantizedWeight

FP8_DOTS_CAPABILITY = (8, 9)                # Ada and Hopper on: e4m3 tensor-core dots


def prepare_weight(name: str, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
    """A weight as linear takes it: an FP8 one on a GPU with FP8 tensor cores marked for e4m3 x e4m3 dots
    (Fp8Weight.fp8_activations, vLLM's FP8 with per-token activation scales), any other as it is."""
    if isinstance(weight, Fp8Weight) and weight.data.is_cuda \
            and torch.cuda.get_device_capability(weight.data.device) >= FP8_DOTS_CAPABILITY:
        return replace(weight, fp8_activations=True)
    return weight


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """Semantics: kernels.reference.linear; an INT8 weight by int8_linear, an INT4 or FP8 one by grouped_linear."""
    if isinstance(weight, Int8Weight):
        return int8_linear(x, weight, bias)
    if isinstance(weight, (Int4Weight, Fp8Weight)):
        return grouped_linear(x, weight, bias)
    return reference.linear(x, weight, bias)


@triton.jit(do_not_specialize=UNSPECIALIZED_ARGS["_int8_gemm_kernel"])
def _int8_gemm_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, num_rows, n_dim, k_dim, stride_xm, stride_wn,
                      stride_ym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """y[rows, cols] = (x[rows] @ w[cols].T) * scale[cols] (+ bias[cols]) for this program's BLOCK_M rows and
    BLOCK_N output columns."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < num_rows, offs_n < n_dim
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_mask = k0 + offs_k < k_dim
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + (k0 + offs_k).to(tl.int64)[:, None], mask=k_mask[:, None] & n_mask[None, :],
                    other=0)                                                      # [BLOCK_K, BLOCK_N] int8
        if DOT_FP32:                                     # (the interpreter: no int8 -> bf16 cast of its own)
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        else:
            w = w.to(x.dtype)
        acc += tl.dot(x, w, input_precision="ieee")
    acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def int8_config(num_rows: int, itemsize: int) -> dict:
    """Tiles: 16 rows for a decode step (its columns in 32-wide programs, so an 8B projection's 4096 columns make
    128 programs to stream the weight), 64 rows for prompt chunks; K steps of 128 and 64. In fp32 (ieee dots, no
    tensor cores) half of each, and prompt tiles 32 wide: 64-wide ones spilled 848 B on sm_90
    (scripts/compile_kernels.py --only int8_ --resources)."""
    wide = itemsize != 4
    if num_rows <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128 if wide else 64, "num_warps": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 64 if wide else 32, "BLOCK_K": 64 if wide else 32, "num_warps": 4}


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """Semantics: F.linear(x, weight.data.float() * weight.scale[:, None], bias) in fp32, rounded once to x's
    dtype. x [num_rows, in_dim]; weight.data [out_dim, in_dim] int8 -> [num_rows, out_dim]."""
    x = x.contiguous()
    num_rows, k_dim = x.shape
    n_dim = weight.data.shape[0]
    y = torch.empty(num_rows, n_dim, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y
    cfg = int8_config(num_rows, x.element_size())
    grid = (triton.cdiv(num_rows, cfg["BLOCK_M"]), triton.cdiv(n_dim, cfg["BLOCK_N"]))
    _int8_gemm_kernel[grid](x, weight.data, weight.scale, bias if bias is not None else weight.scale, y, num_rows,
                            n_dim, k_dim, x.stride(0), weight.data.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                            DOT_FP32=DOT_FP32, **cfg)
    return y


@triton.jit(do_not_specialize=UNSPECIALIZED_ARGS["_grouped_scale_gemm_kernel"])
def _grouped_scale_gemm_kernel(x_ptr, x_scale_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, y_ptr, num_rows, n_dim,
                               k_dim, group_size, stride_xm, stride_wn, stride_ym, FP8: tl.constexpr,
                               FP8_DOTS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """y[rows, cols] = sum over K steps of (x[rows, ks] @ w[cols, ks].T) * scale[g, cols] (+ bias[cols]), g = the
    step's group, for this program's BLOCK_M rows and BLOCK_N output columns; w = q - zero[g] (INT4: two values a
    byte) or e4m3 * 2^-8 (FP8: its bits moved into an fp16's, whose exponent bias is 8 more; the 2^8 in the
    scale). FP8_DOTS: x holds e4m3 bytes too, each row on x_scale[row] (applied at the store), and the dots take
    both as e4m3."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < num_rows, offs_n < n_dim
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    shifts = ((offs_k % 2) * 4)[:, None]                                      # INT4: k's nibble in its byte
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_mask = k0 + offs_k < k_dim
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        group = (k0 // group_size).to(tl.int64) * n_dim
        scale = tl.load(scale_ptr + group + offs_n, mask=n_mask, other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        if FP8_DOTS:
            x = x.to(tl.float8e4nv, bitcast=True)
            w = tl.load(w_cols + (k0 + offs_k).to(tl.int64)[:, None], mask=w_mask, other=0)
            w = w.to(tl.float8e4nv, bitcast=True)
        elif FP8:
            w = e4m3_to_fp16(tl.load(w_cols + (k0 + offs_k).to(tl.int64)[:, None], mask=w_mask, other=0))
            scale *= 256.0                                                      # (fp8.E4M3_FP16_GAP)
        else:
            packed = tl.load(w_cols + ((k0 + offs_k) // 2).to(tl.int64)[:, None], mask=w_mask, other=0)
            zero = tl.load(zero_ptr + group + offs_n, mask=n_mask, other=0).to(tl.int32)
            w = ((packed.to(tl.int32) >> shifts) & 15) - zero[None, :]          # [BLOCK_K, BLOCK_N]
        if FP8_DOTS:
            acc += tl.dot(x, w) * scale[None, :]
        else:
            if DOT_FP32:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            else:
                w = w.to(x.dtype)
            acc += tl.dot(x, w, input_precision="ieee") * scale[None, :]
    if FP8_DOTS:
        acc *= tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def grouped_config(num_rows: int, itemsize: int, group_size: int, k_dim: int) -> dict:
    """int8_config's tiles, K steps that divide the group size (a multiple of 32: each step within one group), or
    any where a row is one group."""
    cfg = int8_config(num_rows, itemsize)
    block_k = cfg["BLOCK_K"]
    while group_size != k_dim and group_size % block_k:
        block_k //= 2
    return cfg | {"BLOCK_K": block_k}


def grouped_linear(x: torch.Tensor, weight: Int4Weight | Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """Semantics: F.linear(x, weight.dequantize(torch.float32), bias) in fp32 (each group's dot scaled as a whole;
    fp8_activations: x as fp8_rows quantizes it, each row's scale applied at the end; an input_order: x's channels
    gathered into it first), rounded once to x's dtype. x [num_rows, in_dim]; weight.data [out_dim, in_dim / 2]
    (INT4) or [out_dim, in_dim] (FP8) uint8 -> [num_rows, out_dim]."""
    x, weight = weight.in_stored_order(x)
    x = x.contiguous()
    num_rows, k_dim = x.shape
    n_dim = weight.data.shape[0]
    y = torch.empty(num_rows, n_dim, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y
    fp8 = isinstance(weight, Fp8Weight)
    fp8_dots = fp8 and weight.fp8_activations
    x_scale = weight.scale
    if fp8_dots:
        x, x_scale = fp8_rows(x)
    cfg = grouped_config(num_rows, x.element_size(), weight.group_size, k_dim)
    grid = (triton.cdiv(num_rows, cfg["BLOCK_M"]), triton.cdiv(n_dim, cfg["BLOCK_N"]))
    _grouped_scale_gemm_kernel[grid](x, x_scale, weight.data, weight.scale, weight.data if fp8 else weight.zero,
                                     bias if bias is not None else weight.scale, y, num_rows, n_dim, k_dim,
                                     weight.group_size, x.stride(0), weight.data.stride(0), y.stride(0), FP8=fp8,
                                     FP8_DOTS=fp8_dots, HAS_BIAS=bias is not None, DOT_FP32=DOT_FP32, **cfg)
    return y


@triton.jit
def _fp8_rows_kernel(x_ptr, q_ptr, scale_ptr, k_dim, stride_xm, stride_qm, BLOCK_K: tl.constexpr):
    """Row program_id(0) of x: scale = max |x| / 448 (1 where that is 0), then each e4m3(x / scale)'s byte."""
    row = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    largest = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs_k, mask=k0 + offs_k < k_dim, other=0.0)
        largest = tl.maximum(largest, tl.abs(x.to(tl.float32)))
    scale = tl.math.div_rn(tl.max(largest, axis=0), 448.0)                          # (quant.FP8_MAX)
    scale = tl.where(scale > 0, scale, 1.0)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, k_dim, BLOCK_K):
        k_mask = k0 + offs_k < k_dim
        x = tl.load(x_ptr + row * stride_xm + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        q = fp32_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0))
        tl.store(q_ptr + row * stride_qm + k0 + offs_k, q.to(tl.uint8), mask=k_mask)


FP8_ROWS_BLOCK = 1024                       # values of a row a K step of _fp8_rows_kernel


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: q = kernels.quant.quantize_fp8(x) (each row on its own scale, max |x| / 448, e4m3 values of x /
    scale rounded to nearest even); -> (q.data [num_rows, in_dim] uint8, q.scale[0] [num_rows] fp32)."""
    num_rows, k_dim = x.shape
    q = torch.empty(num_rows, k_dim, dtype=torch.uint8, device=x.device)
    scale = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows:
        _fp8_rows_kernel[(num_rows,)](x, q, scale, k_dim, x.stride(0), q.stride(0),
                                      BLOCK_K=min(FP8_ROWS_BLOCK, triton.next_power_of_2(k_dim)))
    return q, scale
