"""The elementwise work of a layer, each step in one launch: residual add + RMSNorm, RoPE + the KV-cache write,
SiLU-and-mul. Math in fp32, rounded to the activations' dtype where the torch reference rounds. The add + RMSNorm
and the SiLU-and-mul add a LoRA product left by the GEMM before them as they load its output (HAS_DELTA:
kernels/lora_overlap.LoraDelta)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _with_delta(x, delta_ptr, m_ptr, slots_ptr, token, cols, mask, stride_dt, stride_ms):
    """x (a token's columns, as loaded) with its LoRA delta added where the token has an adapter: ((x + delta) *
    m[slot]) rounded once to x's dtype (the merge's bits); x as it is where it has none."""
    slot = tl.load(slots_ptr + token)
    has = mask & (slot >= 0)
    d = tl.load(delta_ptr + token * stride_dt + cols, mask=has, other=0.0)
    m = tl.load(m_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_ms + cols, mask=has, other=1.0).to(tl.float32)
    return tl.where(has, ((x.to(tl.float32) + d) * m).to(x.dtype), x)


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, delta_ptr, m_ptr, slots_ptr, hidden, eps,
                         stride_xt, stride_rt, stride_ot, stride_dt, stride_ms, HAS_RESIDUAL: tl.constexpr,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + token * stride_xt + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        x = _with_delta(x, delta_ptr, m_ptr, slots_ptr, token, cols, mask, stride_dt, stride_ms)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + token * stride_rt + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(out_ptr.dtype.element_ty)                             # the sum as the residual stream keeps it
        tl.store(residual_ptr + token * stride_rt + cols, x, mask=mask)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, (w * normed.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, delta_ptr, m_ptr, slots_ptr, inter, stride_gt, stride_ot, stride_dt,
                         stride_ms, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + token * stride_gt + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + token * stride_gt + inter + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        gate = _with_delta(gate, delta_ptr, m_ptr, slots_ptr, token, cols, mask, stride_dt, stride_ms)
        up = _with_delta(up, delta_ptr, m_ptr, slots_ptr, token, inter + cols, mask, stride_dt, stride_ms)
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(src, dst, cos, sin, d, mask, HALF: tl.constexpr):
    """Rows of heads: src, dst [BLOCK_H, 1] head starts, d [1, BLOCK_HALF]; cos, sin [1, BLOCK_HALF] fp32."""
    x1 = tl.load(src + d, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF + d, mask=mask).to(tl.float32)
    tl.store(dst + d, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + d, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_and_cache_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr,
                             cos_sin_ptr, num_heads, num_kv_heads, stride_qt, stride_qh, stride_kt, stride_kh,
                             stride_vt, stride_vh, stride_ot, stride_oh, stride_ch, stride_cs, stride_cos,
                             HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (token, block of BLOCK_H heads) of the query heads followed by the key heads: a query head is rotated
    into q_out, a key head rotated into the cache with its value head copied beside it (tokens with slot -1,
    padding, write no cache)."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = d < HALF
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cos + d, mask=d_mask)
    sin = tl.load(cos_sin_ptr + pos * stride_cos + HALF + d, mask=d_mask)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    is_q = heads < num_heads
    is_kv = (heads >= num_heads) & (heads < num_heads + num_kv_heads) & (slot >= 0)
    q_head = tl.where(is_q, heads, 0).to(tl.int64)[:, None]
    _rotate(q_ptr + token * stride_qt + q_head * stride_qh, q_out_ptr + token * stride_ot + q_head * stride_oh,
            cos, sin, d, is_q[:, None] & d_mask, HALF)
    kv_head = tl.where(is_kv, heads - num_heads, 0).to(tl.int64)[:, None]
    kv_mask = is_kv[:, None] & d_mask
    cache_rows = kv_head * stride_ch + tl.maximum(slot, 0) * stride_cs
    _rotate(k_ptr + token * stride_kt + kv_head * stride_kh, k_cache_ptr + cache_rows, cos, sin, d, kv_mask, HALF)
    v_src = v_ptr + token * stride_vt + kv_head * stride_vh
    tl.store(v_cache_ptr + cache_rows + d, tl.load(v_src + d, mask=kv_mask), mask=kv_mask)
    tl.store(v_cache_ptr + cache_rows + HALF + d, tl.load(v_src + HALF + d, mask=kv_mask), mask=kv_mask)


def norm_config(hidden: int) -> dict:
    return {"BLOCK": triton.next_power_of_2(hidden)}


def silu_config() -> dict:
    return {"BLOCK": 1024}


ROTARY_VALUES = 1024                # a rotary program's share of a token's heads: BLOCK_H x BLOCK_HALF values


def rotary_config(head_dim: int, num_heads: int) -> dict:
    """num_heads: query and key heads together."""
    block_half = triton.next_power_of_2(head_dim // 2)
    block_h = min(triton.next_power_of_2(num_heads), max(ROTARY_VALUES // block_half, 1))
    return {"HALF": head_dim // 2, "BLOCK_HALF": block_half, "BLOCK_H": block_h}


def delta_args(x: torch.Tensor, delta) -> tuple:
    """A LoraDelta's launch arguments (delta, m, token slots, their strides), x's in their place where None."""
    if delta is None:
        return x, x, x, 0, 0
    assert delta.delta.stride(1) == 1 and delta.m.stride(1) == 1 and delta.delta.shape == x.shape
    return delta.delta, delta.m, delta.token_slots, delta.delta.stride(0), delta.m.stride(0)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, delta=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics:
        x = add_lora_delta(x, delta)                  (kernels.reference; the GEMM's output itself left as it is)
        if residual is not None: residual += x; x = residual
        return weight * (x * rsqrt(mean(x.float() ** 2, -1) + eps)).to(x.dtype), x
    x, residual: [num_tokens, hidden] (residual updated in place)."""
    num_tokens, hidden = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    assert residual is not None or delta is None, "a LoRA delta goes into the residual stream"
    out = torch.empty_like(x)
    stream = x if residual is None else residual
    if num_tokens:
        d, m, slots, stride_dt, stride_ms = delta_args(x, delta)
        _add_rms_norm_kernel[(num_tokens,)](x, stream, weight, out, d, m, slots, hidden, eps, x.stride(0),
                                            stream.stride(0), out.stride(0), stride_dt, stride_ms,
                                            HAS_RESIDUAL=residual is not None, HAS_DELTA=delta is not None,
                                            **norm_config(hidden))
    return out, stream


def silu_and_mul(gate_up: torch.Tensor, delta=None) -> torch.Tensor:
    """Semantics: gate, up = add_lora_delta(gate_up, delta).chunk(2, -1); return silu(gate) * up.
    [num_tokens, 2 * inter] -> [.., inter]"""
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(1) == 1
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    cfg = silu_config()
    if num_tokens:
        d, m, slots, stride_dt, stride_ms = delta_args(gate_up, delta)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, cfg["BLOCK"]))](
            gate_up, out, d, m, slots, inter, gate_up.stride(0), out.stride(0), stride_dt, stride_ms,
            HAS_DELTA=delta is not None, **cfg)
    return out


def rotary_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> torch.Tensor:
    """Semantics (RoPE in fp32, neox layout; one launch):
        cos, sin = cos_sin[positions, :half], cos_sin[positions, half:]
        rotate(x) = cat(x[..., :half] * cos - x[..., half:] * sin, x[..., half:] * cos + x[..., :half] * sin)
        for t, slot in enumerate(slot_mapping): if slot >= 0:
            k_cache[:, slot // block_size, slot % block_size] = rotate(k)[t]; v_cache[...same] = v[t]
        return rotate(q)
    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    caches: [num_kv_heads, num_blocks, block_size, head_dim]; cos_sin: [max_positions, head_dim] fp32.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and head_dim % 2 == 0
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.shape[0] == num_kv_heads and k_cache.shape[3] == head_dim and k.dtype == k_cache.dtype == v.dtype
    assert cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and cos_sin.shape[1] == head_dim
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    cfg = rotary_config(head_dim, num_heads + num_kv_heads)
    if num_tokens:
        _rotary_and_cache_kernel[(num_tokens, triton.cdiv(num_heads + num_kv_heads, cfg["BLOCK_H"]))](
            q, k, v, q_out, k_cache, v_cache, positions, slot_mapping, cos_sin, num_heads, num_kv_heads, q.stride(0),
            q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out.stride(0), q_out.stride(1),
            k_cache.stride(0), k_cache.stride(2), cos_sin.stride(0), **cfg)
    return q_out
