"""The fused elementwise kernels (residual add + RMSNorm, RoPE + KV-cache write, SiLU-and-mul): Triton against the
torch reference (interpreter on CPU)."""
import pytest
import torch

from backend.model.checkpoint import ModelConfig
from backend.model.rope import cos_sin as rope_cos_sin
from kernels import fused, reference
from tests.helpers import KERNEL_DEVICES
from tests.kernels.test_paged_attention import CACHE_KINDS

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_reference(dtype, hidden, with_residual, device):
    x = torch.randn(7, hidden).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype).to(device)
    residual = torch.randn(7, hidden).to(dtype).to(device) if with_residual else None
    want_out, want_stream = reference.add_rms_norm(x.clone(), None if residual is None else residual.clone(), weight,
                                                   1e-5)
    got_out, got_stream = fused.add_rms_norm(x, residual, weight, 1e-5)
    assert got_out.dtype == dtype
    torch.testing.assert_close(got_out, want_out, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    torch.testing.assert_close(got_stream, want_stream, atol=TOL[dtype], rtol=TOL[dtype])
    if with_residual:
        assert got_stream is residual                                 # the sum is written into the stream
    else:
        assert got_stream is x


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [80, 1536, 2100])
def test_silu_and_mul_matches_reference(dtype, inter, device):
    gate_up = (torch.randn(5, 2 * inter) * 4).to(dtype).to(device)
    want = reference.silu_and_mul(gate_up)
    got = fused.silu_and_mul(gate_up)
    torch.testing.assert_close(got, want, atol=TOL[dtype] * 4, rtol=TOL[dtype] * 2)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,block_size", [(64, 4, 4, 16), (64, 6, 2, 4), (128, 4, 1, 32),
                                                                         (96, 8, 2, 16), (80, 10, 2, 16),
                                                                         (128, 18, 6, 16)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("cache", [None, "int8", "fp8"])
def test_rotary_and_cache_matches_reference(dtype, head_dim, num_heads, num_kv_heads, block_size, slot_dtype,
                                            cache, device):
    """q, k, v sliced from one fused qkv row as the model has them; tokens land in shuffled slots across blocks, and
    a padding token (slot -1) writes nothing. 18 + 6 heads of 128: two programs a token, the second's block of
    heads both query and key heads, its last masked. An INT8 or FP8 cache (kv_scales): K rotated and rounded to the
    activations' dtype, then quantized (within one step of the reference's rotation's rounding), V quantized
    exactly as the reference does (FP8: e4m3 by bit moves == torch's rounding)."""
    kv_scales = None if cache is None else (0.05, 0.03)
    cfg = ModelConfig("LlamaForCausalLM", 32, head_dim * num_heads, 64, 1, num_heads, num_kv_heads, head_dim, 256,
                      1e-5, 10000.0, None, False, False, None, None, None)
    cos_sin = rope_cos_sin(cfg).to(device)
    positions = torch.tensor([0, 1, 2, 7, 100, 255, 3, 40], dtype=torch.int32, device=device)
    num_tokens, num_blocks = len(positions), 6
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[5] = -1
    slots = slots.to(slot_dtype).to(device)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype).to(device)

    def views(t):
        q, k, v = t.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        return (q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
                v.reshape(-1, num_kv_heads, head_dim))
    cache_dtype = dtype if cache is None else CACHE_KINDS[cache][0]
    caches = [torch.full((num_kv_heads, num_blocks, block_size, head_dim), 7, dtype=cache_dtype, device=device)
              for _ in range(4)]
    keep = slots >= 0
    q, k, v = views(qkv.float())
    want_q, want_k = reference.rotary(q, k, positions, cos_sin)
    reference.write_kv_cache(want_k[keep].to(dtype), v[keep].to(dtype), caches[0], caches[1], slots[keep], kv_scales)
    got_q = fused.rotary_and_cache(*views(qkv), positions, cos_sin, caches[2], caches[3], slots, kv_scales=kv_scales)
    assert got_q.dtype == dtype and caches[2].dtype == cache_dtype
    torch.testing.assert_close(got_q.float(), want_q, atol=TOL[dtype], rtol=TOL[dtype])
    if kv_scales is None:
        torch.testing.assert_close(caches[2], caches[0], atol=TOL[dtype], rtol=TOL[dtype])
    else:
        assert_within_a_step(caches[2], caches[0])
        assert (caches[2] != 7).any()
    assert torch.equal(caches[3], caches[1])                          # v is copied as it is; slot -1 left 7


def assert_within_a_step(got: torch.Tensor, want: torch.Tensor) -> None:
    """Quantized caches' values at most one step of their format apart: an int8 unit, or an e4m3 step (1/8 of the
    value's power of two, 2^-9 among subnormals: a tiny value may round to either sign's zero)."""
    if got.dtype == torch.int8:
        assert (got.int() - want.int()).abs().max() <= 1
        return
    a, b = (t.view(torch.float8_e4m3fn).float() for t in (got, want))
    assert bool(((a - b).abs() <= torch.maximum(a.abs(), b.abs()) / 8 + 2 ** -9).all())
