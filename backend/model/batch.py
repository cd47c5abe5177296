"""The persistent batch: the rows a step runs, kept from step to step and changed by explicit removes and adds (the
runner's PersistentBatch; vLLM's InputBatch is the model).

A row per sequence of the step, in launch order: by adapter slot, so that each adapter is one segment. By row: the
sequence, its adapter slot, its block table and the step inputs of its last token (`state`: id, position, cache slot,
context length). Each step brings the rows to its batch: the rows of sequences that do not continue where their row
left them (ended, waiting, preempted, given another table) are removed, its new sequences added at the end of their
adapter's segment; the rows that stay keep their place, their state and their written tables. Then one builder
(backend/model/context.py StepInputs): a step where every row decodes the token it sampled moves the state one token
on in place (one array add, the ids written, a slot and a table row written where a sequence crossed into a block,
the added rows' state from their sequences) and sends it as it lies; a step with prompt chunks lays its tokens out
from the rows, and the state takes each row's last token.
"""
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from backend.core.sampler import SamplingPlan

ROW_INPUTS = ("input_ids", "positions", "slot_mapping", "seq_lens")    # a decode step's rows: one [4, n] array
PADDING = np.array([0, 0, -1, 0], dtype=np.int32)     # ROW_INPUTS of a padding row: token 0 at position 0, cache slot
                                                      # -1 (nothing written), an empty context (nothing read)
UNWRITTEN = (None, None, 0)                           # BlockTables.written of a row whose table is not there yet


class BlockTables:
    """The batch's block tables as one int32 array kept from step to step, a row per sequence of the last step: a
    row is written again only where its sequence changed or its table grew (tables grow by appends, or are replaced
    whole: backend/core/kv_cache.py), so a decode step writes the blocks its sequences crossed into, not 256 a
    sequence at 4k tokens of context; rows that change places take what was written with them (`move`).
    allocate(rows, width): a zeroed int32 array of at least that shape (the persistent batch lays it out in its
    buffer)."""

    def __init__(self, allocate: Callable[[int, int], np.ndarray] | None = None):
        self.allocate = allocate or (lambda rows, width: np.zeros((rows, width), dtype=np.int32))
        self.array = self.allocate(0, 16)
        self.written: list[tuple[object, list, int]] = []     # by row: (sequence, its table, how much is written)
        self.width = 0                                         # the longest table of the last call's rows

    def rows(self, seqs: list) -> np.ndarray:
        """[num_seqs, longest table] int32, zero-padded."""
        self.make_room(len(seqs), max(len(seq.block_table) for seq in seqs))
        self.write(seqs)
        return self.array[:len(seqs), :self.width].copy()

    def write(self, seqs: list) -> list[int]:
        """Each row's table written where it is not yet: a row whose sequence and table are the ones written gets
        the blocks appended since, any other its whole table -> the rows written (the array holds the longest)."""
        written, changed = self.written, []
        for i, seq in enumerate(seqs):
            table = seq.block_table
            if i < len(written) and written[i][0] is seq and written[i][1] is table:
                count = written[i][2]
                if len(table) == count:
                    continue
                if len(table) > count:                         # grown by appends
                    self.array[i, count:len(table)] = table[count:]
                    written[i] = (seq, table, len(table))
                    changed.append(i)
                    continue
            row = self.array[i]
            row[:len(table)] = table
            row[len(table):] = 0
            if i < len(written):
                written[i] = (seq, table, len(table))
            else:
                written.append((seq, table, len(table)))
            changed.append(i)
        return changed

    def make_room(self, num_rows: int, longest: int) -> None:
        """An array of at least num_rows rows and longest columns (the width of the rows: `width`), holding what was
        written; the dimension short of room doubles."""
        old = self.array
        rows, width = old.shape
        if num_rows > rows or longest > width:
            self.array = self.allocate(rows if num_rows <= rows else max(num_rows, 2 * rows),
                                       width if longest <= width else max(longest, 2 * width))
            self.array[:rows, :width] = old
        self.width = longest

    def move(self, sources: list[int]) -> None:
        """The rows in their new places: row i is the old row sources[i] (-1: a new row, nothing written yet)."""
        written = self.written
        taken = [(i, s) for i, s in enumerate(sources) if 0 <= s < len(written)]
        old = self.array[:len(written)].copy()
        self.make_room(len(sources), self.width)
        self.written = [UNWRITTEN] * len(sources)
        for i, s in taken:
            self.written[i] = written[s]
        if taken:
            to, source = zip(*taken)
            self.array[list(to)] = old[list(source)]

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
    """A step's rows as its results are read: each row's adapter slot (in launch order), and of the rows that sample
    (their sequences' next tokens) what reading them needs."""
    slots: list[int]                          # each row's adapter slot, in launch order (-1: none)
    rows_of: dict                             # each sampling sequence -> its row of the sampled tokens
    wanted: list[int]                         # the rows whose logits are sent back
    needs_last_tokens: bool                   # a row's next inputs need its token on the host (penalties, bad
                                              # words, top-p decay, a grammar)
    ends: list[int | None]                    # by row, where its tokens need nothing but appending: the token that
                                              # ends it (-1: none); else None (plain_end)
    plan: SamplingPlan | None = None          # the sampling plan, kept where it serves every step (reusable)
    any_adapter: bool = False                 # a row runs with an adapter


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


class PersistentBatch:
    """The rows of the step, from step to step (see above). `update` brings them to a step's batch and says how the
    step is built: `steady` (the scheduler handed out the last step's batch again: the same rows, each decoding the
    token it sampled; its LaunchRows and sampling plan serve again) and `decodes` (every row decodes the token it
    sampled: the state moves on, `advance`); `record` takes a step's last tokens where it was built otherwise.

    The state, the decode steps' constant arange and the block tables lie in one int32 buffer, in the layout a
    device reads them: [4, C] ROW_INPUTS (C columns, a multiple of 4: each row 16 bytes aligned; columns past the
    batch hold padding rows, as a decode graph wants them), [C + 4] 0, 1, 2, ... (query starts, logits indices),
    [C, W] block tables. A decoding step sends its first rows as they lie: one copy, nothing packed or padded."""

    def __init__(self, capacity: int = 4):
        self.capacity = 0                     # C
        self.buffer = np.zeros(0, dtype=np.int32)
        self.state = np.zeros((4, 0), dtype=np.int32)
        self.tables = BlockTables(self._lay_out)
        self.tables.array = self._lay_out(capacity, self.tables.array.shape[1])
        self.seqs: list = []                  # by row, in launch order: the sequence
        self.slots: list[int] = []            # its adapter slot (-1: none)
        self.ends: list[int | None] = []      # where its tokens need nothing but appending, the token that ends it
                                              # (plain_end; a None looked at again each time the rows change)
        self.reads: list[bool] = []           # its next inputs need its token on the host (LaunchRows)
        self.wants: list[bool] = []           # its logits are sent back
        self.row_of: dict = {}                # each sequence's row
        self.added: list[int] = []            # the rows added by this step's update (their state is not theirs yet)
        self.scheduled: list | None = None    # the scheduler's items of the last step (the same list: steady)
        self.items: list = []                 # and in launch order
        self.rows: LaunchRows | None = None   # the last step's
        self.num_preemptions = 0              # the scheduler's count at the last step
        self.steady = self.decodes = False    # how this step is built (`update`)
        self.views: tuple = ()                # `tensors` of the last (rows, table width)
        self.views_of: tuple[int, int] | None = None
        self.landed: tuple | None = None      # the same views of the device copy: (it, its layout, them)
        self.context = None                   # the StepContext over the last decoding step's views (StepInputs.context)

    def _lay_out(self, num_rows: int, width: int) -> np.ndarray:
        """A buffer for num_rows rows (at least) of block tables width wide, holding the last one's state -> its
        tables [C, width] (BlockTables copies its rows in)."""
        old_state = self.state
        cap = max(-(-num_rows // 4) * 4, self.capacity)
        self.buffer = np.zeros(5 * cap + 4 + cap * width, dtype=np.int32)
        self.state = self.buffer[:4 * cap].reshape(4, cap)
        self.state[:] = PADDING[:, None]
        self.state[:, :old_state.shape[1]] = old_state
        self.buffer[4 * cap:5 * cap + 4] = np.arange(cap + 4, dtype=np.int32)
        self.capacity, self.views_of = cap, None
        return self.buffer[5 * cap + 4:].reshape(cap, width)

    def update(self, batch, slot_of: Callable[[int | None], int] | None) -> LaunchRows:
        """Bring the rows to `batch`: remove those whose sequence does not continue where its row left it, add its new
        sequences at the end of their adapter's segment (slot_of: an adapter's slot; None: no adapters); batch.items
        into launch order -> the step's LaunchRows."""
        if batch.items is self.scheduled and batch.num_preemptions == self.num_preemptions:
            batch.items, self.added, self.steady, self.decodes = self.items, [], True, True
            return self.rows
        item_of = {item.seq: item for item in batch.items}
        lens, written = self.state[3, :len(self.seqs)].tolist(), self.tables.written
        stay = [row for row, seq in enumerate(self.seqs)
                if seq in item_of and row < len(written) and written[row][1] is seq.block_table
                and lens[row] == seq.num_computed_tokens]
        staying = {self.seqs[row] for row in stay}
        new = [item.seq for item in batch.items if item.seq not in staying]
        if len(stay) < len(self.seqs) or new:
            seqs = self.seqs
            columns = [[seqs[row] for row in stay], [self.slots[row] for row in stay],
                       [self.ends[row] if self.ends[row] is not None else plain_end(seqs[row]) for row in stay],
                       [self.reads[row] for row in stay], [self.wants[row] for row in stay], stay + [-1] * len(new)]
            if new:                                                   # each at the end of its adapter's segment
                for column, values in zip(columns, (new, [slot_of(seq.lora_task_id) if slot_of else -1 for seq in new],
                                                    [plain_end(seq) for seq in new],
                                                    [seq.params.reads_last_token or seq.matcher is not None
                                                     for seq in new],
                                                    [seq.params.return_generation_logits for seq in new])):
                    column += values
                order = sorted(range(len(columns[0])), key=columns[1].__getitem__)   # stable: the rows that stay
                columns = [[column[i] for i in order] for column in columns]          # keep their order
            self._move(columns.pop())
            self.seqs, self.slots, self.ends, self.reads, self.wants = columns
            self.row_of = {seq: row for row, seq in enumerate(self.seqs)}
        else:
            self.added = []
        self.scheduled, self.num_preemptions, self.steady = batch.items, batch.num_preemptions, False
        self.items = batch.items = [item_of[seq] for seq in self.seqs]
        self.decodes = all(item.num_new_tokens == 1 and item.samples
                           and item.seq.num_computed_tokens >= len(item.seq.prompt_ids) for item in self.items)
        self.rows = self._launch_rows()
        return self.rows

    def _launch_rows(self) -> LaunchRows:
        """The step's LaunchRows, from the rows' columns."""
        items, slots = self.items, self.slots
        if self.decodes or all(item.samples for item in items):
            sampled, rows_of = range(len(items)), self.row_of
        else:
            sampled = [row for row, item in enumerate(items) if item.samples]
            rows_of = {self.seqs[row]: i for i, row in enumerate(sampled)}
        wants, reads, ends = self.wants, self.reads, self.ends
        return LaunchRows(slots, rows_of, [i for i, row in enumerate(sampled) if wants[row]],
                          any(reads[row] for row in sampled), [ends[row] for row in sampled],
                          any_adapter=any(slot >= 0 for slot in slots))

    def _move(self, sources: list[int]) -> None:
        """The rows in their new places: row i is the old row sources[i] (-1: added); padding rows past them."""
        n, old = len(sources), self.state[:, :len(self.seqs)].copy()
        self.tables.move(sources)                              # (laying out a bigger buffer where n needs one)
        self.added = [row for row, source in enumerate(sources) if source < 0]
        state = self.state
        taken = [row for row, source in enumerate(sources) if source >= 0]
        state[:, taken] = old[:, [sources[row] for row in taken]]
        state[:, self.added] = PADDING[:, None]
        state[:, n:] = PADDING[:, None]

    def drop(self) -> None:
        """Forget every row: the next step adds its sequences anew (tables were replaced: beams took others' places,
        or a step failed part-way)."""
        self.seqs, self.slots, self.ends, self.reads, self.wants = [], [], [], [], []
        self.row_of, self.scheduled, self.rows = {}, None, None
        self.tables.written = []
        self.state[:] = PADDING[:, None]

    def advance(self, input_ids: list[int] | None, block_size: int, grown: list | None) -> np.ndarray:
        """A decoding step's inputs: each row one token on from its state (an added row's from its sequence), fed
        input_ids (None: they are still on the device, a step ahead) -> ROW_INPUTS [4, n] int32, a view of the state
        (as `tensors` are: valid until the next step). grown: on a steady step, the sequences given a block since the
        last (the scheduler's Batch.grown)."""
        seqs, n = self.seqs, len(self.seqs)
        if self.steady:
            grown_rows = None if grown is None else [self.row_of[seq] for seq in grown]
            crossed = self.tables.rows_after_decode(seqs, grown_rows)
        else:
            self.tables.make_room(n, max(len(seq.block_table) for seq in seqs))
            self.tables.write(seqs)
        state = self.state                                     # (laid out anew where a table outgrew the buffer)
        state[1:, :n] += 1                                     # positions, slots, lengths
        if not self.steady:                                    # the added rows from their sequences; a slot from
            for row in self.added:                             # the table where a row starts a block
                state[1, row] = seqs[row].num_computed_tokens
            state[3, self.added] = state[1, self.added] + 1
            crossed = np.flatnonzero(state[1, :n] % block_size == 0).tolist() + self.added
        for row in crossed:
            position = int(state[1, row])
            state[2, row] = seqs[row].block_table[position // block_size] * block_size + position % block_size
        if input_ids is not None:
            state[0, :n] = input_ids
        return state[:, :n]

    def record(self, inputs) -> None:
        """A step launched (its StepInputs): the state takes each row's last token, where the step was not built
        from it."""
        self.added = []
        if inputs.rows is not None:                            # a decoding step: the state is its inputs already
            return
        n, t = len(self.seqs), inputs.tensors
        ends = t["seq_lens"].numpy()
        state = self.state
        state[1, :n] = ends - 1
        state[2, :n] = t["slot_mapping"].numpy()[t["query_starts"].numpy()[1:] - 1]
        state[3, :n] = ends

    def tensors(self, n: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """The first n rows as a decode step's tensors, views of the buffer: ROW_INPUTS, block tables, query starts
        and logits indices (one query a row, each row's logits) -> (them, the ROW_INPUTS [4, C], the buffer up to
        the n-th table row: all of it a step sends; StepInputs.received takes the same views of its copy). Made once
        for each (n, width)."""
        if self.views_of != (n, self.tables.width):
            sent = torch.from_numpy(self.buffer[:5 * self.capacity + 4 + n * self.tables.array.shape[1]])
            views, state = row_views(sent, n, self.capacity, self.tables.width)
            self.views, self.views_of = (views, state, sent), (n, self.tables.width)
        return self.views


def row_views(sent: torch.Tensor, n: int, cap: int, width: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A decoding step's buffer as sent (PersistentBatch.tensors' "rows", or its copy on the device) -> (the step's
    tensors as views of it: ROW_INPUTS, the decode constants, the block tables [n, width]; ROW_INPUTS [4, C])."""
    state, arange, tables = sent[:4 * cap].view(4, cap), sent[4 * cap:5 * cap + 4], sent[5 * cap + 4:]
    views = {name: state[i, :n] for i, name in enumerate(ROW_INPUTS)}
    return views | {"query_starts": arange[:n + 1], "logits_indices": arange[:n], "context_indices": arange[:0],
                    "block_tables": tables.view(n, -1)[:, :width]}, state
