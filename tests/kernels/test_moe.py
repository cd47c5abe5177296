"""The mixture of experts: the Triton grouped GEMMs (interpreter on CPU) against the torch reference, and the
expert-sorted layout they read against its definition."""
import pytest
import torch

from kernels import moe, reference
from tests.helpers import KERNEL_DEVICES

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def routed(num_tokens: int, num_experts: int, top_k: int, device, skewed: bool = False):
    """Each token's top_k distinct experts and their weights (skewed: most tokens to expert 1, some experts idle)."""
    scores = torch.randn(num_tokens, num_experts)
    if skewed:
        scores[:, 1] += 4.0
        scores[:, -1] -= 100.0
    weights, ids = torch.topk(scores.softmax(-1), top_k, dim=-1)
    return weights.to(device), ids.to(device)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [(1, 4, 2, 16), (13, 8, 2, 16), (40, 16, 4, 16),
                                                                  (200, 8, 2, 64), (3, 128, 8, 16)])
@pytest.mark.parametrize("skewed", [False, True])
def test_align_to_experts_holds_each_row_once_in_blocks_of_one_expert(num_tokens, num_experts, top_k, block_m,
                                                                       skewed):
    _, ids = routed(num_tokens, num_experts, top_k, "cpu", skewed)
    sorted_rows, block_experts = moe.align_to_experts(ids, num_experts, block_m)
    num_rows = num_tokens * top_k
    assert sorted_rows.numel() == block_experts.numel() * block_m
    real = sorted_rows[sorted_rows < num_rows]
    assert sorted(real.tolist()) == list(range(num_rows))                   # every row once, padding marked
    assert bool((sorted_rows <= num_rows).all())
    flat = ids.flatten()
    for block, expert in enumerate(block_experts.tolist()):
        rows = sorted_rows[block * block_m:(block + 1) * block_m]
        rows = rows[rows < num_rows]
        if expert < 0:
            assert rows.numel() == 0                                        # past the last expert: nothing
        else:
            assert rows.numel() > 0 and bool((flat[rows.long()] == expert).all())
    assert block_experts.tolist() == sorted(block_experts.tolist(), key=lambda e: (e < 0, e))   # experts in order


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter", [(1, 8, 2, 64, 32), (7, 4, 1, 96, 48),
                                                                       (37, 8, 2, 128, 80), (90, 16, 4, 64, 64),
                                                                       (5, 64, 8, 64, 32)])
def test_fused_moe_matches_reference(dtype, num_tokens, num_experts, top_k, hidden, inter, device):
    """Decode-sized and prompt-sized row counts (16- and 64-row blocks), widths no multiple of the tiles, more
    experts than rows."""
    x = torch.randn(num_tokens, hidden).to(dtype).to(device)
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden) / hidden ** 0.5).to(dtype).to(device)
    w_down = (torch.randn(num_experts, hidden, inter) / inter ** 0.5).to(dtype).to(device)
    weights, ids = routed(num_tokens, num_experts, top_k, device, skewed=num_tokens == 90)
    want = reference.fused_moe(x, w_gate_up, w_down, weights, ids)
    got = moe.fused_moe(x, w_gate_up, w_down, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, atol=TOL[dtype] * 4, rtol=TOL[dtype] * 2)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_fused_moe_reads_no_padding_row(device):
    """A decode graph's padded step: tokens of garbage (NaN) beside real ones change none of the real tokens."""
    x = torch.randn(6, 64, device=device)
    w_gate_up, w_down = torch.randn(4, 64, 64, device=device) / 8, torch.randn(4, 64, 32, device=device) / 6
    weights, ids = routed(6, 4, 2, device)
    want = moe.fused_moe(x[:4], w_gate_up, w_down, weights[:4], ids[:4])
    x[4:] = float("nan")
    torch.testing.assert_close(moe.fused_moe(x, w_gate_up, w_down, weights, ids)[:4], want)
