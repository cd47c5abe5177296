"""A mixture of experts in two grouped GEMMs: each token's k (token, expert) rows sorted by expert into blocks of
BLOCK_M rows of one expert (`align_to_experts`, torch ops on the device: no host sync, so a CUDA graph records it),
then one launch for every expert's gate and up, SiLU-and-mul (kernels/fused.py), and one launch for every expert's
down that applies the routing weights as it stores. The k rows of a token are summed last, in fp32."""
import os

import torch
import triton
import triton.language as tl

from kernels.fused import silu_and_mul

DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"       # see kernels/paged_attention.py


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, sorted_rows_ptr, block_experts_ptr, weights_ptr, num_rows, n_dim,
                         k_dim, rows_per_a, stride_at, stride_be, stride_bn, stride_bk, stride_ct,
                         MUL_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """c[row] = a[row // rows_per_a] @ b[expert]^T (times weights[row]) for the BLOCK_M sorted rows of one
    expert this program holds, BLOCK_N of the output's columns. Padding rows (>= num_rows) load and store nothing."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:                                             # past the last expert's rows
        return
    rows = tl.load(sorted_rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = rows < num_rows
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_dim
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (rows // rows_per_a).to(tl.int64)[:, None] * stride_at
    b_cols = b_ptr + expert.to(tl.int64) * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_mask = k0 + offs_k < k_dim
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_cols + (k0 + offs_k).to(tl.int64)[:, None] * stride_bk, mask=k_mask[:, None] & n_mask[None, :],
                    other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision="ieee")                             # [BLOCK_M, BLOCK_N]
    if MUL_WEIGHTS:
        acc *= tl.load(weights_ptr + rows, mask=row_mask, other=0.0)[:, None]
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_ct + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_mask[:, None] & n_mask[None, :])


def moe_config(num_rows: int, num_experts: int, itemsize: int) -> dict:
    """Tiles: 16 sorted rows a block where experts get a few rows each (decode), 64 where they get many (prompt
    chunks); 32-wide K steps in fp32 (shared memory), 64 otherwise."""
    block_m = 16 if num_rows <= 4 * num_experts else 64
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 32 if itemsize == 4 else 64, "num_warps": 4}


def align_to_experts(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows t * k + j (token t's j-th expert) grouped by expert, each expert's group padded to a multiple of
    block_m with the row count (a padding mark). -> (sorted_rows [capacity] int32, block_experts [capacity /
    block_m] int32: each block's expert, -1 past the last). Shapes depend on the row count only."""
    flat = topk_ids.flatten().long()                                             # [num_rows]
    num_rows = flat.numel()
    num_blocks = (num_rows + min(num_rows, num_experts) * (block_m - 1) + block_m - 1) // block_m
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat,
                                                                                          torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)                                     # rows by expert
    experts = flat[order]
    rank = torch.arange(num_rows, device=flat.device) - (counts.cumsum(0) - counts)[experts]
    sorted_rows = torch.full((num_blocks * block_m,), num_rows, dtype=torch.int32, device=flat.device)
    sorted_rows[(padded_ends - padded)[experts] + rank] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(padded_ends, starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_rows, block_experts


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, sorted_rows: torch.Tensor, block_experts: torch.Tensor,
                 num_rows: int, rows_per_a: int, cfg: dict, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Semantics: c[row] = a[row // rows_per_a] @ b[expert of row].T (* weights[row]) for row < num_rows.
    a [tokens, K], b [num_experts, N, K] -> c [num_rows, N] in a's dtype."""
    n_dim, k_dim = b.shape[1], b.shape[2]
    c = torch.empty(num_rows, n_dim, dtype=a.dtype, device=a.device)
    grid = (block_experts.numel(), triton.cdiv(n_dim, cfg["BLOCK_N"]))
    _grouped_gemm_kernel[grid](a, b, c, sorted_rows, block_experts, weights if weights is not None else c, num_rows,
                               n_dim, k_dim, rows_per_a, a.stride(0), b.stride(0), b.stride(1), b.stride(2),
                               c.stride(0), MUL_WEIGHTS=weights is not None, DOT_FP32=DOT_FP32, **cfg)
    return c


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """Semantics (kernels.reference.fused_moe):
        for t, j: e = topk_ids[t, j]
            rows[t, j] = topk_weights[t, j] * silu_and_mul(x[t] @ w_gate_up[e].T) @ w_down[e].T
        return rows.sum(1) (in fp32, rounded to x's dtype)
    x [num_tokens, hidden]; w_gate_up [num_experts, 2 * inter, hidden]; w_down [num_experts, hidden, inter];
    topk_weights [num_tokens, k] fp32, topk_ids [num_tokens, k]."""
    num_tokens, top_k = topk_ids.shape
    num_rows = num_tokens * top_k
    if num_rows == 0:
        return torch.zeros_like(x)
    cfg = moe_config(num_rows, w_gate_up.shape[0], x.element_size())
    sorted_rows, block_experts = align_to_experts(topk_ids, w_gate_up.shape[0], cfg["BLOCK_M"])
    gate_up = grouped_gemm(x, w_gate_up, sorted_rows, block_experts, num_rows, top_k, cfg)   # [num_rows, 2 * inter]
    act = silu_and_mul(gate_up)                                                             # [num_rows, inter]
    down = grouped_gemm(act, w_down, sorted_rows, block_experts, num_rows, 1, cfg,
                        topk_weights.reshape(-1).float().contiguous())                     # [num_rows, hidden]
    return down.view(num_tokens, top_k, -1).sum(1, dtype=torch.float32).to(x.dtype)
