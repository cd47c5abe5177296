"""The mixture of experts: the Triton grouped GEMMs (interpreter on CPU) against the torch reference, and the
expert-sorted layout they read against its definition."""
import pytest
import torch

from kernels import moe, reference
from kernels.metadata import ExpertLora
from tests.helpers import CUDA_MARKS, INTERPRETER_MARK, KERNEL_DEVICES, cpu_kernels_build

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



IMPLEMENTATIONS = [pytest.param(reference, "cpu", id="reference"),               # (the reference is a backend too)
                   pytest.param("cpu_ops", "cpu", marks=pytest.mark.skipif(not cpu_kernels_build(), reason=(
                       "the compiled CPU kernels do not build here")), id="compiled-cpu"),
                   pytest.param(moe, "cpu", marks=INTERPRETER_MARK, id="triton-cpu"),
                   pytest.param(moe, "cuda", marks=CUDA_MARKS, id="triton-cuda")]


def loaded(ops):
    """The compiled CPU ops, imported only where they build."""
    if ops == "cpu_ops":
        from kernels import cpu_ops
        return cpu_ops
    return ops


def expert_lora(num_slots: int, num_experts: int, rank: int, hidden: int, inter: int, row_slots: torch.Tensor,
                dtype, device) -> ExpertLora:
    """Random stacks, zero past each slot's own rank as the slots keep them; group slot * experts + expert."""
    groups = num_slots * num_experts
    ranks = torch.randint(1, rank + 1, (num_slots,)).repeat_interleave(num_experts)
    mask = (torch.arange(rank)[None, :] < ranks[:, None]).float()               # [groups, rank]
    gate_up_a = torch.randn(groups, 2 * rank, hidden) * 0.2 * mask.repeat(1, 2)[:, :, None]
    gate_up_b = torch.randn(2, groups, inter, rank) * 0.2 * mask[None, :, None, :]
    down_a = torch.randn(groups, rank, inter) * 0.2 * mask[:, :, None]
    down_b = torch.randn(groups, hidden, rank) * 0.2 * mask[:, None, :]
    return ExpertLora(row_slots.to(device), *(t.to(dtype).to(device) for t in (gate_up_a, gate_up_b, down_a,
                                                                               down_b)), num_slots,
                      ranks[::num_experts].long())


def naive_moe(x, w_gate_up, w_down, weights, ids, lora) -> torch.Tensor:
    """The definition, one (token, expert) row at a time, in fp64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    x, w_gate_up, w_down = x.double().cpu(), w_gate_up.double().cpu(), w_down.double().cpu()
    inter, r = w_down.shape[2], lora.max_rank
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e, s = int(ids[t, j]), int(lora.row_slots[t * ids.shape[1] + j])
            gate_up = w_gate_up[e] @ x[t]
            g = s * w_gate_up.shape[0] + e
            if s >= 0:
                h = lora.gate_up_a[g].double().cpu() @ x[t]
                gate_b, up_b = lora.gate_up_b[0, g].double().cpu(), lora.gate_up_b[1, g].double().cpu()
                gate_up += torch.cat([gate_b @ h[:r], up_b @ h[r:]])
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            down = w_down[e] @ act
            if s >= 0:
                down += lora.down_b[g].double().cpu() @ (lora.down_a[g].double().cpu() @ act)
            out[t] += float(weights[t, j]) * down
    return out


@pytest.mark.parametrize("ops,device", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype,lora_dtype", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                              (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,num_slots,rank", [(1, 8, 2, 2, 4), (9, 4, 2, 3, 16),
                                                                         (70, 8, 2, 4, 8), (6, 16, 4, 2, 32)])
def test_fused_moe_with_adapters_on_the_experts_matches_the_definition(ops, device, dtype, lora_dtype, num_tokens,
                                                                       num_experts, top_k, num_slots, rank):
    """Rows of several adapters and of none, ranks under the slots' max rank; fp16 adapters beside an fp32 model
    (lora_dtype auto on the compiled CPU and Triton backends); a decode step's rows and more (the torch backend's
    three ways: 70 tokens are 140 rows)."""
    ops = loaded(ops)
    hidden, inter = 64, 48
    x = torch.randn(num_tokens, hidden).to(dtype).to(device)
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden) / 8).to(dtype).to(device)
    w_down = (torch.randn(num_experts, hidden, inter) / 7).to(dtype).to(device)
    weights, ids = routed(num_tokens, num_experts, top_k, device)
    token_slots = torch.randint(-1, num_slots, (num_tokens,), dtype=torch.int32)
    lora = expert_lora(num_slots, num_experts, rank, hidden, inter, token_slots.repeat_interleave(top_k), lora_dtype,
                       device)
    got = ops.fused_moe(x, w_gate_up, w_down, weights, ids, lora)
    tol = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 5e-2}[lora_dtype]
    torch.testing.assert_close(got.double().cpu(), naive_moe(x, w_gate_up, w_down, weights, ids, lora), atol=tol,
                               rtol=tol)


@pytest.mark.parametrize("ops,device", IMPLEMENTATIONS)
def test_slot_lora_adds_each_tokens_adapter(ops, device):
    ops = loaded(ops)
    x = torch.randn(11, 64, device=device)
    a, b = torch.randn(3, 8, 64, device=device), torch.randn(3, 5, 8, device=device)
    token_slots = torch.tensor([0, -1, 2, 2, 1, -1, 0, 0, 1, 2, -1], dtype=torch.int32, device=device)
    out = torch.randn(11, 5, device=device)
    want = out.clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            want[t] += b[s] @ (a[s] @ x[t])
    ops.slot_lora(x, a, b, token_slots, out)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
