"""LoRA shrink/expand: Triton kernels against the torch reference, mixed ranks and base-only tokens in one call."""
import pytest
import torch

from backend.lora.batch import LoraSegments
from kernels import reference
from kernels.lora import lora_expand, lora_shrink
from tests.helpers import DEVICES, KERNEL_DEVICES

TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def segments_for(lengths_and_slots, device="cpu") -> LoraSegments:
    segments = LoraSegments.from_token_slots([slot for n, slot in lengths_and_slots for _ in range(n)])
    segments.use({name: t.to(device) for name, t in segments.tensors.items()})
    return segments


def random_weights(num_slots, cap, in_dim, out_dim, dtype, rank_major: bool, device="cpu"):
    """A [num_slots, cap, in_dim] and B [num_slots, out_dim, cap]; rank_major stores them as DeviceSlots does."""
    if rank_major:
        return ((torch.randn(num_slots, in_dim, cap) * 0.2).to(dtype).to(device).transpose(1, 2),
                (torch.randn(num_slots, cap, out_dim) * 0.2).to(dtype).to(device).transpose(1, 2))
    return ((torch.randn(num_slots, cap, in_dim) * 0.2).to(dtype).to(device),
            (torch.randn(num_slots, out_dim, cap) * 0.2).to(dtype).to(device))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)])
@pytest.mark.parametrize("in_dim,out_dim", [(64, 96), (96, 256)])
@pytest.mark.parametrize("ranks", [(4, 64, 8), (16, 32, 48), (8,)])
@pytest.mark.parametrize("rank_major", [False, True])
def test_shrink_then_expand_match_reference(dtype, weight_dtype, in_dim, out_dim, ranks, rank_major, device):
    """Adapters in the activations' dtype, or fp16 beside fp32 activations (widened in the kernels)."""
    num_slots, cap = 4, 64
    rank_per_slot = torch.zeros(num_slots, dtype=torch.int32)
    rank_per_slot[:len(ranks)] = torch.tensor(ranks, dtype=torch.int32)
    ranks_list = rank_per_slot.tolist()
    rank_per_slot = rank_per_slot.to(device)
    lora_a, lora_b = random_weights(num_slots, cap, in_dim, out_dim, weight_dtype, rank_major, device)
    # ragged segments, one slot appearing twice, base-only tokens between them
    layout = [(5, 0), (3, -1), (19, len(ranks) - 1), (1, 0 if len(ranks) == 1 else 1), (7, -1), (2, 0)]
    segments = segments_for(layout, device)
    num_tokens = sum(n for n, _ in layout)
    x = torch.randn(num_tokens, in_dim).to(dtype).to(device)
    base = torch.randn(num_tokens, out_dim).to(dtype).to(device)

    want_h = reference.lora_shrink(x.float(), lora_a.float(), segments, rank_per_slot, ranks_list)
    got_h = lora_shrink(x, lora_a, segments, rank_per_slot, ranks_list)
    for start, end, slot in zip(segments.starts_list, segments.starts_list[1:], segments.slots_list):
        if slot >= 0:
            r = ranks_list[slot]
            torch.testing.assert_close(got_h[start:end, :r].float(), want_h[start:end, :r], atol=TOL[dtype],
                                       rtol=TOL[dtype])

    want = base.float().clone()
    reference.lora_expand(got_h.float(), lora_b.float(), segments, rank_per_slot, ranks_list, want)
    got = base.clone()
    lora_expand(got_h, lora_b, segments, rank_per_slot, ranks_list, got)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    untouched = torch.tensor([slot < 0 for n, slot in layout for _ in range(n)], device=device)
    assert torch.equal(got[untouched], base[untouched])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [
    [(3, -1), (2, 0), (1, 1), (2, 3)],                # decode-like: base rows first, a slot with no tokens between
    [(9, 1), (7, 2), (12, 3)],                        # short prompt chunks, no base rows
])
def test_padded_grid_matches_segment_loop(dtype, layout, device):
    """The torch path's batched-matmul grid == one matmul per segment, with weights past each rank not zero."""
    num_slots, cap, in_dim, out_dim = 5, 32, 48, 80
    ranks = torch.tensor([8, 32, 4, 16, 0], dtype=torch.int32)
    ranks_list = ranks.tolist()
    ranks = ranks.to(device)
    lora_a, lora_b = random_weights(num_slots, cap, in_dim, out_dim, dtype, rank_major=True, device=device)
    segments = segments_for(layout, device)
    assert segments.padded is not None
    loop = segments_for(layout, device)
    loop.padded = None
    num_tokens = sum(n for n, _ in layout)
    x = torch.randn(num_tokens, in_dim).to(dtype).to(device)
    base = torch.randn(num_tokens, out_dim).to(dtype).to(device)
    h_grid = reference.lora_shrink(x, lora_a, segments, ranks, ranks_list)
    h_loop = reference.lora_shrink(x, lora_a, loop, ranks, ranks_list)
    torch.testing.assert_close(h_grid, h_loop, atol=TOL[dtype], rtol=TOL[dtype])
    got, want = base.clone(), base.clone()
    reference.lora_expand(h_grid, lora_b, segments, ranks, ranks_list, got)
    reference.lora_expand(h_loop, lora_b, loop, ranks, ranks_list, want)
    torch.testing.assert_close(got, want, atol=TOL[dtype] * 4, rtol=TOL[dtype])


def test_padded_grid_only_where_it_pays():
    assert segments_for([(2, 0), (3, -1)]).padded is None               # base rows after adapter rows
    assert segments_for([(2, 1), (2, 0)]).padded is None                # slots out of order
    assert segments_for([(1, 0), (30, 2)]).padded is None               # 90 grid rows for 31 tokens
    assert segments_for([(40, 0), (40, 1)]).padded is None              # long segments
    assert segments_for([(4, 0), (3, 1), (4, 2)]).padded.rows.tolist() == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11]
