"""The start-up check of the CUDA graphs (decode and piecewise) against the same step run eagerly, on probes that
exercise what a graph must carry: three sequences over the first blocks of the KV cache, two of them with adapters
of two ranks (on the first and last layers: a piece that drops its adapters differs), none starting with the token 0
that graph padding writes (a padding row that writes a real cache slot differs).

bf16 rounding grows with depth, and a graph's padded GEMM shapes choose other kernels than the eager step's: at
the Llama-3.1-8B shape a correct step differed by 0.225 (relative logit error) from the eager one in bf16, against
0.002 in fp32. So the allowed error is the eager step's own noise at the graph's padding (the same step eagerly
beside padding rows that fill the bucket, against it alone) times NOISE_FACTOR, and never less than the dtype's
fixed tolerance: rounding passes, a wrong piece (tens of times the noise) does not.

Graph steps run LoRA beside the GEMMs (kernels/lora/executor.TritonLoraExecutor), its product added by the op after
each GEMM, eager steps after them: the checks compare the two, and `capture_checked` captures the graphs again without
the fold, then without the overlap, where that is what fails.
"""
import logging
from copy import copy

import torch

from backend.core import sampler
from backend.core.request import SamplingParams, Sequence
from backend.core.scheduler import Batch, ScheduledSeq
from backend.device import on
from backend.lora.format import LoraAdapter, module_shape
from backend.model.context import StepInputs
from backend.model.self_check import TOLERANCE, max_error

NOISE_FACTOR = 4
PROBE_TASKS = (-1, -2)                         # task ids no client can send (they are UINT64)
log = logging.getLogger(__name__)


def probe_adapter(cfg, rank: int, dtype, device, seed: int) -> LoraAdapter:
    """Every module of the first and last layers at `rank`, as strong as the base weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for layer in sorted({0, cfg.num_layers - 1}):
        for module_id in range(1, 8):
            in_dim, out_dim = module_shape(cfg, module_id)
            weights[(layer, module_id)] = (
                (torch.randn(rank, in_dim, generator=g, device=device) * in_dim ** -0.5).to(dtype),
                (torch.randn(out_dim, rank, generator=g, device=device) * rank ** -0.5).to(dtype))
    return LoraAdapter(weights)


class Probes:
    """The probe adapters in two device slots while the check runs (as a request's would be), out again after,
    with the cache's counters as they were. With one slot (max_loras 1) one adapter, at the top rank, serves both
    rows that carry one."""

    def __init__(self, runner, lora_cache):
        self.lora_cache = lora_cache
        self.stats = copy(lora_cache.stats)
        max_rank = lora_cache.cfg.max_lora_rank
        self.tasks = PROBE_TASKS[:lora_cache.cfg.max_loras]
        for task, rank in zip(self.tasks, (max_rank, max(1, max_rank // 4))):
            lora_cache.insert(task, probe_adapter(runner.model_config, rank, lora_cache.dtype, runner.device,
                                                  seed=-task))
            lora_cache.acquire(task)
        self.slots = [lora_cache.slot(task) for task in self.tasks] * (len(PROBE_TASKS) // len(self.tasks))

    def close(self) -> None:
        for task in self.tasks:
            self.lora_cache.release(task)
            self.lora_cache.remove(task)
        self.lora_cache.stats = self.stats


def probe_sequences(runner, first_block: int = 0) -> list[Sequence]:
    """Three prompts (5, 14 and 23 tokens, none starting with 0) over the KV cache's first blocks (free again
    after)."""
    vocab, seqs, next_block = runner.model_config.vocab_size, [], first_block
    for i in range(3):
        seq = Sequence(-1 - i, [1 + (7 * i + j) % (vocab - 1) for j in range(5 + 9 * i)],
                       SamplingParams(max_new_tokens=2))
        next_block = give_blocks(runner, seq, seq.num_tokens + 1, next_block)
        seqs.append(seq)
    return seqs


def give_blocks(runner, seq: Sequence, num_tokens: int, first: int) -> int:
    num_blocks = -(-num_tokens // runner.block_size)
    seq.block_table = list(range(first, first + num_blocks))
    return first + num_blocks


def eager(runner, items: list[ScheduledSeq], token_slots: list[int], lora_cache, rows: list[int]) -> torch.Tensor:
    """The step run eagerly (fresh inputs and sampling plan), fp32, the logits of the given rows."""
    batch = Batch(items)
    seqs = [item.seq for item in items if item.samples]
    logits = runner._forward(batch, StepInputs(batch, runner.block_size),
                             sampler.prepare(seqs, runner.model_config.vocab_size), token_slots, lora_cache)
    return logits.float()[rows]


def differs(runner, what: str, graphed: torch.Tensor, reference: torch.Tensor, noise: float) -> str | None:
    """Why a graphed step's logits differ from the eager step's beyond rounding, or None. Rounding: within
    NOISE_FACTOR x the eager step's own noise at the graph's padding (at least the dtype's tolerance), and a
    greedy token that differs only where the eager step's two candidates are that close."""
    error, allowed = max_error(graphed, reference), max(TOLERANCE[runner.dtype], NOISE_FACTOR * noise)
    best, picked = reference.argmax(-1), graphed.argmax(-1)
    rows = torch.arange(len(best), device=best.device)
    margin = ((reference[rows, best] - reference[rows, picked]) / (1 + reference[rows, best].abs())).max().item()
    if error <= allowed and margin <= allowed:
        return None
    log.warning("kernel self-check on %s: %s through CUDA graphs differs from the same step run eagerly (max logit "
                "error %.3g, allowed %.3g: the eager step's own noise %.3g); serving it without them",
                runner.device, what, error, allowed, noise)
    return f"{what}: max logit error {error:.3g} (allowed {allowed:.3g})"


def check_piecewise_graphs(runner, lora_cache) -> str | None:
    """The three prompts, two with adapters, in one step through the piecewise graphs against the same step run
    eagerly (first: a graph that writes where it must not is then seen): why they differ, or None (also where the
    step does not fit the graphs' buckets)."""
    seqs = probe_sequences(runner)
    inputs = StepInputs(Batch([ScheduledSeq(seq, seq.num_tokens) for seq in seqs]), runner.block_size)
    bucket = runner.piecewise.bucket_for(inputs) if runner.piecewise is not None else None
    if bucket is None:
        return None
    probes = Probes(runner, lora_cache)
    try:
        with on(runner.device), torch.inference_mode():
            order = [seqs[1], seqs[0], seqs[2]]                          # base, then by slot (as the runner sorts)
            items = [ScheduledSeq(seq, seq.num_tokens) for seq in order]
            token_slots = [slot for seq, slot in zip(order, [-1] + probes.slots) for _ in range(seq.num_tokens)]
            reference = eager(runner, items, token_slots, lora_cache, [0, 1, 2])
            padding = Sequence(-9, [1] * (bucket + 1), SamplingParams(max_new_tokens=1))   # fills the bucket, no sample
            give_blocks(runner, padding, bucket + 1, max(seqs[-1].block_table) + 1)
            filler = ScheduledSeq(padding, bucket - len(token_slots))
            noise = max_error(eager(runner, [filler] + items, [-1] * filler.num_new_tokens + token_slots, lora_cache,
                                    [0, 1, 2]), reference)
            batch = Batch(items)
            inputs = StepInputs(batch, runner.block_size)
            graphed = runner.piecewise.run(bucket, inputs, token_slots, runner.staging,
                                           sampler.prepare(order, runner.model_config.vocab_size), lora_cache)
            graphed = graphed.float().clone()
    finally:
        probes.close()
    return differs(runner, "a step of 3 prompts", graphed, reference, noise)


def check_graphs(runner, lora_cache) -> str | None:
    """A decode step of the three sequences (two with adapters; fewer where the graphs hold fewer rows, those with
    adapters first), after an eager prefill writes their KV, replayed through its graph against the same step run
    eagerly first: why they differ, or None."""
    seqs = probe_sequences(runner)
    probes = Probes(runner, lora_cache)
    try:
        with on(runner.device), torch.inference_mode():
            pairs = [(seqs[1], -1), (seqs[0], probes.slots[0]), (seqs[2], probes.slots[1])]
            if runner.graphs.buckets[-1] < len(pairs):
                pairs = [pairs[1], pairs[2], pairs[0]][:runner.graphs.buckets[-1]]
            order, slots = [seq for seq, _ in pairs], [slot for _, slot in pairs]
            rows = list(range(len(order)))
            prefill = [ScheduledSeq(seq, seq.num_tokens) for seq in order]
            tokens = eager(runner, prefill, [s for seq, s in zip(order, slots) for _ in range(seq.num_tokens)],
                           lora_cache, rows).argmax(-1).tolist()
            for seq, token in zip(order, tokens):
                seq.num_computed_tokens = seq.num_tokens
                seq.output_ids.append(token)
            items = [ScheduledSeq(seq, 1) for seq in order]
            reference = eager(runner, items, slots, lora_cache, rows)
            inputs = StepInputs(Batch(items), runner.block_size)
            bucket = runner.graphs.bucket_for(inputs)
            fillers = []
            next_block = max(max(seq.block_table) for seq in seqs) + 1
            for i in range(bucket[0] - len(items)):                     # rows of the bucket's padding, eagerly
                filler = Sequence(-10 - i, [1], SamplingParams(max_new_tokens=1))
                next_block = give_blocks(runner, filler, 2, next_block)
                fillers.append(ScheduledSeq(filler, 1))
            noise = max_error(eager(runner, items + fillers, slots + [-1] * len(fillers), lora_cache, rows),
                              reference) if fillers else 0.0
            graphed = runner.graph_step(bucket, inputs, slots, sampler.prepare(order, runner.model_config.vocab_size),
                                        lora_cache).float().clone()
    finally:
        probes.close()
    return differs(runner, f"a decode step of {len(order)} sequences", graphed, reference, noise)


def capture_checked(runner, lora_cache) -> dict[str, str]:
    """The runner's graphs captured and checked: {"graphs" | "piecewise_graphs" | "lora_fold" | "lora_overlap":
    why} for what was dropped. Where graphs with LoRA beside the GEMMs fail to capture or differ from eager steps
    (one device), they are captured again with each product merged after its GEMM (if folded), then with LoRA after
    each GEMM, and kept the first way that fails less."""
    errors = capture_and_check(runner, lora_cache)
    if not errors or not runner.ops.lora.overlap or runner.tp is not None:
        return errors
    family = runner.ops.lora
    for kernel, lighter in (("lora_fold", family.merged()), ("lora_overlap", family.in_turn())):
        if lighter == family:
            continue
        runner.ops.lora = lighter
        retried = capture_and_check(runner, lora_cache)
        if len(retried) < len(errors):                  # what it turned off was at fault
            return retried | {kernel: "; ".join(errors.values())}
    runner.ops.lora = family                            # neither was: the graphs as they were
    return capture_and_check(runner, lora_cache)


def capture_and_check(runner, lora_cache) -> dict[str, str]:
    """The graphs captured and checked against eager steps: {"graphs" | "piecewise_graphs": why} for those dropped
    (a capture that fails with LoRA beside the GEMMs drops both)."""
    runner.graphs = runner.piecewise = None
    torch.cuda.empty_cache()
    try:
        runner.start_graphs(lora_cache, capture=True)
    except RuntimeError as err:
        if not runner.ops.lora.overlap or runner.tp is not None:
            raise
        runner.graphs = runner.piecewise = None
        return {"graphs": f"capture with LoRA beside the GEMMs: {type(err).__name__}: {str(err)[:200]}"}
    errors = {}
    if runner.config.kernel_self_check != "false":
        error = check_piecewise_graphs(runner, lora_cache)
        if error is not None:
            errors["piecewise_graphs"], runner.piecewise = error, None
        error = check_graphs(runner, lora_cache)
        if error is not None:
            errors["graphs"], runner.graphs = error, None
    return errors
