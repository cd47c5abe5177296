"""Per-step batch metadata, built once per step on the host from the scheduled batch and shared by every layer."""
from dataclasses import dataclass
from typing import Callable

import torch

from backend.scheduler import Batch
from kernels.metadata import AttentionMetadata


@dataclass(slots=True)
class StepContext:
    input_ids: torch.Tensor                   # [num_tokens] int32, packed, no padding
    positions: torch.Tensor                   # [num_tokens] int32
    attn: AttentionMetadata
    logits_indices: torch.Tensor              # [num_sampled] int32: last token of each sequence that samples
    context_indices: torch.Tensor             # [num_context] int32: prompt tokens whose logits were asked for
    lora: object | None = None                # per-step adapter segments (backend/lora/batch.py)
    between_layers: Callable[[], None] | None = None      # called after each layer (CPU: backend/openmp.TeamSizer)


class StepInputs:
    """The step's token ids, positions, cache slots and attention tables as host int32 tensors (`tensors`, sent
    to the device in one copy with the sampler's and LoRA's), and the host-side figures kernels launch with."""

    def __init__(self, batch: Batch, block_size: int):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_starts = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        context_indices: list[int] = []
        self.context_chunks: list[tuple[int, int, int]] = []     # (item index, first position, number of rows)
        for index, item in enumerate(batch.items):
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
            prompt_end = min(end, len(seq.prompt_ids))
            if seq.params.return_context_logits and start < prompt_end and not seq.output_ids \
                    and seq.sequence_index == 0:
                self.context_chunks.append((index, start, prompt_end - start))
                context_indices += range(query_starts[-2], query_starts[-2] + prompt_end - start)
        max_blocks = max(len(item.seq.block_table) for item in batch.items)
        block_tables = torch.zeros(len(batch.items), max_blocks, dtype=torch.int32)
        for i, item in enumerate(batch.items):
            block_tables[i, :len(item.seq.block_table)] = torch.tensor(item.seq.block_table, dtype=torch.int32)
        self.query_starts = query_starts
        self.seq_lens = seq_lens
        self.max_query_len = max(item.num_new_tokens for item in batch.items)
        self.tensors = {
            "input_ids": torch.tensor(input_ids, dtype=torch.int32),
            "positions": torch.tensor(positions, dtype=torch.int32),
            "slot_mapping": torch.tensor(slots, dtype=torch.int32),
            "query_starts": torch.tensor(query_starts, dtype=torch.int32),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
            "block_tables": block_tables,
            "logits_indices": torch.tensor(logits_indices, dtype=torch.int32),
            "context_indices": torch.tensor(context_indices, dtype=torch.int32),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "StepInputs":
        """The inputs another rank built (`tensors` as sent to a tensor-parallel worker)."""
        inputs = cls.__new__(cls)
        inputs.tensors = tensors
        inputs.query_starts = tensors["query_starts"].tolist()
        inputs.seq_lens = tensors["seq_lens"].tolist()
        inputs.max_query_len = max(b - a for a, b in zip(inputs.query_starts, inputs.query_starts[1:]))
        inputs.context_chunks = []
        return inputs

    def context(self, t: dict[str, torch.Tensor]) -> StepContext:
        """The context over `t`: these tensors, or their device copies."""
        attn = AttentionMetadata(
            query_starts=t["query_starts"], seq_lens=t["seq_lens"], block_tables=t["block_tables"],
            slot_mapping=t["slot_mapping"], query_starts_list=self.query_starts, seq_lens_list=self.seq_lens,
            max_query_len=self.max_query_len, max_seq_len=max(self.seq_lens))
        return StepContext(t["input_ids"], t["positions"], attn, t["logits_indices"], t["context_indices"])

