"""RoPE (neox layout: the two halves of each head rotate together) for packed tokens with per-token positions."""
import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, pos_ptr, cos_sin_ptr, stride_xt, stride_xh, stride_ot, stride_oh, stride_cs,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    mask = d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=mask)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d, mask=mask)
    src = x_ptr + token.to(tl.int64) * stride_xt + head * stride_xh
    x1 = tl.load(src + d, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF + d, mask=mask).to(tl.float32)
    dst = out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh
    tl.store(dst + d, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + d, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def rotary_config(head_dim: int) -> dict:
    return {"HALF": head_dim // 2, "BLOCK_HALF": triton.next_power_of_2(head_dim // 2)}


def _rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _rotary_kernel[(x.shape[0], x.shape[1])](x, out, positions, cos_sin, x.stride(0), x.stride(1),
                                                 out.stride(0), out.stride(1), cos_sin.stride(0),
                                                 **rotary_config(x.shape[2]))
    return out


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics (computed in fp32, stored in q's dtype):
        cos, sin = cos_sin[positions, :half], cos_sin[positions, half:]
        rotate(x) = cat(x[..., :half] * cos - x[..., half:] * sin, x[..., half:] * cos + x[..., :half] * sin)
        return rotate(q), rotate(k)
    q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]; cos_sin: [max_pos, head_dim] fp32
    """
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and q.shape[-1] % 2 == 0
    assert cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and cos_sin.shape[1] == q.shape[-1]
    return _rotate(q, positions, cos_sin), _rotate(k, positions, cos_sin)
