"""The elementwise work of a layer, each step in one launch: residual add + RMSNorm, RoPE + the KV-cache write,
SiLU-and-mul. Math in fp32, rounded to the activations' dtype where the torch reference rounds. Each adds a LoRA
product left by the GEMM before it as it loads that GEMM's output (HAS_DELTA: kernels/lora/executor.LoraDelta)."""
import torch
import triton
import triton.language as tl

from kernels.fp8 import fp32_to_e4m3
from kernels.quant import cache_format


@triton.jit
def _lora_rows(delta_ptr, m_ptr, slots_ptr, token, stride_dt, stride_ms):
    """The token's row of the delta, its slot's row of magnitudes, and whether it has an adapter."""
    slot = tl.load(slots_ptr + token)
    return delta_ptr + token * stride_dt, m_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_ms, slot >= 0


@triton.jit
def _plus_delta(x, delta_row, m_row, cols, has):
    """x (values as loaded, at these columns of the GEMM's output) with the LoRA delta added where `has`: ((x +
    delta) * m) rounded once to x's dtype (the merge's bits); x as it is elsewhere."""
    d = tl.load(delta_row + cols, mask=has, other=0.0)
    m = tl.load(m_row + cols, mask=has, other=1.0).to(tl.float32)
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
        delta_row, m_row, has = _lora_rows(delta_ptr, m_ptr, slots_ptr, token, stride_dt, stride_ms)
        x = _plus_delta(x, delta_row, m_row, cols, mask & has)
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
        delta_row, m_row, has = _lora_rows(delta_ptr, m_ptr, slots_ptr, token, stride_dt, stride_ms)
        gate = _plus_delta(gate, delta_row, m_row, cols, mask & has)
        up = _plus_delta(up, delta_row, m_row, inter + cols, mask & has)
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_half(src, d, mask, delta_row, m_row, cols, has, HAS_DELTA: tl.constexpr):
    """Half of each head: src and cols [BLOCK_H, 1] (the heads' starts, their first qkv columns), d [1,
    BLOCK_HALF]; with the LoRA delta added where the token has an adapter (HAS_DELTA)."""
    x = tl.load(src + d, mask=mask)
    if HAS_DELTA:
        x = _plus_delta(x, delta_row, m_row, cols + d, mask & has)
    return x


@triton.jit
def _store(dst, x, mask, inv, QUANT: tl.constexpr):
    """x (in the activations' dtype) stored as dst holds it (kernels/quant.quantize_kv): as it is (QUANT 0), an
    INT8 cache's floor(x * inv + 0.5) clamped to [-127, 127] (1), an FP8 cache's e4m3 bits of x * inv clamped to
    [-448, 448] (2)."""
    if QUANT == 1:
        x = tl.minimum(tl.maximum(tl.floor(x.to(tl.float32) * inv + 0.5), -127.0), 127.0)
    elif QUANT == 2:
        x = fp32_to_e4m3(tl.minimum(tl.maximum(x.to(tl.float32) * inv, -448.0), 448.0))
    tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(src, dst, cos, sin, d, mask, delta_row, m_row, cols, has, inv, HALF: tl.constexpr,
            HAS_DELTA: tl.constexpr, QUANT: tl.constexpr):
    """Rows of heads: src, dst, cols [BLOCK_H, 1] head starts, d [1, BLOCK_HALF]; cos, sin [1, BLOCK_HALF] fp32; the
    rotated halves rounded to src's dtype, then stored as dst holds them (_store)."""
    x1 = _load_half(src, d, mask, delta_row, m_row, cols, has, HAS_DELTA).to(tl.float32)
    x2 = _load_half(src + HALF, d, mask, delta_row, m_row, cols + HALF, has, HAS_DELTA).to(tl.float32)
    _store(dst + d, (x1 * cos - x2 * sin).to(src.dtype.element_ty), mask, inv, QUANT)
    _store(dst + HALF + d, (x2 * cos + x1 * sin).to(src.dtype.element_ty), mask, inv, QUANT)


@triton.jit
def _rotary_and_cache_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr,
                             cos_sin_ptr, delta_ptr, m_ptr, slots_ptr, num_heads, num_kv_heads, stride_qt, stride_qh,
                             stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_ch, stride_cs,
                             stride_cos, stride_dt, stride_ms, inv_k, inv_v, HALF: tl.constexpr,
                             BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, HAS_DELTA: tl.constexpr,
                             QUANT: tl.constexpr):
    """Program (token, block of BLOCK_H heads) of the query heads followed by the key heads: a query head is rotated
    into q_out, a key head rotated into the cache with its value head copied beside it (tokens with slot -1,
    padding, write no cache). HAS_DELTA: q, k and v with the qkv projection's LoRA delta added as they load (its
    columns: q's heads, then k's, then v's, 2 * HALF each). QUANT: an INT8 (1) or FP8 (2) cache, K and V quantized
    against the inverses of their scales, inv_k and inv_v (cache_format)."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = d < HALF
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cos + d, mask=d_mask)
    sin = tl.load(cos_sin_ptr + pos * stride_cos + HALF + d, mask=d_mask)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if HAS_DELTA:
        delta_row, m_row, has = _lora_rows(delta_ptr, m_ptr, slots_ptr, token, stride_dt, stride_ms)
    else:
        delta_row, m_row, has = delta_ptr, m_ptr, token < 0
    is_q = heads < num_heads
    is_kv = (heads >= num_heads) & (heads < num_heads + num_kv_heads) & (slot >= 0)
    q_head = tl.where(is_q, heads, 0).to(tl.int64)[:, None]
    _rotate(q_ptr + token * stride_qt + q_head * stride_qh, q_out_ptr + token * stride_ot + q_head * stride_oh,
            cos, sin, d, is_q[:, None] & d_mask, delta_row, m_row, q_head * 2 * HALF, has, 1.0, HALF, HAS_DELTA, 0)
    kv_head = tl.where(is_kv, heads - num_heads, 0).to(tl.int64)[:, None]
    kv_mask = is_kv[:, None] & d_mask
    cache_rows = kv_head * stride_ch + tl.maximum(slot, 0) * stride_cs
    k_cols = (num_heads + kv_head) * 2 * HALF
    _rotate(k_ptr + token * stride_kt + kv_head * stride_kh, k_cache_ptr + cache_rows, cos, sin, d, kv_mask,
            delta_row, m_row, k_cols, has, inv_k, HALF, HAS_DELTA, QUANT)
    v_src = v_ptr + token * stride_vt + kv_head * stride_vh
    v_cols = k_cols + num_kv_heads * 2 * HALF
    for half in tl.static_range(2):
        v = _load_half(v_src + half * HALF, d, kv_mask, delta_row, m_row, v_cols + half * HALF, has, HAS_DELTA)
        _store(v_cache_ptr + cache_rows + half * HALF + d, v, kv_mask, inv_v, QUANT)


def inverse_scales(kv_scales: tuple[float, float] | None) -> tuple[float, float]:
    """1 / k_scale, 1 / v_scale of an INT8 or FP8 cache (1.0 for a cache in the activations' dtype)."""
    return (1.0, 1.0) if kv_scales is None else (1 / kv_scales[0], 1 / kv_scales[1])


def norm_config(hidden: int) -> dict:
    return {"BLOCK": triton.next_power_of_2(hidden)}


def silu_config() -> dict:
    return {"BLOCK": 1024}


ROTARY_VALUES = 1024                # a rotary program's share of a token's heads: BLOCK_H x BLOCK_HALF values


def rotary_config(head_dim: int, num_heads: int, quantized_cache: bool = False) -> dict:
    """num_heads: query and key heads together; quantized_cache (INT8 or FP8): half the values a program (the
    quantization's registers beside a LoRA delta's spilled 16 bytes on sm_80 at 1024)."""
    block_half = triton.next_power_of_2(head_dim // 2)
    values = ROTARY_VALUES // 2 if quantized_cache else ROTARY_VALUES
    block_h = min(triton.next_power_of_2(num_heads), max(values // block_half, 1))
    return {"HALF": head_dim // 2, "BLOCK_HALF": block_half, "BLOCK_H": block_h}


def delta_args(shape: tuple, delta, stand_in: torch.Tensor) -> tuple:
    """A LoraDelta's launch arguments (delta, m, token slots, their strides) for the GEMM output of this shape that
    the op reads, stand_in (any tensor of the op's) in their place where None."""
    if delta is None:
        return stand_in, stand_in, stand_in, 0, 0
    assert delta.delta.stride(1) == 1 and delta.m.stride(1) == 1 and delta.delta.shape == shape
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
        d, m, slots, stride_dt, stride_ms = delta_args(x.shape, delta, x)
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
        d, m, slots, stride_dt, stride_ms = delta_args(gate_up.shape, delta, gate_up)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, cfg["BLOCK"]))](
            gate_up, out, d, m, slots, inter, gate_up.stride(0), out.stride(0), stride_dt, stride_ms,
            HAS_DELTA=delta is not None, **cfg)
    return out


def rotary_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, delta=None, kv_scales: tuple[float, float] | None = None
                     ) -> torch.Tensor:
    """Semantics (RoPE in fp32, neox layout; one launch):
        q, k, v = add_qkv_delta(q, k, v, delta)           (kernels.reference: the qkv projection's LoRA, None: none)
        cos, sin = cos_sin[positions, :half], cos_sin[positions, half:]
        rotate(x) = cat(x[..., :half] * cos - x[..., half:] * sin, x[..., half:] * cos + x[..., :half] * sin)
        if kv_scales: k, v = quantize_kv(rotate(k), kv_scales[0], k_cache.dtype), quantize_kv(v, ...)  (kernels.quant)
        for t, slot in enumerate(slot_mapping): if slot >= 0:
            k_cache[:, slot // block_size, slot % block_size] = rotate(k)[t]; v_cache[...same] = v[t]
        return rotate(q)
    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    caches: [num_kv_heads, num_blocks, block_size, head_dim] (int8, or uint8 e4m3 bits, with kv_scales); cos_sin:
    [max_positions, head_dim] fp32.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and head_dim % 2 == 0
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.shape[0] == num_kv_heads and k_cache.shape[3] == head_dim and k.dtype == v.dtype
    assert k_cache.dtype == v_cache.dtype
    quant = cache_format(k_cache.dtype, k.dtype, kv_scales)
    assert cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and cos_sin.shape[1] == head_dim
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    cfg = rotary_config(head_dim, num_heads + num_kv_heads, kv_scales is not None)
    if num_tokens:
        qkv_shape = torch.Size([num_tokens, (num_heads + 2 * num_kv_heads) * head_dim])
        d, m, slots, stride_dt, stride_ms = delta_args(qkv_shape, delta, q)
        _rotary_and_cache_kernel[(num_tokens, triton.cdiv(num_heads + num_kv_heads, cfg["BLOCK_H"]))](
            q, k, v, q_out, k_cache, v_cache, positions, slot_mapping, cos_sin, d, m, slots, num_heads, num_kv_heads,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out.stride(0),
            q_out.stride(1), k_cache.stride(0), k_cache.stride(2), cos_sin.stride(0), stride_dt, stride_ms,
            *inverse_scales(kv_scales), HAS_DELTA=delta is not None, QUANT=quant, **cfg)
    return q_out
