"""CUDA graphs of decode steps: one per batch-size bucket (1, 2, 4, ... max_num_seqs), with and without adapters,
captured at start over fixed device buffers and replayed for every step whose sequences all decode one token. Each
graph takes the greedy tokens too (the argmax of its logits): a greedy step launches no sampling of its own.

A step of n sequences runs the graph of the smallest bucket B >= n: its inputs are padded to B rows (token 0 at
position 0, cache slot -1 so nothing is written, an empty context so nothing is read) and copied into the buffers;
the logits of the first n rows come out. Everything a kernel launch depends on is fixed per bucket: the grids, the
attention's split count and the LoRA segment count (max_loras + 2: base rows, one per adapter slot, padding). Each
bucket has a graph per context class (CONTEXT_CLASSES), whose split count suits the longest context it holds.
Steps with prompt chunks go to the piecewise graphs (backend/model/piecewise.py) or run eagerly. capture=False
runs the same padded steps eagerly: how the CPU tests check everything but the capture itself.
"""
import numpy as np
import torch

from backend.core.sampler import greedy
from backend.model.context import StepContext, StepInputs
from backend.model.batch import PADDING, ROW_INPUTS
from kernels.lora.family import LoraFamily
from kernels.metadata import AttentionMetadata
from kernels.paged_attention import decode_graph_splits

CONTEXT_CLASSES = (256, 2048)                 # graphs per bucket for contexts up to these, and up to the model's max:
                                              # a short context's step does not pay a long one's split count


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two below max_num_seqs, and max_num_seqs itself."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return sizes + [max_num_seqs]


def padded_tokens(tensors: dict[str, torch.Tensor], token_slots: list[int], num_tokens: int,
                  num_segments: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A step's per-token host tensors padded to num_tokens (token 0 at position 0, cache slot -1 so nothing is
    written), and its LoRA segments (LoraFamily.graph_segments)."""
    zeros = torch.zeros(num_tokens - len(token_slots), dtype=torch.int32)
    return {
        "input_ids": torch.cat([tensors["input_ids"], zeros]),
        "positions": torch.cat([tensors["positions"], zeros]),
        "slot_mapping": torch.cat([tensors["slot_mapping"], zeros - 1]),
    } | LoraFamily.graph_segments(token_slots, num_tokens, num_segments, dtype)


def copy_lora(buffers: dict[str, torch.Tensor], t: dict[str, torch.Tensor]) -> None:
    """A step's uploaded LoRA segments, work list and token slots into a graph's buffers."""
    for name in ("lora_starts", "lora_slots", "lora_work", "lora_token_slots"):
        buffers[name][:t[name].shape[0]].copy_(t[name])


def graph_lora(ops, buffers: dict[str, torch.Tensor], num_tokens: int, dtype: torch.dtype, slots):
    """A graph's LoRA for num_tokens rows (kernels/lora/executor.py) over the segments in its buffers."""
    return ops.lora_for(ops.lora.graph_view(buffers, num_tokens, dtype), slots)


def padded_inputs(inputs: StepInputs, bucket: int) -> dict[str, torch.Tensor]:
    """A decode step's host tensors padded to `bucket` rows (padding rows: token 0 at position 0, cache slot -1 so
    nothing is written, an empty context so nothing is read): ROW_INPUTS as the rows of "row_inputs" [4, bucket] and
    its block tables. Every row is one query token: query_starts is the graphs' fixed arange. (A decoding step's
    persistent buffer holds them padded already: PersistentBatch.) Written through numpy: fewer host calls than a
    torch op a tensor."""
    t, num_seqs = inputs.tensors, len(inputs.seq_lens)
    rows = np.empty((len(ROW_INPUTS), bucket), dtype=np.int32)
    rows[:] = PADDING[:, None]
    for row, name in zip(rows, ROW_INPUTS):
        row[:num_seqs] = t[name].numpy()
    tables = t["block_tables"].numpy()
    padded_tables = np.zeros((bucket, tables.shape[1]), dtype=np.int32)
    padded_tables[:num_seqs] = tables
    return {"row_inputs": torch.from_numpy(rows), "block_tables": torch.from_numpy(padded_tables)}


class DecodeGraphs:
    def __init__(self, model, kv_caches: list, lora_slots, max_num_seqs: int, block_size: int,
                 device: torch.device, capture: bool = True, logits: bool = True):
        """logits=False: a tensor-parallel worker's graphs, which run the layers only (rank 0 computes logits)."""
        cfg = model.cfg
        self.model = model
        self.dtype = model.w["embed_tokens"].dtype
        self.logits = logits
        self.kv_caches = kv_caches
        self.lora_slots = lora_slots
        self.device = device
        self.buckets = bucket_sizes(max_num_seqs)
        self.num_segments = lora_slots.num_slots + 2
        max_len = self.buckets[-1]
        max_blocks = -(-cfg.max_position_embeddings // block_size)
        self.max_seq_len = cfg.max_position_embeddings
        self.row_inputs = torch.zeros(len(ROW_INPUTS), max_len, dtype=torch.int32, device=device)
        self.buffers = dict(zip(ROW_INPUTS, self.row_inputs))
        self.buffers["query_starts"] = torch.arange(max_len + 1, dtype=torch.int32, device=device)
        self.buffers["slot_mapping"].fill_(-1)                         # as padding: captures write nothing
        self.buffers["block_tables"] = torch.zeros(max_len, max_blocks, dtype=torch.int32, device=device)
        self.buffers |= LoraFamily.graph_buffers(self.num_segments, max_len, device)
        self.logits_indices = torch.arange(max_len, dtype=torch.int32, device=device)
        self.contexts = sorted({min(bound, self.max_seq_len) for bound in CONTEXT_CLASSES + (self.max_seq_len,)})
        self.splits = {(bucket, context): decode_graph_splits(bucket, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                              block_size, context, device)
                       for bucket in self.buckets for context in self.contexts}
        self.capture = capture
        self.segments_of: tuple[list[int], int] | None = None          # the token slots and rows the LoRA buffers hold
        self.graphs: dict[tuple[tuple[int, int], bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[tuple[int, int], bool], torch.Tensor] = {}
        self.argmax: dict[tuple[tuple[int, int], bool], torch.Tensor] = {}     # each graph's greedy tokens
        self.greedy: torch.Tensor | None = None          # the last step's greedy tokens [num_seqs], taken in the graph
        self.copies: tuple = (None, None, 0, None, None, None)   # the last step's row inputs, tables and rows,
                                                                 # and the slices its copies took (to, from, to)
        if capture:
            self._capture_all()

    def bucket_for(self, inputs: StepInputs) -> tuple[int, int] | None:
        """The graph of a step that can replay one (every sequence decodes one token and samples it): its bucket of
        rows and its context class (the longest context it can hold, which fixes its split count)."""
        num_seqs = len(inputs.seq_lens)
        if inputs.max_query_len != 1 or inputs.runs_eager or num_seqs > self.buckets[-1] \
                or inputs.tensors["logits_indices"].shape[0] != num_seqs:
            return None
        longest = max(inputs.seq_lens)
        return (next(bucket for bucket in self.buckets if bucket >= num_seqs),
                next(context for context in self.contexts if context >= longest))

    def run(self, bucket: tuple[int, int], inputs: StepInputs, token_slots: list[int], staging, plan,
            lora_cache) -> torch.Tensor:
        """Logits [num_seqs, vocab] of a decode step (plan.t goes up with the inputs, in the same copy)."""
        rows, _ = bucket
        token_slots = token_slots or [-1] * len(inputs.seq_lens)
        segments_in_place = self.segments_of == (token_slots, rows)   # a steady batch: the buffers hold them
        laid_out = inputs.rows is not None and inputs.row_inputs.shape[1] >= rows   # the persistent buffer: padded
        host = inputs.sent if laid_out else padded_inputs(inputs, rows)
        if not segments_in_place:
            host = host | LoraFamily.graph_segments(token_slots, rows, self.num_segments, self.dtype)
        t = staging.upload(host | plan.t | inputs.pending_maps)
        t = inputs.received(t) if laid_out else t | {"input_ids": t["row_inputs"][0]}
        inputs.fill_pending(t)
        plan.t = {name: t[name] for name in plan.t}
        row_inputs, tables = t["row_inputs"], t["block_tables"]        # (a decoding step's tables: its rows')
        last_rows, last_tables, num_rows, rows_to, rows_from, tables_to = self.copies   # (a steady step's: the
        if last_rows is not row_inputs or last_tables is not tables or num_rows != rows:   # step before's slices)
            rows_to, rows_from = self.row_inputs[:, :rows], row_inputs[:, :rows]
            tables_to = self.buffers["block_tables"][:tables.shape[0], :tables.shape[1]]
            self.copies = (row_inputs, tables, rows, rows_to, rows_from, tables_to)
        rows_to.copy_(rows_from)
        if not segments_in_place:
            copy_lora(self.buffers, t)
            self.segments_of = (token_slots, rows)
        tables_to.copy_(tables)
        with_lora = any(slot >= 0 for slot in token_slots)
        if with_lora:
            lora_cache.wait_for_slots(token_slots)
        key, num_seqs = (bucket, with_lora), len(inputs.seq_lens)
        if self.capture:
            self.graphs[key].replay()
            logits, tokens = self.outputs[key], self.argmax.get(key)
        else:
            logits = self._forward(*key)
            tokens = greedy(logits) if self.logits else None
        if not self.logits:
            return None
        self.greedy = tokens[:num_seqs]
        return logits[:num_seqs]

    def _forward(self, bucket: tuple[int, int], with_lora: bool) -> torch.Tensor:
        """The model over the first rows of the buffers, for contexts up to the bucket's class: what a graph
        records."""
        (rows, context), b = bucket, self.buffers
        attn = AttentionMetadata(b["query_starts"][:rows + 1], b["seq_lens"][:rows], b["block_tables"][:rows],
                                 b["slot_mapping"][:rows], list(range(rows + 1)), [0] * rows, 1, context,
                                 num_splits=self.splits[bucket])
        ctx = StepContext(b["input_ids"][:rows], b["positions"][:rows], attn, self.logits_indices[:rows],
                          self.logits_indices[:0])
        if with_lora:
            ctx.lora = graph_lora(self.model.ops, b, rows, self.dtype, self.lora_slots)
        return self.model.forward(ctx, self.kv_caches, logits=self.logits)

    def _capture_all(self) -> None:
        """Each bucket, largest first, over buffers that make every row padding; the graphs share one memory pool
        (they never run at once)."""
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.splits, reverse=True):
            for with_lora in (False, True):
                self._forward(bucket, with_lora)                        # compiles the kernels, outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bucket, with_lora] = logits = self._forward(bucket, with_lora)
                    if self.logits:                                     # greedy sampling, in the graph
                        self.argmax[bucket, with_lora] = greedy(logits)
                self.graphs[bucket, with_lora] = graph
        torch.cuda.synchronize(self.device)
