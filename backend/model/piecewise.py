"""CUDA graphs of steps with prompt chunks, piecewise: everything but attention is recorded per token bucket (16,
32, ... up to MAX_TOKENS) in num_layers + 1 pieces, and attention runs eagerly between them over the step's real
sequences, whose count and lengths no graph can fix.

A step of n tokens runs the pieces of the smallest bucket T >= n over fixed buffers: its tokens padded to T (token
0 at position 0, cache slot -1 so nothing is written), its adapter segments padded to max_loras + 2. Piece 0 is the
embedding and layer 0 up to its attention; piece i the rest of layer i - 1 and layer i up to its attention; the
last piece the rest of the last layer. Each leaves q (or h) and the residual stream in fixed buffers, and attention
writes its output into another, so nothing a piece allocates outlives it. Per layer a step issues one replay, the
attention and one copy instead of ~17 launches (with adapters). Steps of more than MAX_TOKENS tokens (whose GPU
time dwarfs their launches), steps asking for prompt logits and tensor-parallel steps run eagerly. capture=False
runs the same pieces eagerly: how the CPU tests check everything but the capture itself.
"""
import torch

from backend.model.context import StepContext, StepInputs
from backend.model.graphs import copy_lora, graph_lora, padded_tokens
from kernels.lora.family import LoraFamily
from kernels.metadata import AttentionMetadata

TOKEN_INPUTS = ("input_ids", "positions", "slot_mapping")
MAX_TOKENS = 512                  # the largest bucket; the pieces' memory pool grows with it


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Powers of two from 16 below min(max_num_batched_tokens, MAX_TOKENS), and that bound itself."""
    limit = min(max_num_batched_tokens, MAX_TOKENS)
    return [1 << i for i in range(4, limit.bit_length()) if 1 << i < limit] + [limit]


class PiecewiseGraphs:
    def __init__(self, model, kv_caches: list, lora_slots, max_num_batched_tokens: int, device: torch.device,
                 capture: bool = True):
        cfg, dtype = model.cfg, model.w["embed_tokens"].dtype
        self.model = model
        self.dtype = dtype
        self.kv_caches = kv_caches
        self.lora_slots = lora_slots
        self.device = device
        self.buckets = token_buckets(max_num_batched_tokens)
        self.num_segments = lora_slots.num_slots + 2
        size = self.buckets[-1]
        self.buffers = {name: torch.zeros(size, dtype=torch.int32, device=device) for name in TOKEN_INPUTS}
        self.buffers["slot_mapping"].fill_(-1)                         # as padding: warm-ups write nothing
        self.buffers |= LoraFamily.graph_buffers(self.num_segments, size, device)
        self.q = torch.zeros(size, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
        self.o = torch.zeros(size, cfg.num_heads * cfg.head_dim, dtype=dtype, device=device)
        self.h = torch.zeros(size, cfg.hidden_size, dtype=dtype, device=device)
        self.residual = torch.zeros(size, cfg.hidden_size, dtype=dtype, device=device)
        self.capture = capture
        self.graphs: dict[tuple[int, bool], list[torch.cuda.CUDAGraph]] = {}
        if capture:
            self._capture_all()

    def bucket_for(self, inputs: StepInputs) -> int | None:
        """The token bucket of a step the pieces can run, or None."""
        num_tokens = inputs.query_starts[-1]
        if inputs.runs_eager or num_tokens > self.buckets[-1]:
            return None
        return next(bucket for bucket in self.buckets if bucket >= num_tokens)

    def run(self, bucket: int, inputs: StepInputs, token_slots: list[int], staging, plan,
            lora_cache) -> torch.Tensor:
        """Logits [num_sampled, vocab] of the step (plan.t goes up with the inputs, in the same copy)."""
        num_tokens = inputs.query_starts[-1]
        padded = padded_tokens(inputs.tensors, token_slots or [-1] * num_tokens, bucket, self.num_segments,
                               self.dtype)
        t = staging.upload(inputs.tensors | padded | plan.t | inputs.pending_maps)
        inputs.fill_pending(t)
        plan.t = {name: t[name] for name in plan.t}
        for name in TOKEN_INPUTS:
            self.buffers[name][:t[name].shape[0]].copy_(t[name])
        copy_lora(self.buffers, t)
        with_lora = any(slot >= 0 for slot in token_slots)
        if with_lora:
            lora_cache.wait_for_slots(token_slots)
        ctx = inputs.context(t)                                         # the real sequences, for attention
        for i in range(self.model.cfg.num_layers + 1):
            if self.capture:
                self.graphs[bucket, with_lora][i].replay()
            else:
                self._piece(bucket, with_lora, i)
            if i < self.model.cfg.num_layers:
                self.o[:num_tokens].copy_(self.model.attention(i, self.q[:num_tokens], ctx, self.kv_caches[i]))
        return self.model.logits(self.h, self.residual, t["logits_indices"])

    def _piece(self, bucket: int, with_lora: bool, i: int) -> None:
        """Piece i over the first `bucket` rows of the buffers: what its graph records."""
        model, rows, b = self.model, slice(0, bucket), self.buffers
        empty = b["input_ids"][:0]                                      # the pieces read only the cache slots
        attn = AttentionMetadata(empty, empty, empty[None], b["slot_mapping"][rows], [], [], 0, 0)
        ctx = StepContext(b["input_ids"][rows], b["positions"][rows], attn, empty, empty)
        if with_lora:
            ctx.lora = graph_lora(model.ops, b, bucket, self.dtype, self.lora_slots)
        if i == 0:
            h, residual, delta = model.embed(ctx), None, None
        else:
            h, residual, delta = model.after_attention(i - 1, self.o[rows], self.residual[rows], ctx)
        if i < model.cfg.num_layers:
            q, residual = model.before_attention(i, h, residual, ctx, self.kv_caches[i], delta)
            self.q[rows].copy_(q)
        else:
            self.h[rows].copy_(h)
        self.residual[rows].copy_(residual)

    def _capture_all(self) -> None:
        """Every piece of each bucket, largest first, with and without adapters, over buffers that make every row
        padding; one memory pool for all (only the fixed buffers outlive a piece)."""
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            for with_lora in (False, True):
                pieces = []
                for i in range(self.model.cfg.num_layers + 1):
                    self._piece(bucket, with_lora, i)                   # compiles the kernels, outside the capture
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._piece(bucket, with_lora, i)
                    pieces.append(graph)
                self.graphs[bucket, with_lora] = pieces
        torch.cuda.synchronize(self.device)
