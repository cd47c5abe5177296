"""The persistent batch: what a step keeps for the next one (the runner's KeptBatch).

A step of the last step's sequences, each decoding the token it sampled (the steady state of decoding), is launched
by updating what was kept in place: the launch order, adapter slots, sampled rows and greedy sampling plan as they
were; every row's position, cache slot and context length one further, in one array operation; a block-table row
written only where its sequence crossed into a new block. Any other step is built from scratch (StepInputs), and
kept in turn where each of its sequences sampled.
"""
import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from backend.sampler import SamplingPlan

ROW_INPUTS = ("input_ids", "positions", "slot_mapping", "seq_lens")    # a decode step's rows: one [4, n] array


@functools.lru_cache(maxsize=None)
def decode_constants(n: int) -> dict[str, torch.Tensor]:
    """The inputs every decode step of n rows shares (read only): one query a row, each row's logits."""
    arange = torch.arange(n + 1, dtype=torch.int32)
    return {"query_starts": arange, "logits_indices": arange[:n], "context_indices": arange[:0]}


class BlockTables:
    """The batch's block tables as one int32 array kept from step to step, a row per sequence of the last step: a
    row is written again only where its sequence changed or its table grew (tables grow by appends, or are replaced
    whole: backend/kv_cache.py), so a steady decode step writes the blocks its sequences crossed into, not 256 a
    sequence at 4k tokens of context."""

    def __init__(self):
        self.array = np.zeros((0, 16), dtype=np.int32)
        self.written: list[tuple[object, list, int]] = []     # by row: (sequence, its table, how much is written)
        self.width = 0                                         # the longest table of the last call's rows
        self.view: torch.Tensor | None = None                  # rows_after_decode's tensor over the array
        self.view_of: np.ndarray | None = None

    def rows(self, seqs: list) -> np.ndarray:
        """[num_seqs, longest table] int32, zero-padded."""
        longest = max(len(seq.block_table) for seq in seqs)
        if len(seqs) > self.array.shape[0] or longest > self.array.shape[1]:
            self.array = np.zeros((max(len(seqs), 2 * self.array.shape[0]), max(longest, 2 * self.array.shape[1])),
                                  dtype=np.int32)
            self.written = []
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
        self.width = longest
        return self.array[:len(seqs), :longest].copy()

    def rows_after_decode(self, seqs: list) -> tuple[list[int], torch.Tensor]:
        """`rows(seqs)` where seqs are the rows of the last call, in order, and have since decoded one token each: a
        table grew by one block where its sequence crossed into it, and only there -> (those rows, the rows as a
        tensor over the array: valid until the next call)."""
        written, n = self.written, len(seqs)
        grown = [row for row, (_, table, count) in enumerate(written[:n]) if len(table) != count]
        for row in grown:
            seq, table, count = written[row]
            if len(table) > self.array.shape[1]:
                return grown, torch.from_numpy(self.rows(seqs))
            self.array[row, count:len(table)] = table[count:]
            written[row] = (seq, table, len(table))
            self.width = max(self.width, len(table))
        if self.view is None or self.view.shape != (n, self.width) or self.view_of is not self.array:
            self.view, self.view_of = torch.from_numpy(self.array[:n, :self.width]), self.array
        return grown, self.view


@dataclass(slots=True)
class LaunchRows:
    """How a batch is launched: the scheduler's items in launch order (each adapter one segment), and its rows."""
    order: list[int]                          # the launch order, as indices into the scheduler's items
    slots: list[int]                          # each item's adapter slot, in launch order (none without adapters)
    rows_of: dict                             # each sampling sequence -> its row of the sampled tokens
    wanted: list[int]                         # the rows whose logits are sent back
    needs_last_tokens: bool                   # a row's next inputs need its token on the host (penalties, bad
                                              # words, top-p decay, a grammar)
    ends: list[int | None]                    # by row, where its tokens need nothing but appending: the token that
                                              # ends it (-1: none); else None (plain_end)
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
                   any(seq.params.reads_last_token or seq.matcher is not None for seq in sampled),
                   [plain_end(seq) for seq in sampled])


def plain_end(seq) -> int | None:
    """Where a sequence's next tokens need nothing but appending until one ends it (by its end id, or its length):
    that end id (-1: none). None where a token needs more: log probs or logits to return (the prompt's come with the
    first token), stop words, a grammar, top-p decay, min_tokens still to come."""
    p = seq.params
    if (p.return_log_probs or p.return_generation_logits or p.stop_words or seq.matcher is not None
            or p.top_p_decay != 1.0 or p.top_p_reset_id is not None or (p.return_context_logits and not seq.output_ids)
            or p.min_tokens > len(seq.output_ids)):
        return None
    return -1 if p.end_id is None or p.ignore_end_id else p.end_id


class KeptBatch:
    """The last step's batch where every sequence of it sampled: its sequences, LaunchRows and block tables, and
    by row the step inputs of its sampled token (`state`), which a steady step moves one token on."""

    def __init__(self):
        self.tables = BlockTables()
        self.items: list = []                 # the last step's scheduled items (the scheduler's order), if each sampled
        self.launch_items: list = []          # and in launch order
        self.rows: LaunchRows | None = None
        self.num_preemptions = 0              # the scheduler's count when they were kept (a preemption starts a
                                              # sequence over, with a new table, though it may run again at once)
        self.state = np.zeros((4, 0), dtype=np.int32)   # ROW_INPUTS of each row's sampled token
        self.views: dict[str, torch.Tensor] = {}          # state's ROW_INPUTS rows [:num_views] as tensors
        self.num_views = 0

    def take_if_steady(self, batch) -> tuple[LaunchRows, list] | None:
        """The kept rows and items in launch order, if the batch is the last step's sequences, each decoding the
        token it sampled; else None. Either way they are kept no more (`keep` again once launched)."""
        rows, last, self.rows, self.items = self.rows, self.items, None, []
        if not last or batch.num_preemptions != self.num_preemptions or len(batch.items) != len(last):
            return None
        if batch.items is last:               # (the scheduler hands out the same list while steady)
            return rows, self.launch_items
        if not all(item.num_new_tokens == 1 and item.seq is kept.seq for item, kept in zip(batch.items, last)):
            return None
        return rows, [batch.items[i] for i in rows.order]

    def keep(self, items: list, launch_items: list, rows: LaunchRows, inputs, num_preemptions: int) -> None:
        """A step launched (its scheduled items, and in launch order; its StepInputs `inputs`): kept where each of its
        sequences sampled."""
        if len(rows.rows_of) != len(items):
            return
        self.items, self.launch_items, self.rows, self.num_preemptions = items, launch_items, rows, num_preemptions
        if inputs.rows is not None:                            # a steady step: the state is its inputs already
            return
        n, t = len(launch_items), inputs.tensors
        state, last = self._state(n), t["logits_indices"].numpy()
        state[1, :n] = t["positions"].numpy()[last]
        state[2, :n] = t["slot_mapping"].numpy()[last]
        state[3, :n] = t["seq_lens"].numpy()

    def advance(self, seqs: list, input_ids: list[int], block_size: int) -> tuple[np.ndarray, torch.Tensor]:
        """A steady step's inputs: the kept rows (seqs) one token on, fed input_ids -> (ROW_INPUTS [4, n] int32,
        block tables [n, longest]). Both are views of what is kept, as are `tensors`: valid until the next step."""
        n, state = len(seqs), self.state
        state[1:, :n] += 1                                     # positions, slots, lengths
        crossed, tables = self.tables.rows_after_decode(seqs)  # (a table grows where its token starts a block)
        for row in crossed:
            state[2, row] = seqs[row].block_table[state[1, row] // block_size] * block_size
        state[0, :n] = input_ids
        return state[:, :n], tables

    def tensors(self, n: int) -> dict[str, torch.Tensor]:
        """ROW_INPUTS of the first n rows of the state as tensors over it, and the four as "row_inputs" [4, n rounded
        up to 4] (each row of its copy 16 bytes aligned, as the kernels specialize; made once for each n)."""
        if self.num_views != n:
            self.views = {name: torch.from_numpy(self.state[i, :n]) for i, name in enumerate(ROW_INPUTS)}
            self.views["row_inputs"] = torch.from_numpy(self.state[:, :-(-n // 4) * 4])
            self.num_views = n
        return self.views

    def _state(self, n: int) -> np.ndarray:
        if n > self.state.shape[1]:
            self.state = np.zeros((4, max(-(-n // 4) * 4, 2 * self.state.shape[1])), dtype=np.int32)   # rows 16
            self.num_views = 0                                                                        # bytes aligned
        return self.state
