"""Per-step batch metadata, built once per step on the host from the scheduled batch and shared by every layer."""
import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from backend.core.scheduler import Batch
from backend.model.batch import BlockTables, PersistentBatch, row_views
from kernels.metadata import AttentionMetadata

PENDING = -1                                  # a token id the host does not have yet (overlapped steps)


@functools.lru_cache(maxsize=None)
def _arange(n: int) -> list[int]:
    """0..n-1 (shared by the steps of n rows: read only)."""
    return list(range(n))


@dataclass(slots=True)
class StepContext:
    input_ids: torch.Tensor                   # [num_tokens] int32, packed, no padding
    positions: torch.Tensor                   # [num_tokens] int32
    attn: AttentionMetadata
    logits_indices: torch.Tensor              # [num_sampled] int32: last token of each sequence that samples
    context_indices: torch.Tensor             # [num_context] int32: prompt tokens whose logits were asked for
    lora: object | None = None                # the step's LoRA executor (kernels/lora/executor.py)
    prompt_scores: object | None = None       # prompt rows to score (backend/core/logprobs.PromptScores)
    between_layers: Callable[[], None] | None = None      # called after each layer (CPU: backend/openmp.TeamSizer)


class StepInputs:
    """The step's token ids, positions, cache slots and attention tables as host int32 tensors (`tensors`, sent
    to the device in one copy with the sampler's and LoRA's), and the host-side figures kernels launch with.
    Built with array operations over the batch: a step's host work does not grow with its context."""

    def __init__(self, batch: Batch, block_size: int, persistent: PersistentBatch | None = None,
                 rope_rows: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None):
        """persistent: the runner's persistent batch, brought to this batch (PersistentBatch.update): where every
        row decodes the token it sampled, its state moved one token on is the step's inputs; any other step takes its
        block tables. rope_rows(positions, prompt lengths): the rotary table's row of each token, where it is not
        its position (backend/model/rope.rows: a decoding step's tokens are generated ones, whose row is their
        position)."""
        self.pending: list[tuple[int, object]] = []             # (token row, sequence) whose id is still on the device
        self.pending_tokens: torch.Tensor | None = None        # the step before's sampled ids, on the device
        self.pending_maps: dict[str, torch.Tensor] = {}         # where they go: uploaded with the step's inputs
        self.context_chunks: list[tuple[int, int, int]] = []     # (item index, first position, number of rows)
        self.prompt_chunks: list[tuple[int, int, int]] = []      # the same, of prompt rows to score (log probs)
        self.scored: dict[str, torch.Tensor] = {}               # their token rows and next prompt tokens (rank 0's)
        self.score_k = 0                                         # top alternatives the step returns for them
        self.scores = None                                       # and on the device (PromptScores, the runner's)
        self.rows: np.ndarray | None = None                     # a decoding step's ROW_INPUTS [4, n] (batch.py)
        self.row_inputs: torch.Tensor | None = None             # and as the persistent buffer's [4, C]
        self.sent: dict[str, torch.Tensor] = {}                 # what goes to the device: `tensors`, or a decoding
                                                                # step's persistent buffer as it lies (`received`)
        if persistent is not None and persistent.decodes:
            self._decode(batch, block_size, persistent)
        else:
            self._any(batch, block_size, persistent.tables if persistent is not None else BlockTables(), rope_rows)

    def _decode(self, batch: Batch, block_size: int, persistent: PersistentBatch) -> None:
        """Every row decodes the token it sampled: the rows' state one token on."""
        seqs, input_ids = persistent.seqs, None
        n = len(seqs)
        if not persistent.steady:
            input_ids = [PENDING if seq.num_pending_tokens else seq.output_ids[-1] for seq in seqs]
            self.pending = [(row, seq) for row, seq in enumerate(seqs) if seq.num_pending_tokens]
        elif seqs[0].num_pending_tokens:    # the step before is in flight: every row's token is still on the device
            self.pending = list(enumerate(seqs))
        else:
            input_ids = [seq.output_ids[-1] for seq in seqs]
        self.rows = persistent.advance(input_ids, block_size, batch.grown)
        self.query_starts, self.seq_lens, self.max_query_len = _arange(n + 1), self.rows[3].tolist(), 1
        self.tensors, self.row_inputs, sent = persistent.tensors(n)
        self.sent, self.persistent = {"rows": sent}, persistent

    def _any(self, batch: Batch, block_size: int, tables: "BlockTables", rope_rows=None) -> None:
        items, n = batch.items, len(batch.items)
        input_ids: list[int] = []
        counts: list[int] = []                                   # per item: new tokens, computed tokens, all tokens
        context_indices: list[int] = []
        score_rows: list[int] = []
        score_targets: list[int] = []
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
            if seq.params.return_prompt_log_probs and not outputs and seq.sequence_index == 0 \
                    and min(end, num_prompt - 1) > start:          # positions 0..P-2: each scores the next token
                first, num_rows = len(input_ids) - num_new, min(end, num_prompt - 1) - start
                self.prompt_chunks.append((index, start, num_rows))
                score_rows += range(first, first + num_rows)
                score_targets += seq.prompt_ids[start + 1:start + 1 + num_rows]
                self.score_k = max(self.score_k, seq.params.top_log_probs)
        if score_rows:
            self.scored = {"score_rows": torch.tensor(score_rows, dtype=torch.int32),
                           "score_targets": torch.tensor(score_targets, dtype=torch.int32)}
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
        if rope_rows is not None:
            positions = rope_rows(positions, np.array([len(item.seq.prompt_ids) for item in items])[token_rows])
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
        self.sent = self.tensors

    @property
    def runs_eager(self) -> bool:
        """Rows past the sampled ones want logits (context logits, prompt log probs): no graph computes them."""
        return bool(self.context_chunks or self.prompt_chunks)

    def received(self, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The step's tensors by name, from what the upload of `sent` gave back (the same tensors on CPU)."""
        if self.rows is None:
            return t
        sent = t["rows"]
        if sent is self.sent["rows"]:                            # not moved
            return t | self.tensors | {"row_inputs": self.row_inputs}
        layout = (len(self.seq_lens), self.row_inputs.shape[1], self.tensors["block_tables"].shape[1])
        landed = self.persistent.landed                          # (the device copy lands in the same buffer while
        if landed is None or landed[0] is not sent or landed[1] != layout:     # its size repeats: StepStaging)
            views, state = row_views(sent, *layout)
            landed = self.persistent.landed = (sent, layout, views | {"row_inputs": state})
        return t | landed[2]

    def take_pending(self, rows_of: dict, tokens: torch.Tensor) -> None:
        """Feed the pending tokens from the step before: rows_of maps its sequences to their rows of `tokens` (its
        sampled ids, on the device). The maps go up with the step's inputs (`pending_maps`); `fill_pending` puts the
        tokens into place on the device."""
        self.pending_tokens = tokens
        rows = [row for row, _ in self.pending]
        sources = [rows_of[seq] for _, seq in self.pending]
        if rows == sources == list(range(len(rows))):           # a steady batch: row i from row i, no maps
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
        inputs.context_chunks, inputs.pending, inputs.pending_maps, inputs.rows = [], [], {}, None
        inputs.prompt_chunks, inputs.scored, inputs.score_k, inputs.scores = [], {}, 0, None
        inputs.sent = tensors
        return inputs

    def context(self, t: dict[str, torch.Tensor]) -> StepContext:
        """The context over `t`: these tensors, or their device copies. A decoding step's is kept with the persistent
        batch while its views are the same ones (PersistentBatch.tensors, StepInputs.received): only the lengths are
        set anew, and what a step adds to it (the torch kernels' plan, the adapters, the OpenMP checkpoint) is
        cleared."""
        decoding = self.rows is not None
        if decoding and self.persistent.context is not None and self.persistent.context.input_ids is t["input_ids"]:
            ctx = self.persistent.context
            ctx.attn.seq_lens_list, ctx.attn.max_seq_len, ctx.attn.torch_plan = self.seq_lens, max(self.seq_lens), None
            ctx.lora = ctx.between_layers = None
            return ctx
        attn = AttentionMetadata(
            query_starts=t["query_starts"], seq_lens=t["seq_lens"], block_tables=t["block_tables"],
            slot_mapping=t["slot_mapping"], query_starts_list=self.query_starts, seq_lens_list=self.seq_lens,
            max_query_len=self.max_query_len, max_seq_len=max(self.seq_lens))
        ctx = StepContext(t["input_ids"], t["positions"], attn, t["logits_indices"], t["context_indices"])
        if decoding:
            self.persistent.context = ctx
        return ctx

