"""KV cache writes and RoPE: Triton kernels against the torch reference (interpreter on CPU)."""
import pytest
import torch

from kernels import reference
from kernels.kv_cache import write_kv_cache
from kernels.rotary import rotary
from tests.helpers import KERNEL_DEVICES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_kv_heads,block_size", [(64, 2, 16), (128, 1, 32), (64, 3, 32), (80, 2, 4)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_cache_matches_reference(dtype, head_dim, num_kv_heads, block_size, slot_dtype, device):
    num_blocks, num_tokens = 6, 11
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype).to(device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens].to(slot_dtype).to(device)   # shuffled, across blocks
    caches = [torch.zeros(num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=device) for _ in range(4)]
    reference.write_kv_cache(k, v, caches[0], caches[1], slots)
    write_kv_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 4, 4), (64, 6, 2), (128, 4, 1), (96, 8, 2)])
def test_rotary_matches_reference(dtype, head_dim, num_heads, num_kv_heads, device):
    from backend.model.config import ModelConfig
    from backend.model.layers import rope_cos_sin
    cfg = ModelConfig("LlamaForCausalLM", 32, head_dim * num_heads, 64, 1, num_heads, num_kv_heads, head_dim, 256,
                      1e-5, 10000.0, None, False, False, None, None, None)
    cos_sin = rope_cos_sin(cfg).to(device)
    positions = torch.tensor([0, 1, 2, 7, 100, 255, 3, 40], dtype=torch.int32, device=device)
    q = torch.randn(len(positions), num_heads, head_dim).to(dtype).to(device)
    k = torch.randn(len(positions), num_kv_heads, head_dim).to(dtype).to(device)
    want_q, want_k = reference.rotary(q.float(), k.float(), positions, cos_sin)
    got_q, got_k = rotary(q, k, positions, cos_sin)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert got_q.dtype == dtype
    torch.testing.assert_close(got_q.float(), want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(got_k.float(), want_k, atol=tol, rtol=tol)
