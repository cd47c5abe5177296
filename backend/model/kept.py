"""The persistent batch: what a step keeps for the next one (the runner's KeptBatch).

A step of the last step's sequences, each decoding the token it sampled (the steady state of decoding), is launched
by updating what was kept in place: the launch order, adapter slots, sampled rows and greedy sampling plan as they
were; every row's position, cache slot and context length one further, in one array operation; a block-table row
written only where its sequence crossed into a new block. Any other step is built from scratch (StepInputs), and
kept in turn where each of its sequences sampled.
"""
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from backend.core.sampler import SamplingPlan

ROW_INPUTS = ("input_ids", "positions", "slot_mapping", "seq_lens")    # a decode step's rows: one [4, n] array
PADDING = np.array([0, 0, -1, 0], dtype=np.int32)     # ROW_INPUTS of a padding row: token 0 at position 0, cache slot
                                                      # -1 (nothing written), an empty context (nothing read)


class BlockTables:
    """The batch's block tables as one int32 array kept from step to step, a row per sequence of the last step: a
    row is written again only where its sequence changed or its table grew (tables grow by appends, or are replaced
    whole: backend/core/kv_cache.py), so a steady decode step writes the blocks its sequences crossed into, not 256 a
    sequence at 4k tokens of context. allocate(rows, width): a zeroed int32 array of at least that shape (the kept
    batch lays it out in its buffer)."""

    def __init__(self, allocate: Callable[[int, int], np.ndarray] | None = None):
        self.allocate = allocate or (lambda rows, width: np.zeros((rows, width), dtype=np.int32))
        self.array = self.allocate(0, 16)
        self.written: list[tuple[object, list, int]] = []     # by row: (sequence, its table, how much is written)
        self.width = 0                                         # the longest table of the last call's rows

    def rows(self, seqs: list) -> np.ndarray:
        """[num_seqs, longest table] int32, zero-padded."""
        longest, (num_rows, width) = max(len(seq.block_table) for seq in seqs), self.array.shape
        if len(seqs) > num_rows or longest > width:              # the dimension short of room doubles
            self.array = self.allocate(num_rows if len(seqs) <= num_rows else max(len(seqs), 2 * num_rows),
                                       width if longest <= width else max(longest, 2 * width))
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

    def rows_after_decode(self, seqs: list, grown: list[int] | None = None) -> list[int]:
        """`rows(seqs)` written in place, where seqs are the rows of the last call, in order, and have since decoded
        one token each: a table grew by one block where its sequence crossed into it, and only there (in the rows
        `grown`, where the caller knows them) -> those rows (the tables: `array[:len(seqs), :width]`)."""
        written, n = self.written, len(seqs)
        if grown is None:
            grown = [row for row, (_, table, count) in enumerate(written[:n]) if len(table) != count]
        for row in grown:
            seq, table, count = written[row]
            if len(table) > self.array.shape[1]:
                self.rows(seqs)
                return grown
            self.array[row, count:len(table)] = table[count:]
            written[row] = (seq, table, len(table))
            self.width = max(self.width, len(table))
        return grown


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
    any_adapter: bool = False                 # an item runs with an adapter

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
                   [plain_end(seq) for seq in sampled], any_adapter=any(slot >= 0 for slot in slots))


def plain_end(seq) -> int | None:
    """Where a sequence's next tokens need nothing but appending until one ends it (by its end id, or its length):
    that end id (-1: none). None where a token needs more: log probs or logits to return (the prompt's come with the
    first token), stop words, a grammar, top-p decay, min_tokens still to come."""
    p = seq.params
    if (p.any_log_probs or p.beam_width > 1 or p.return_generation_logits or p.stop_words or seq.matcher is not None
            or p.top_p_decay != 1.0 or p.top_p_reset_id is not None
            or (p.reads_prompt_logits and not seq.output_ids)
            or p.min_tokens > len(seq.output_ids)):
        return None
    return -1 if p.end_id is None or p.ignore_end_id else p.end_id


class KeptBatch:
    """The last step's batch where every sequence of it sampled: its sequences, LaunchRows and block tables, and
    by row the step inputs of its sampled token (`state`), which a steady step moves one token on.

    The state, the decode steps' constant arange and the block tables lie in one int32 buffer, in the layout a
    device reads them: [4, C] ROW_INPUTS (C columns, a multiple of 4: each row 16 bytes aligned; columns past the
    batch hold padding rows, as a decode graph wants them), [C + 4] 0, 1, 2, ... (query starts, logits indices),
    [C, W] block tables. A steady step sends its first rows as they lie: one copy, nothing packed or padded."""

    def __init__(self, capacity: int = 4):
        self.capacity = 0                     # C
        self.buffer = np.zeros(0, dtype=np.int32)
        self.state = np.zeros((4, 0), dtype=np.int32)
        self.tables = BlockTables(self._lay_out)
        self.tables.array = self._lay_out(capacity, self.tables.array.shape[1])
        self.items: list = []                 # the last step's scheduled items (the scheduler's order), if each sampled
        self.launch_items: list = []          # and in launch order
        self.rows: LaunchRows | None = None
        self.seqs: list = []                  # the kept rows' sequences, and each one's row (kept until replaced)
        self.row_of: dict = {}
        self.num_preemptions = 0              # the scheduler's count when they were kept (a preemption starts a
                                              # sequence over, with a new table, though it may run again at once)
        self.views: tuple = ()                # `tensors` of the last (rows, table width)
        self.views_of: tuple[int, int] | None = None
        self.landed: tuple | None = None      # the same views of the device copy: (it, its layout, them)
        self.context = None                   # the StepContext over the last steady step's views (StepInputs.context)

    def _lay_out(self, num_rows: int, width: int) -> np.ndarray:
        """A buffer for num_rows rows (at least) of block tables width wide, holding the last one's state and tables
        -> its tables [C, width]."""
        old_state, old_tables = self.state, getattr(self, "tables", None)        # (none yet: BlockTables' first)
        cap = max(-(-num_rows // 4) * 4, self.capacity)
        self.buffer = np.zeros(5 * cap + 4 + cap * width, dtype=np.int32)
        self.state = self.buffer[:4 * cap].reshape(4, cap)
        self.state[:] = PADDING[:, None]
        self.state[:, :old_state.shape[1]] = old_state
        self.buffer[4 * cap:5 * cap + 4] = np.arange(cap + 4, dtype=np.int32)
        tables = self.buffer[5 * cap + 4:].reshape(cap, width)
        if old_tables is not None:
            old = old_tables.array
            tables[:old.shape[0], :old.shape[1]] = old
        self.capacity, self.views_of = cap, None
        return tables

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

    def drop(self) -> None:
        """The next step is built from scratch (block tables were replaced: beams took others' places)."""
        self.rows, self.items = None, []

    def keep(self, items: list, launch_items: list, rows: LaunchRows, inputs, num_preemptions: int) -> None:
        """A step launched (its scheduled items, and in launch order; its StepInputs `inputs`): kept where each of its
        sequences sampled."""
        if len(rows.rows_of) != len(items):
            return
        self.items, self.launch_items, self.rows, self.num_preemptions = items, launch_items, rows, num_preemptions
        if inputs.rows is not None:                            # a steady step: the state is its inputs already
            return
        self.seqs, self.row_of = [item.seq for item in launch_items], rows.rows_of
        n, t = len(launch_items), inputs.tensors
        if n > self.capacity:
            self.tables.array = self._lay_out(n, self.tables.array.shape[1])
        state, last = self.state, t["logits_indices"].numpy()
        state[1, :n] = t["positions"].numpy()[last]
        state[2, :n] = t["slot_mapping"].numpy()[last]
        state[3, :n] = t["seq_lens"].numpy()
        state[:, n:] = PADDING[:, None]

    def advance(self, input_ids: list[int] | None, block_size: int, grown: list | None) -> np.ndarray:
        """A steady step's inputs: the kept rows (`seqs`) one token on, fed input_ids (None: they are still on the
        device, a step ahead) -> ROW_INPUTS [4, n] int32, a view of the state (as `tensors` are: valid until the next
        step). grown: the sequences given a block since the kept step, where the scheduler knows them."""
        seqs, row_of, state = self.seqs, self.row_of, self.state
        n = len(seqs)
        state[1:, :n] += 1                                     # positions, slots, lengths
        crossed = self.tables.rows_after_decode(seqs, None if grown is None else [row_of[seq] for seq in grown])
        state = self.state                                     # (laid out anew where a table outgrew the buffer)
        for row in crossed:
            state[2, row] = seqs[row].block_table[state[1, row] // block_size] * block_size
        if input_ids is not None:
            state[0, :n] = input_ids
        return state[:, :n]

    def tensors(self, n: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """The first n rows as a decode step's tensors, views of the buffer: ROW_INPUTS, block tables, query starts
        and logits indices (one query a row, each row's logits) -> (them, the ROW_INPUTS [4, C], the buffer up to
        the n-th table row: all of it a step sends; StepInputs.received takes the same views of its copy). Made once
        for each (n, width)."""
        if self.views_of != (n, self.tables.width):
            sent = torch.from_numpy(self.buffer[:5 * self.capacity + 4 + n * self.tables.array.shape[1]])
            views, state = kept_views(sent, n, self.capacity, self.tables.width)
            self.views, self.views_of = (views, state, sent), (n, self.tables.width)
        return self.views


def kept_views(sent: torch.Tensor, n: int, cap: int, width: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A steady step's buffer as sent (KeptBatch.tensors' "kept", or its copy on the device) -> (the step's tensors
    as views of it: ROW_INPUTS, the decode constants, the block tables [n, width]; ROW_INPUTS [4, C])."""
    state, arange, tables = sent[:4 * cap].view(4, cap), sent[4 * cap:5 * cap + 4], sent[5 * cap + 4:]
    views = {name: state[i, :n] for i, name in enumerate(ROW_INPUTS)}
    return views | {"query_starts": arange[:n + 1], "logits_indices": arange[:n], "context_indices": arange[:0],
                    "block_tables": tables.view(n, -1)[:, :width]}, state
