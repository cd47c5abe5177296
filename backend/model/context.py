"""Per-step batch metadata, built once per step from the scheduled batch and shared by every layer."""
from dataclasses import dataclass

import torch

from backend.scheduler import Batch
from kernels.metadata import AttentionMetadata


@dataclass(slots=True)
class StepContext:
    input_ids: torch.Tensor                   # [num_tokens] int64, packed, no padding
    positions: torch.Tensor                   # [num_tokens] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor              # [num_sampled] int64: last token of each sequence that samples
    lora: object | None = None                # per-step adapter segments (backend/lora/batch.py)


def build_context(batch: Batch, block_size: int) -> StepContext:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_starts = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    for item in batch.items:
        seq, start = item.seq, item.seq.num_computed_tokens
        end = start + item.num_new_tokens
        input_ids += seq.token_ids[start:end]
        positions += range(start, end)
        table = seq.block_table
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        query_starts.append(query_starts[-1] + item.num_new_tokens)
        seq_lens.append(end)
        if item.samples:
            logits_indices.append(query_starts[-1] - 1)
    max_blocks = max(len(item.seq.block_table) for item in batch.items)
    block_tables = torch.zeros(len(batch.items), max_blocks, dtype=torch.int32)
    for i, item in enumerate(batch.items):
        block_tables[i, :len(item.seq.block_table)] = torch.tensor(item.seq.block_table, dtype=torch.int32)
    attn = AttentionMetadata(
        query_starts=torch.tensor(query_starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_starts_list=query_starts,
        seq_lens_list=seq_lens,
        max_query_len=max(item.num_new_tokens for item in batch.items),
        max_seq_len=max(seq_lens),
    )
    return StepContext(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        attn=attn,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
    )
