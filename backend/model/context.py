"""Per-step batch metadata, built once per step on the host from the scheduled batch and shared by every layer."""
import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from backend.sampler import SamplingPlan
from backend.scheduler import Batch
from kernels.metadata import AttentionMetadata

PENDING = -1                                  # a token id the host does not have yet (overlapped steps)


@functools.lru_cache(maxsize=None)
def _arange(n: int) -> tuple[torch.Tensor, list[int]]:
    """0..n-1 as an int32 tensor (shared by the steps of n rows: read only) and as a list."""
    return torch.arange(n, dtype=torch.int32), list(range(n))


@dataclass(slots=True)
class StepContext:
    input_ids: torch.Tensor                   # [num_tokens] int32, packed, no padding
    positions: torch.Tensor                   # [num_tokens] int32
    attn: AttentionMetadata
    logits_indices: torch.Tensor              # [num_sampled] int32: last token of each sequence that samples
    context_indices: torch.Tensor             # [num_context] int32: prompt tokens whose logits were asked for
    lora: object | None = None                # per-step adapter segments (backend/lora/batch.py)
    between_layers: Callable[[], None] | None = None      # called after each layer (CPU: backend/openmp.TeamSizer)


class BlockTables:
    """The batch's block tables as one int32 array kept from step to step, a row per sequence of the last step: a
    row is written again only where its sequence changed or its table grew (tables grow by appends, or are replaced
    whole: backend/kv_cache.py), so a steady decode step writes the blocks its sequences crossed into, not 256 a
    sequence at 4k tokens of context."""

    def __init__(self):
        self.array = np.zeros((0, 16), dtype=np.int32)
        self.written: list[tuple[object, list, int]] = []     # by row: (sequence, its table, how much is written)
        self.lengths = np.zeros(0, dtype=np.int64)             # by row: how much is written

    def rows(self, seqs: list) -> np.ndarray:
        """[num_seqs, longest table] int32, zero-padded."""
        longest = max(len(seq.block_table) for seq in seqs)
        if len(seqs) > self.array.shape[0] or longest > self.array.shape[1]:
            self.array = np.zeros((max(len(seqs), 2 * self.array.shape[0]), max(longest, 2 * self.array.shape[1])),
                                  dtype=np.int32)
            self.written = []
            self.lengths = np.zeros(self.array.shape[0], dtype=np.int64)
        written = self.written
        for i, seq in enumerate(seqs):
            table = seq.block_table
            if i < len(written) and written[i][0] is seq and written[i][1] is table:
                count = written[i][2]
                if len(table) == count:
                    continue
                if len(table) > count:                         # grown by appends
                    self.array[i, count:len(table)] = table[count:]
                    written[i] = (seq, table, len(table))
                    continue
            row = self.array[i]
            row[:len(table)] = table
            row[len(table):] = 0
            if i < len(written):
                written[i] = (seq, table, len(table))
            else:
                written.append((seq, table, len(table)))
        self.lengths[:len(seqs)] = [count for _, _, count in written[:len(seqs)]]
        return self.array[:len(seqs), :longest].copy()

    def rows_after_decode(self, seqs: list, crossed: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """`rows(seqs)` where seqs are the rows of the last call, in order, and have since decoded one token each:
        a table grew by one block where a sequence crossed into it (the rows `crossed`, into blocks[row]), and only
        there."""
        crossed = crossed.tolist()
        if crossed and int(blocks.max()) >= self.array.shape[1]:
            return self.rows(seqs)
        for row in crossed:
            seq, table, count = self.written[row]
            self.array[row, count:len(table)] = table[count:]
            self.written[row] = (seq, table, len(table))
            self.lengths[row] = len(table)
        return self.array[:len(seqs), :self.lengths[:len(seqs)].max()].copy()


@dataclass(slots=True)
class LaunchRows:
    """How a batch is launched: the scheduler's items in launch order (each adapter one segment), and its rows."""
    order: list[int]                          # the launch order, as indices into the scheduler's items
    slots: list[int]                          # each item's adapter slot, in launch order (none without adapters)
    rows_of: dict                             # each sampling sequence -> its row of the sampled tokens
    wanted: list[int]                         # the rows whose logits are sent back
    needs_last_tokens: bool                   # a row's next inputs need its token on the host (penalties, bad
                                              # words, top-p decay, a grammar)
    plan: SamplingPlan | None = None          # the sampling plan, kept where it serves every step (reusable)

    @classmethod
    def of(cls, items: list, slot_of: Callable[[int | None], int] | None) -> "LaunchRows":
        """The rows of a batch of items (the scheduler's order); slot_of: an adapter's slot (None: no adapters)."""
        order, slots = list(range(len(items))), []
        if slot_of is not None:
            order.sort(key=lambda i: slot_of(items[i].seq.lora_task_id))
            slots = [slot_of(items[i].seq.lora_task_id) for i in order]
        sampled = [items[i].seq for i in order if items[i].samples]
        return cls(order, slots, {seq: row for row, seq in enumerate(sampled)},
                   [row for row, seq in enumerate(sampled) if seq.params.return_generation_logits],
                   any(seq.params.reads_last_token or seq.matcher is not None for seq in sampled))


class KeptBatch:
    """The last step's batch, kept from step to step (a persistent batch): its block tables, and, where every
    sequence of it sampled, its LaunchRows. A step of those same sequences, decoding one token each (the steady
    state of decoding), is launched with them: the same order, adapter slots, sampled rows and greedy sampling plan;
    its block tables written where a sequence crossed into a new block; one read a row for its length and its token."""

    def __init__(self):
        self.tables = BlockTables()
        self.scheduled: list = []             # the last step's sequences in the scheduler's order, if each sampled
        self.rows: LaunchRows | None = None

    def take_if_steady(self, scheduled: list, items: list) -> LaunchRows | None:
        """The kept rows, if `items` (the scheduler's order; `scheduled` their sequences) are the last step's
        sequences, each decoding the token it sampled; else None. Either way they are kept no more (`keep` again
        once launched)."""
        rows, last, self.rows, self.scheduled = self.rows, self.scheduled, None, []
        steady = bool(last) and scheduled == last and all(item.num_new_tokens == 1 for item in items)
        return rows if steady else None

    def keep(self, scheduled: list, rows: LaunchRows) -> None:
        """A step launched: kept where each of its sequences sampled."""
        if len(rows.rows_of) == len(scheduled):
            self.scheduled, self.rows = scheduled, rows


class StepInputs:
    """The step's token ids, positions, cache slots and attention tables as host int32 tensors (`tensors`, sent
    to the device in one copy with the sampler's and LoRA's), and the host-side figures kernels launch with.
    Built with array operations over the batch: a step's host work does not grow with its context."""

    def __init__(self, batch: Batch, block_size: int, tables: BlockTables | None = None, steady: bool = False):
        """steady: the batch is the last one's sequences in the same order, each decoding the token it sampled
        (KeptBatch.take_if_steady), and `tables` were written for that batch."""
        tables = tables or BlockTables()
        self.pending: list[tuple[int, object]] = []             # (token row, sequence) whose id is still on the device
        self.pending_tokens: torch.Tensor | None = None        # the step before's sampled ids, on the device
        self.pending_maps: dict[str, torch.Tensor] = {}         # where they go: uploaded with the step's inputs
        self.context_chunks: list[tuple[int, int, int]] = []     # (item index, first position, number of rows)
        if steady:
            self._steady_decode([item.seq for item in batch.items], block_size, tables)
        else:
            self._any(batch, block_size, tables)

    def _steady_decode(self, seqs: list, block_size: int, tables: "BlockTables") -> None:
        """The sequences of the step before, each of which sampled, decode the token it sampled: kept tables
        written where a sequence crossed into a new block, no per-token work."""
        n = len(seqs)
        positions = np.fromiter([seq.num_computed_tokens for seq in seqs], dtype=np.int64, count=n)
        input_ids = [PENDING if seq.num_pending_tokens else seq.output_ids[-1] for seq in seqs]
        if PENDING in input_ids:
            self.pending = [(row, seqs[row]) for row, token in enumerate(input_ids) if token == PENDING]
        blocks, offsets = np.divmod(positions, block_size)
        block_tables = tables.rows_after_decode(seqs, np.flatnonzero(offsets == 0), blocks)
        rows = np.empty((3, -(-n // 4) * 4), dtype=np.int32)[:, :n]   # positions, slots, context lengths: each
        rows[0] = positions                                     # row 16 bytes aligned, as the kernels specialize
        rows[1] = block_tables[np.arange(n), blocks] * block_size + offsets
        rows[2] = rows[0] + 1
        arange = _arange(n + 1)
        self.query_starts, self.seq_lens, self.max_query_len = arange[1], rows[2].tolist(), 1
        self.tensors = {"input_ids": torch.from_numpy(np.array(input_ids, dtype=np.int32)),
                        "positions": torch.from_numpy(rows[0]), "slot_mapping": torch.from_numpy(rows[1]),
                        "query_starts": arange[0], "seq_lens": torch.from_numpy(rows[2]),
                        "block_tables": torch.from_numpy(block_tables), "logits_indices": arange[0][:n],
                        "context_indices": arange[0][:0]}

    def _any(self, batch: Batch, block_size: int, tables: "BlockTables") -> None:
        items, n = batch.items, len(batch.items)
        input_ids: list[int] = []
        counts: list[int] = []                                   # per item: new tokens, computed tokens, all tokens
        context_indices: list[int] = []
        for index, item in enumerate(items):
            seq, num_new = item.seq, item.num_new_tokens
            start, num_prompt, outputs = seq.num_computed_tokens, len(seq.prompt_ids), seq.output_ids
            end = start + num_new
            counts += (num_new, start, seq.num_tokens)
            if start >= num_prompt:
                input_ids += outputs[start - num_prompt:end - num_prompt]
                if end - num_prompt > len(outputs):          # its token from the step still on the device
                    assert num_new == 1, "only a decode feeds in a pending token"
                    self.pending.append((len(input_ids), seq))
                    input_ids.append(PENDING)
                continue
            input_ids += seq.prompt_ids[start:end]
            if end > num_prompt:
                input_ids += outputs[:end - num_prompt]
            if seq.params.return_context_logits and not outputs and seq.sequence_index == 0:
                first, num_rows = len(input_ids) - num_new, min(end, num_prompt) - start
                self.context_chunks.append((index, start, num_rows))
                context_indices += range(first, first + num_rows)
        num_new, starts, num_tokens = np.array(counts, dtype=np.int64).reshape(n, 3).T
        ends = starts + num_new
        query_starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_starts[1:])
        if len(input_ids) == n:                                  # one token each: decodes
            positions, token_rows = starts, np.arange(n)
        else:
            positions = np.arange(len(input_ids)) + np.repeat(starts - query_starts[:-1], num_new)
            token_rows = np.repeat(np.arange(n), num_new)
        block_tables = tables.rows([item.seq for item in items])
        slots = block_tables[token_rows, positions // block_size] * block_size + positions % block_size
        self._set(input_ids, positions, slots, query_starts, ends, block_tables,
                  query_starts[1:][num_tokens == ends] - 1, context_indices)

    def _set(self, input_ids: list[int], positions: np.ndarray, slots: np.ndarray, query_starts: np.ndarray,
             ends: np.ndarray, block_tables: np.ndarray, logits_indices: np.ndarray,
             context_indices: list[int]) -> None:
        self.query_starts = query_starts.tolist()
        self.seq_lens = ends.tolist()
        self.max_query_len = int((query_starts[1:] - query_starts[:-1]).max())
        arrays = {"input_ids": np.array(input_ids, dtype=np.int32), "positions": positions, "slot_mapping": slots,
                  "query_starts": query_starts, "seq_lens": ends, "block_tables": block_tables,
                  "logits_indices": logits_indices, "context_indices": np.array(context_indices, dtype=np.int32)}
        self.tensors = {name: torch.from_numpy(a.astype(np.int32, copy=False)) for name, a in arrays.items()}

    def take_pending(self, rows_of: dict, tokens: torch.Tensor) -> None:
        """Feed the pending tokens from the step before: rows_of maps its sequences to their rows of `tokens` (its
        sampled ids, on the device). The maps go up with the step's inputs (`pending_maps`); `fill_pending` puts the
        tokens into place on the device."""
        self.pending_tokens = tokens
        rows = [row for row, _ in self.pending]
        sources = [rows_of[seq] for _, seq in self.pending]
        if rows == sources == list(range(len(rows))):           # a steady decode batch: row i from row i, no maps
            return
        self.pending_maps = {"pending_rows": torch.tensor(rows, dtype=torch.int32),
                             "pending_from": torch.tensor(sources, dtype=torch.int32)}

    def fill_pending(self, t: dict[str, torch.Tensor]) -> None:
        """Semantics: t["input_ids"][pending_rows] = pending_tokens[pending_from], in stream order (no host sync);
        where the first k rows take the step before's first k tokens, one copy."""
        if not self.pending:
            return
        if not self.pending_maps:
            t["input_ids"][:len(self.pending)].copy_(self.pending_tokens[:len(self.pending)])
            return
        ids = self.pending_tokens.index_select(0, t["pending_from"].long()).to(t["input_ids"].dtype)
        t["input_ids"].index_copy_(0, t["pending_rows"].long(), ids)

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "StepInputs":
        """The inputs another rank built (`tensors` as sent to a tensor-parallel worker)."""
        inputs = cls.__new__(cls)
        inputs.tensors = tensors
        inputs.query_starts = tensors["query_starts"].tolist()
        inputs.seq_lens = tensors["seq_lens"].tolist()
        inputs.max_query_len = max(b - a for a, b in zip(inputs.query_starts, inputs.query_starts[1:]))
        inputs.context_chunks, inputs.pending, inputs.pending_maps = [], [], {}
        return inputs

    def context(self, t: dict[str, torch.Tensor]) -> StepContext:
        """The context over `t`: these tensors, or their device copies."""
        attn = AttentionMetadata(
            query_starts=t["query_starts"], seq_lens=t["seq_lens"], block_tables=t["block_tables"],
            slot_mapping=t["slot_mapping"], query_starts_list=self.query_starts, seq_lens_list=self.seq_lens,
            max_query_len=self.max_query_len, max_seq_len=max(self.seq_lens))
        return StepContext(t["input_ids"], t["positions"], attn, t["logits_indices"], t["context_indices"])

