"""Per-step attention metadata shared by every attention implementation."""
from dataclasses import dataclass

import torch


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


# Integer kernel arguments that change from step to step (sequence counts, block-table widths, token counts in a
# stride) or between projections (column blocks): Triton would otherwise compile a variant for each of "== 1",
# "divisible by 16" and neither, on the engine thread, the first time a step happens to produce one
# (tests/kernels/test_specializations.py).
UNSPECIALIZED_ARGS = {"_attention_kernel": ("num_seqs", "stride_bt"),
                      "_shrink_kernel": ("split_k", "blocks_per_split", "stride_ps"),
                      "_expand_kernel": (), "_merge_kernel": ()}
