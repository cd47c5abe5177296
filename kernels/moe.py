"""A mixture of experts in two grouped GEMMs: each token's k (token, expert) rows sorted by expert into blocks of
BLOCK_M rows of one expert (`align_to_experts`, torch ops on the device: no host sync, so a CUDA graph records it),
then one launch for every expert's gate and up, SiLU-and-mul (kernels/fused.py), and one launch for every expert's
down that applies the routing weights as it stores. The k rows of a token are summed last, in fp32.

Adapters on the experts use the same kernel: the rows with an adapter sorted again by (slot, expert) pair, each
pair's A and B one group of the slots' stacks (kernels/metadata.ExpertLora), a shrink and an expand that adds into
the base GEMM's output (down's times the routing weights too). A router's or shared expert gate's LoRA (one matrix
pair per slot) is the same over groups that are slots (`slot_lora`)."""
import torch
import triton
import triton.language as tl

from kernels.fused import silu_and_mul
from kernels.metadata import DOT_FP32, UNSPECIALIZED_ARGS, ExpertLora


@triton.jit(do_not_specialize=UNSPECIALIZED_ARGS["_grouped_gemm_kernel"])
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, sorted_rows_ptr, block_experts_ptr, weights_ptr, num_rows, n_dim,
                         k_dim, rows_per_a, stride_at, stride_be, stride_bn, stride_bk, stride_ct,
                         MUL_WEIGHTS: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """c[row] (+)= a[row // rows_per_a] @ b[group]^T (times weights[row]) for the BLOCK_M sorted rows of one group
    (an expert, a (slot, expert) pair, a slot) this program holds, BLOCK_N of the output's columns. Padding rows
    (>= num_rows) load and store nothing."""
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
                    other=0.0).to(a.dtype)                                       # (fp16 adapters, fp32 model)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision="ieee")                             # [BLOCK_M, BLOCK_N]
    if MUL_WEIGHTS:
        acc *= tl.load(weights_ptr + rows, mask=row_mask, other=0.0)[:, None]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_ct + offs_n[None, :]
    mask = row_mask[:, None] & n_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def moe_config(num_rows: int, num_experts: int, itemsize: int) -> dict:
    """Tiles: 16 sorted rows a block where experts get a few rows each (decode), 64 where they get many (prompt
    chunks); in fp32 (ieee dots: no tensor cores) 32-wide N and K steps, which spill no registers with fp16
    adapters converted as they load (scripts/compile_kernels.py --resources), 64 otherwise."""
    block_m = 16 if num_rows <= 4 * num_experts else 64
    wide = 32 if itemsize == 4 else 64
    return {"BLOCK_M": block_m, "BLOCK_N": wide, "BLOCK_K": wide, "num_warps": 4}


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


def lora_config(cfg: dict, rank: int) -> dict:
    """An expand's tiles: K is the rank (>= 16 wide, as tl.dot wants; at most the base's K step)."""
    return cfg | {"BLOCK_K": max(16, min(cfg["BLOCK_K"], triton.next_power_of_2(rank)))}


def align_to_groups(keys: torch.Tensor, num_groups: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """align_to_experts over group keys where key num_groups marks a row in no group (no adapter): its blocks are
    skipped (-1). keys [num_rows] -> (sorted_rows, block_groups)."""
    sorted_rows, block_groups = align_to_experts(keys[:, None], num_groups + 1, block_m)
    return sorted_rows, torch.where(block_groups == num_groups, -1, block_groups)


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, sorted_rows: torch.Tensor, block_groups: torch.Tensor,
                 num_rows: int, rows_per_a: int, cfg: dict, weights: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Semantics: c[row] = a[row // rows_per_a] @ b[group of row].T (* weights[row]) for row < num_rows in a block of
    a group; with `out`, added into out[row] (c is out). a [tokens, K], b [groups, N, K] -> c [num_rows, N] in a's
    dtype (rows in no block untouched)."""
    n_dim, k_dim = b.shape[1], b.shape[2]
    c = out if out is not None else torch.empty(num_rows, n_dim, dtype=a.dtype, device=a.device)
    grid = (block_groups.numel(), triton.cdiv(n_dim, cfg["BLOCK_N"]))
    _grouped_gemm_kernel[grid](a, b, c, sorted_rows, block_groups, weights if weights is not None else c, num_rows,
                               n_dim, k_dim, rows_per_a, a.stride(0), b.stride(0), b.stride(1), b.stride(2),
                               c.stride(0), MUL_WEIGHTS=weights is not None, ACCUMULATE=out is not None,
                               DOT_FP32=DOT_FP32, **cfg)
    return c


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, lora: ExpertLora | None = None) -> torch.Tensor:
    """Semantics (kernels.reference.fused_moe):
        for t, j: e = topk_ids[t, j]; s = lora.row_slots[t * k + j] (-1: no adapter)
            gate_up = x[t] @ w_gate_up[e].T + (x[t] @ A_gate_up[s, e].T) @ B_gate_up[s, e].T   (gate's, then up's)
            act = silu_and_mul(gate_up)
            rows[t, j] = topk_weights[t, j] * (act @ w_down[e].T + (act @ A_down[s, e].T) @ B_down[s, e].T)
        return rows.sum(1) (in fp32, rounded to x's dtype)
    x [num_tokens, hidden]; w_gate_up [num_experts, 2 * inter, hidden]; w_down [num_experts, hidden, inter];
    topk_weights [num_tokens, k] fp32, topk_ids [num_tokens, k]."""
    num_tokens, top_k = topk_ids.shape
    num_rows, num_experts, inter = num_tokens * top_k, w_gate_up.shape[0], w_down.shape[2]
    if num_rows == 0:
        return torch.zeros_like(x)
    cfg = moe_config(num_rows, num_experts, x.element_size())
    sorted_rows, block_experts = align_to_experts(topk_ids, num_experts, cfg["BLOCK_M"])
    weights = topk_weights.reshape(-1).float().contiguous()
    gate_up = grouped_gemm(x, w_gate_up, sorted_rows, block_experts, num_rows, top_k, cfg)   # [num_rows, 2 * inter]
    if lora is not None:
        pairs = torch.where(lora.row_slots >= 0, lora.row_slots.long() * num_experts + topk_ids.reshape(-1),
                            lora.num_slots * num_experts)
        lora_rows, lora_blocks = align_to_groups(pairs, lora.num_slots * num_experts, cfg["BLOCK_M"])
        r = lora.max_rank
        expand = lora_config(cfg, r)
        h = grouped_gemm(x, lora.gate_up_a, lora_rows, lora_blocks, num_rows, top_k, cfg)    # [num_rows, 2 * r]
        for part in (0, 1):                                                                 # gate, up
            grouped_gemm(h[:, part * r:(part + 1) * r], lora.gate_up_b[part],
                         lora_rows, lora_blocks, num_rows, 1, expand, out=gate_up[:, part * inter:(part + 1) * inter])
    act = silu_and_mul(gate_up)                                                             # [num_rows, inter]
    down = grouped_gemm(act, w_down, sorted_rows, block_experts, num_rows, 1, cfg, weights)  # [num_rows, hidden]
    if lora is not None:
        h = grouped_gemm(act, lora.down_a, lora_rows, lora_blocks, num_rows, 1, cfg)        # [num_rows, r]
        grouped_gemm(h, lora.down_b, lora_rows, lora_blocks, num_rows, 1, expand, weights, out=down)
    return down.view(num_tokens, top_k, -1).sum(1, dtype=torch.float32).to(x.dtype)


def slot_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
              out: torch.Tensor) -> None:
    """Semantics: for t with token_slots[t] >= 0: out[t] += x[t] @ a[slot].T @ b[slot].T (kernels.reference.slot_lora).
    a [num_slots, rank, in], b [num_slots, out, rank]; out [num_tokens, out] (a view may be strided)."""
    num_tokens, num_slots = x.shape[0], a.shape[0]
    if num_tokens == 0:
        return
    cfg = moe_config(num_tokens, num_slots, x.element_size())
    keys = torch.where(token_slots >= 0, token_slots.long(), num_slots)
    rows, blocks = align_to_groups(keys, num_slots, cfg["BLOCK_M"])
    h = grouped_gemm(x, a, rows, blocks, num_tokens, 1, cfg)                                # [num_tokens, rank]
    grouped_gemm(h, b, rows, blocks, num_tokens, 1, lora_config(cfg, a.shape[1]), out=out)
