"""LoRA shrink/expand: Triton kernels against the torch reference, mixed ranks and base-only tokens in one call."""
import pytest
import torch

from backend.lora.batch import LoraSegments
from kernels import reference
from kernels.lora import lora_expand, lora_shrink

TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def segments_for(lengths_and_slots) -> LoraSegments:
    return LoraSegments.from_token_slots([slot for n, slot in lengths_and_slots for _ in range(n)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("in_dim,out_dim", [(64, 96), (96, 256)])
@pytest.mark.parametrize("ranks", [(4, 64, 8), (16, 32, 48), (8,)])
def test_shrink_then_expand_match_reference(dtype, in_dim, out_dim, ranks):
    num_slots, cap = 4, 64
    rank_per_slot = torch.zeros(num_slots, dtype=torch.int32)
    rank_per_slot[:len(ranks)] = torch.tensor(ranks, dtype=torch.int32)
    lora_a = (torch.randn(num_slots, cap, in_dim) * 0.2).to(dtype)
    lora_b = (torch.randn(num_slots, out_dim, cap) * 0.2).to(dtype)
    # ragged segments, one slot appearing twice, base-only tokens between them
    layout = [(5, 0), (3, -1), (19, len(ranks) - 1), (1, 0 if len(ranks) == 1 else 1), (7, -1), (2, 0)]
    segments = segments_for(layout)
    num_tokens = sum(n for n, _ in layout)
    x = torch.randn(num_tokens, in_dim).to(dtype)
    base = torch.randn(num_tokens, out_dim).to(dtype)
    ranks_list = rank_per_slot.tolist()

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
    untouched = torch.tensor([slot < 0 for n, slot in layout for _ in range(n)])
    assert torch.equal(got[untouched], base[untouched])
