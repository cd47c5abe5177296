"""Owns the model's weights and KV cache on the engine's device, and runs one step: the batch's inputs go up in
one copy, the forward and the sampling run on the device, the sampled tokens come back in one copy."""
from dataclasses import dataclass
from functools import partial

import torch

from backend.config import EngineConfig
from backend.core import sampler
from backend.core.kv_cache import num_kv_blocks
from backend.core.logprobs import PromptScores
from backend.core.request import SamplingParams, Sequence
from backend.core.scheduler import Batch, ScheduledSeq
from backend.device import (StepStaging, empty_kv_caches, on, pin, projection_dtype, resolve_device,
                           resolve_dtype)
from backend.lora.cache import LoraCache
from backend.model import rope
from backend.model.batch import LaunchRows, PersistentBatch
from backend.model.calibration import calibration_ids, kv_amax
from backend.model.checkpoint import ModelConfig
from backend.model.context import StepInputs
from backend.model.graph_check import capture_checked
from backend.model.graphs import DecodeGraphs
from backend.model.llama import LlamaModel
from backend.model.loader import checkpoint_kv_scales, load_weights
from backend.model.parallel import INIT, TensorParallelGroup, message_capacity
from backend.model.piecewise import PiecewiseGraphs
from backend.model.results import LaunchedStep, StepResults, collect, keep_chunk
from backend.model.self_check import check_kernels_or_fall_back
from backend.openmp import TeamSizer
from kernels.dispatch import load_ops, resolve_backend
from kernels.quant import KV_CACHE_TYPES, KV_INT8_MAX, QUANTIZED_WEIGHTS, QuantizedWeight

CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(slots=True)
class PreparedStep:
    """A step ready to run: its rows in launch order, its inputs, its sampling plan and each token's adapter slot."""
    rows: LaunchRows
    inputs: StepInputs
    plan: sampler.SamplingPlan
    token_slots: list[int]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.config = config
        self.model_config = cfg = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kernel_backend = resolve_backend(config.kernel_backend, self.device)
        self.projection_dtype = projection_dtype(config.dtype, self.dtype, self.kernel_backend)   # unquantized
        self.ops = load_ops(self.kernel_backend, self.device, config.lora_overlap, config.lora_fold,
                            config.inject_broken_ops)
        self.lora_dtype = self.ops.lora.adapter_dtype(config.lora.dtype, self.dtype)
        self.rope_rows = partial(rope.rows, cfg) if rope.long_rope_original(cfg) is not None else None
        tp_size = config.tensor_parallel_size
        self.shard_config = cfg.shard(tp_size)                 # this rank's heads and MLP columns
        self.block_size = config.kv_block_size
        self.kv_cache_dtype = KV_CACHE_TYPES.get(config.kv_cache_dtype,            # int8, uint8 (e4m3 bits), or
                                                 self.projection_dtype)             # auto: as the weights
        self.kernel_fallbacks: dict[str, str] = {}               # op family -> why the torch reference serves it
        if self.ops.checked and config.checks_at_start(self.device.type):      # (auto: CUDA) the kernels at the
            self.kernel_fallbacks = check_kernels_or_fall_back(self, config)     # model's shapes
        self.tp = self._start_workers(config) if tp_size > 1 else None
        try:
            weights = load_weights(config.model_dir, cfg, self.dtype, self.device, tp_size,
                                   weight_dtype=config.weight_dtype, lm_head_dtype=config.lm_head_dtype,
                                   projection_dtype=self.projection_dtype, prepare=self.ops.prepare_weight)
            self.model = LlamaModel(self.shard_config, weights, self.ops,
                                    all_reduce=self.tp.all_reduce if self.tp else None)
        except BaseException:
            self.close()                                         # no workers or process group left behind
            raise
        self.weight_bytes = sum(weight_bytes(w) for w in weights.values())     # this rank's, as served
        self.staging = StepStaging(self.device)
        self.persistent = PersistentBatch(config.max_num_seqs)  # the rows, from step to step
        self.num_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None          # steps with prompt chunks (one device only)
        self.device_bytes: int | None = None                   # weights, KV cache and adapter slots
        self.team = TeamSizer(active=self.device.type == "cpu")     # the stepping thread's OpenMP team

    def allocate_kv_cache(self) -> int:
        """Create the KV cache (after everything else that lives on the device); returns its number of blocks.
        On CUDA without kv_cache_memory_bytes it takes kv_cache_free_gpu_mem_fraction of the memory left free
        after the weights, the adapter slots and the activations of one forward at max_num_batched_tokens."""
        cfg, budget = self.model_config, self.config.kv_cache_memory_bytes
        if self.kv_cache_dtype == torch.int8 and self.model.kv_scales is None:
            self.model.kv_scales = self._calibrate_kv_scales()
        elif self.kv_cache_dtype == torch.uint8 and self.model.kv_scales is None:     # FP8: the checkpoint's, or
            self.model.kv_scales = checkpoint_kv_scales(self.config.model_dir, cfg) or \
                [(1.0, 1.0)] * cfg.num_layers                                         # TensorRT-LLM's default
        if budget is None and self.device.type == "cuda":
            peak = self._activation_peak_bytes()
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int((free - peak) * self.config.kv_cache_free_gpu_mem_fraction)
        elif budget is None:
            budget = CPU_KV_CACHE_BYTES
        self.num_blocks = num_kv_blocks(max(budget, 0), self.block_size, cfg.num_layers,
                                        self.shard_config.num_kv_heads, cfg.head_dim, self.kv_cache_dtype.itemsize)
        self._set_kv_cache(self.num_blocks)
        return self.num_blocks

    def _set_kv_cache(self, num_blocks: int, dtype: torch.dtype | None = None) -> None:
        """This rank's KV cache (its KV heads) of num_blocks blocks (in kv_cache_dtype unless `dtype`), and the
        workers' theirs (an INT8 or FP8 one with the model's scales)."""
        cfg, dtype = self.shard_config, dtype or self.kv_cache_dtype
        shape = (cfg.num_kv_heads, num_blocks, self.block_size, cfg.head_dim)
        self.kv_caches = []                                       # (the old cache freed before the new one)
        self.kv_caches = empty_kv_caches(cfg.num_layers, shape, dtype, self.device)
        if self.tp is not None:
            init = {"num_blocks": torch.tensor([num_blocks], dtype=torch.int32)}
            if dtype in (torch.int8, torch.uint8):                # (their bits: the messages carry int32)
                init["kv_scales"] = torch.tensor(self.model.kv_scales, dtype=torch.float32).view(torch.int32)
                init["fp8"] = torch.tensor([dtype == torch.uint8], dtype=torch.int32)
            self.tp.send(INIT, init)

    def _calibrate_kv_scales(self) -> list[tuple[float, float]]:
        """Each layer's INT8 KV cache scales (TensorRT-LLM's kv_cache_scaling_factor, one for K and one for V): the
        largest magnitude / 127 each reaches over a prefill of the calibration text (backend/model/calibration.py)
        written into a cache in dtype, over every rank's KV heads. Values past it later are clamped to +-127."""
        ids = calibration_ids(self.config.model_dir, self.model_config.vocab_size,
                              self.model_config.max_position_embeddings)
        seq = Sequence(-1, ids, SamplingParams(max_new_tokens=1))
        seq.block_table = list(range(-(-len(ids) // self.block_size)))
        self._set_kv_cache(len(seq.block_table), self.dtype)
        with on(self.device), torch.inference_mode():
            self.run(Batch([ScheduledSeq(seq, len(ids))]))
        self.persistent.drop()
        amax = kv_amax(self.kv_caches, len(ids))                  # [num_layers, 2]
        if self.tp is not None:
            self.tp.kv_amax(len(ids), amax)
        self._set_kv_cache(0, self.dtype)
        return [(max(k, 1e-6) / KV_INT8_MAX, max(v, 1e-6) / KV_INT8_MAX) for k, v in amax.tolist()]

    def _activation_peak_bytes(self) -> int:
        """Peak memory of a warm-up forward over max_num_batched_tokens prompt tokens (on a cache just big enough)."""
        cfg, num_tokens = self.model_config, self.config.max_num_batched_tokens
        seq_len = min(num_tokens, cfg.max_position_embeddings)
        num_seqs = -(-num_tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        items = []
        for s in range(num_seqs):
            n = min(seq_len, num_tokens - s * seq_len)
            seq = Sequence(-1 - s, [0] * n, SamplingParams(max_new_tokens=1))
            seq.block_table = list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))
            items.append(ScheduledSeq(seq, n))
        self._set_kv_cache(num_seqs * blocks_per_seq)
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        with torch.inference_mode():
            self.run(Batch(items))
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self._set_kv_cache(0)
        torch.cuda.empty_cache()
        return peak

    def capture_graphs(self, lora_cache: LoraCache) -> None:
        """CUDA graphs of decode steps (backend/model/graphs.py), after the KV cache, checked against eager steps:
        on CUDA with the Triton kernels, unless cuda_graph_mode is off (graph_check.capture_checked)."""
        if (self.config.cuda_graph_mode and self.device.type == "cuda" and self.ops.graphs
                and not self.kernel_fallbacks.keys() - {"lora_overlap", "lora_fold"}):   # the torch fallbacks do
            self.kernel_fallbacks |= capture_checked(self, lora_cache)       # not take a graph's padding rows

    def start_graphs(self, lora_cache: LoraCache, capture: bool) -> None:
        """Decode graphs on this rank and on the workers, piecewise graphs on one device (capture=False: their
        padded steps run eagerly, the CPU tests' mode)."""
        if self.tp is not None:
            self.tp.start_graphs(capture)
        with on(self.device), torch.inference_mode():
            self.graphs = DecodeGraphs(self.model, self.kv_caches, lora_cache.slots, self.config.max_num_seqs,
                                       self.block_size, self.device, capture)
            if self.tp is None:
                self.piecewise = PiecewiseGraphs(self.model, self.kv_caches, lora_cache.slots,
                                                 self.config.max_num_batched_tokens, self.device, capture)

    def graph_step(self, bucket: tuple[int, int], inputs: StepInputs, token_slots: list[int], plan,
                   lora_cache) -> torch.Tensor:
        """A decode step through the graph of `bucket` (rows, context class: DecodeGraphs.bucket_for), on every
        rank."""
        if self.tp is not None:
            self.tp.step(inputs.tensors, token_slots, bucket)
        return self.graphs.run(bucket, inputs, token_slots, self.staging, plan, lora_cache)

    def _start_workers(self, config: EngineConfig) -> TensorParallelGroup:
        """Ranks 1..N-1 as processes of their own; on CUDA rank r runs on the r-th device after this one's."""
        cfg, size = self.model_config, config.tensor_parallel_size
        if self.device.type == "cuda" and self.device.index + size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {size} needs {size} CUDA devices from {self.device}, "
                             f"{torch.cuda.device_count()} visible")
        max_blocks = -(-cfg.max_position_embeddings // config.kv_block_size)
        capacity = message_capacity(config.max_num_batched_tokens, config.max_num_seqs, max_blocks, cfg.num_layers)
        args = {"model_dir": config.model_dir, "dtype": str(self.dtype).removeprefix("torch."),
                "projection_dtype": str(self.projection_dtype).removeprefix("torch."),
                "lora_dtype": str(self.lora_dtype).removeprefix("torch."), "kernel_backend": self.kernel_backend,
                "device": str(self.device), "block_size": config.kv_block_size, "max_loras": config.lora.max_loras,
                "max_lora_rank": config.lora.max_lora_rank,
                "threads": max(1, torch.get_num_threads() // size),
                "kernel_fallbacks": ",".join(self.kernel_fallbacks) or "none",     # rank 0's self-check holds
                "lora_overlap": int(config.lora_overlap), "lora_fold": int(config.lora_fold),
                "broken_ops": ",".join(config.inject_broken_ops) or "none",
                "max_num_seqs": config.max_num_seqs, "weight_dtype": config.weight_dtype}
        return TensorParallelGroup(size, args, self.device, capacity, config.tensor_parallel_timeout_s)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any."""
        if self.tp is not None:
            self.tp.close()
            self.tp = None

    def memory_bytes(self, lora_cache: LoraCache) -> dict[str, int]:
        """Memory the runtime holds, as TensorRT-LLM reports it: on the GPU, and on the host (pinned, else cpu):
        weights, KV cache and the adapters' device tier on the engine's device, the host tier beside it."""
        if self.device_bytes is None:                            # fixed once the KV cache is there
            self.device_bytes = self.weight_bytes
            self.device_bytes += sum(k.nbytes + v.nbytes for k, v in self.kv_caches)
            self.device_bytes += lora_cache.slots.num_bytes_per_slot * lora_cache.slots.num_slots
        device, host = self.device_bytes, lora_cache.stats.host_bytes
        if self.device.type == "cuda":
            return {"gpu": device, "pinned": host, "cpu": 0}
        return {"gpu": 0, "pinned": 0, "cpu": device + host}

    def copy_kv_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (source, destination) in every layer's K and V cache, in stream order."""
        if self.tp is not None:
            self.tp.copy_kv(pairs)
        with on(self.device):                                     # pinned, then asynchronous: no host sync
            src = pin(torch.tensor([s for s, _ in pairs]), self.device).to(self.device, non_blocking=True)
            dst = pin(torch.tensor([d for _, d in pairs]), self.device).to(self.device, non_blocking=True)
            for k, v in self.kv_caches:
                k.index_copy_(1, dst, k.index_select(1, src))
                v.index_copy_(1, dst, v.index_select(1, src))

    def run(self, batch: Batch, lora_cache: LoraCache | None = None,
            prefetch: list[int | None] = ()) -> StepResults:
        """The next token and its log prob for each sequence whose chunk reaches its last token, in the order of
        batch.items (which this sorts by adapter slot, so that each adapter is one segment), the raw logits
        [vocab] (host, fp32) of the rows whose request asked for them, by row, the top alternatives and the scored
        prompt chunks asked for. Prompt logits asked for (return_context_logits) go to each sequence's
        context_logits, by chunk. The adapters in `prefetch` start uploading while the step computes."""
        return self.collect(self.launch(batch, lora_cache, prefetch))

    def launch(self, batch: Batch, lora_cache: LoraCache | None = None, prefetch: list[int | None] = (),
               previous: "LaunchedStep | None" = None) -> "LaunchedStep":
        """Start a step (`run` without waiting for its results: `collect` them). Its sequences whose last token is
        still pending take it from `previous`, the step in flight before it, on the device."""
        with on(self.device):
            self.team.start()
            try:
                return self._launch(batch, lora_cache, prefetch, previous)
            finally:
                self.team.checkpoint()

    def collect(self, step: LaunchedStep) -> StepResults:
        """A launched step's results, once they reach the host (see `run`)."""
        return collect(step)

    def _launch(self, batch: Batch, lora_cache: LoraCache | None, prefetch: list[int | None],
                previous: "LaunchedStep | None") -> "LaunchedStep":
        try:
            step = self._prepare(batch, lora_cache, previous)
            logits, greedy = self._run_model(batch, step, lora_cache)
            return self._sample(batch, step, logits, greedy, lora_cache, prefetch)
        except BaseException:
            self.persistent.drop()                                # its rows are not what it left behind
            raise

    def _prepare(self, batch: Batch, lora_cache: LoraCache | None, previous: "LaunchedStep | None") -> PreparedStep:
        """The step's rows: the persistent batch brought to `batch` (rows of sequences that left removed, those that
        joined added, each adapter one segment); its inputs (pending tokens taken from `previous` on the device) and
        its sampling plan (the last one's where the batch is steady and the plan can be reused)."""
        rows = self.persistent.update(batch, lora_cache.slot if lora_cache is not None else None)
        inputs = StepInputs(batch, self.block_size, self.persistent, self.rope_rows)
        if inputs.rows is not None:
            token_slots = rows.slots                              # (one token a row)
        else:
            token_slots = [slot for item, slot in zip(batch.items, rows.slots) for _ in range(item.num_new_tokens)]
        if inputs.pending:
            inputs.take_pending(previous.rows_of, previous.tokens)
        plan = rows.plan or sampler.prepare(list(rows.rows_of), self.model_config.vocab_size)
        rows.plan = plan if plan.reusable else None
        return PreparedStep(rows, inputs, plan, token_slots)

    def _run_model(self, batch: Batch, step: PreparedStep,
                   lora_cache: LoraCache | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits of the rows to sample: a decode step through its CUDA graph (which also picks the greedy
        tokens, returned second), a step with prompt chunks through the piecewise graphs, or the eager forward."""
        inputs = step.inputs
        bucket = self.graphs.bucket_for(inputs) if self.graphs is not None else None
        if bucket is not None:
            return self.graph_step(bucket, inputs, step.token_slots, step.plan, lora_cache), self.graphs.greedy
        token_bucket = self.piecewise.bucket_for(inputs) if self.piecewise is not None else None
        if token_bucket is not None:
            return self.piecewise.run(token_bucket, inputs, step.token_slots, self.staging, step.plan,
                                      lora_cache), None
        token_slots = step.token_slots if step.rows.any_adapter else None
        return self._forward(batch, inputs, step.plan, token_slots, lora_cache), None

    def _sample(self, batch: Batch, step: PreparedStep, logits: torch.Tensor, greedy: torch.Tensor | None,
                lora_cache: LoraCache | None, prefetch: list[int | None]) -> LaunchedStep:
        """The step's tokens sampled on the device (the raw logits asked for taken first), the adapters next in
        line prefetched, the results' one download started, and the rows' state recorded for the next step."""
        rows, inputs = step.rows, step.inputs
        raw = None
        if rows.wanted:                                           # before sampling changes them in place
            wanted = pin(torch.tensor(rows.wanted), self.device).to(self.device, non_blocking=True)
            raw = logits.index_select(0, wanted).float()
        tokens, log_probs, top = sampler.sample(logits, step.plan, greedy)
        if lora_cache is not None and prefetch:
            lora_cache.prefetch(prefetch)
        results = tokens if log_probs is None else torch.stack([tokens.double(), log_probs.double()])
        extra = ([raw] if raw is not None else []) + list(top or ())
        if inputs.prompt_chunks:
            extra += [inputs.scores.values, inputs.scores.ids]
        download = self.staging.download(results, *extra)
        self.persistent.record(inputs)
        scored = [(batch.items[index].seq, start, num_rows) for index, start, num_rows in inputs.prompt_chunks]
        return LaunchedStep(batch, rows, tokens, download, step.plan.max_top_log_probs if top else 0, scored)

    def _forward(self, batch: Batch, inputs: StepInputs, plan, token_slots: list[int] | None,
                 lora_cache: LoraCache | None) -> torch.Tensor:
        """The eager step: logits [num_sampled, vocab]; prompt logits asked for go to their sequences, prompt rows to
        score to inputs.scores. token_slots: each token's adapter slot (None: no adapter in the step)."""
        segments = None
        if token_slots is not None:
            segments = self.ops.lora.segments(token_slots, self.dtype)
        if self.tp is not None:                                   # the workers run the same step beside us
            self.tp.step(inputs.tensors, token_slots or [])
        t = self.staging.upload(inputs.sent | plan.t | (segments.tensors if segments else {}) | inputs.pending_maps
                                | inputs.scored)
        t = inputs.received(t)
        inputs.fill_pending(t)
        ctx = inputs.context(t)
        ctx.between_layers = self.team.checkpoint if self.team.active else None
        plan.t = {name: t[name] for name in plan.t}
        if inputs.scored:
            ctx.prompt_scores = inputs.scores = PromptScores(t["score_rows"], t["score_targets"], inputs.score_k)
        if segments is not None:
            segments.use(t)
            lora_cache.wait_for_slots(segments.slots_list)
            ctx.lora = self.ops.lora_for(segments, lora_cache.slots)
        logits = self.model.forward(ctx, self.kv_caches, with_context=bool(inputs.context_chunks))
        if not inputs.context_chunks:
            return logits
        context = logits[plan.num_rows:].cpu()                   # asked for: copied once
        offset = 0
        for index, first, num_rows in inputs.context_chunks:
            keep_chunk(batch.items[index].seq.context_logits, first, context[offset:offset + num_rows])
            offset += num_rows
        return logits[:plan.num_rows]


def weight_bytes(weight: torch.Tensor | QuantizedWeight) -> int:
    """Bytes a served weight holds (a quantized one's values, scales and zero points; a oneDNN-packed one's
    elements)."""
    return weight.nbytes if isinstance(weight, QUANTIZED_WEIGHTS) else weight.nelement() * weight.element_size()
