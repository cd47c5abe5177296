"""Per-step metadata shared by every implementation of an op: attention's, and a mixture's expert LoRA; and what
the Triton kernels' launches share (their unspecialized ints, DOT_FP32)."""
import os
from dataclasses import dataclass

import torch

# triton 3.7's interpreter computes garbage for bf16 tl.dot: there (only) the dots run in fp32
DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(slots=True)
class AttentionMetadata:
    query_starts: torch.Tensor                # [num_seqs + 1] int32: sequence s owns queries [starts[s], starts[s+1])
    seq_lens: torch.Tensor                    # [num_seqs] int32: context length including this step's tokens
    block_tables: torch.Tensor                # [num_seqs, max_blocks] int32
    slot_mapping: torch.Tensor                # [num_tokens] int32: cache slot of each new token
    query_starts_list: list[int]              # the same on the host, for loops that need Python ints
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    torch_plan: object | None = None          # kernels/reference.py's per-step split, built by its first layer
    num_splits: int | None = None             # attention's context splits, fixed (CUDA graphs); None: per step


@dataclass(slots=True)
class ExpertLora:
    """A step's LoRA on one mixture layer's experts, as backend/lora/expert_slots.py lays the slots out: group
    g = slot * num_experts + expert holds that slot's expert's matrices, zero past each adapter's rank."""
    row_slots: torch.Tensor                   # [num_tokens * k] int32: each (token, j-th expert) row's slot, -1: none
    gate_up_a: torch.Tensor                   # [groups, 2 * max_rank, hidden]: gate's A, then up's
    gate_up_b: torch.Tensor                   # [2, groups, inter, max_rank]: gate's B, then up's
    down_a: torch.Tensor                      # [groups, max_rank, inter]
    down_b: torch.Tensor                      # [groups, hidden, max_rank]
    num_slots: int
    slot_ranks: torch.Tensor | None = None    # [num_slots] int64 on the host: each slot's largest expert rank on
                                              # the layer, where the CPU paths read no more than it

    @property
    def max_rank(self) -> int:
        return self.down_a.shape[1]


# Integer kernel arguments that change from step to step (sequence counts, block-table widths, token counts in a
# stride) or between projections (column blocks): Triton would otherwise compile a variant for each of "== 1",
# "divisible by 16" and neither, on the engine thread, the first time a step happens to produce one
# (tests/kernels/test_specializations.py).
UNSPECIALIZED_ARGS = {"_attention_kernel": ("num_seqs", "stride_bt"),
                      "_shrink_kernel": ("split_k", "blocks_per_split", "stride_ps"),
                      "_expand_kernel": (), "_merge_kernel": (), "_grouped_gemm_kernel": ("num_rows",),
                      "_int8_gemm_kernel": ("num_rows",),
                      "_grouped_scale_gemm_kernel": ("num_rows",)}
