"""The LoRA kernels alone, one layer of a model shape: per case and projection, the GPU time of the two launches
(from a CUDA-graph replay of many calls, so launch gaps do not count), the host time to dispatch them (eager calls,
not waited for), the adapter-bytes bound (the bytes of the adapters the step uses, at the measured copy bandwidth),
the base GEMM of the same projection, the GEMM with its LoRA in turn and beside it (the LoRA left on the critical
path: that time less the GEMM's; and with the product left for the next op, as graph steps that fold run them:
no merge, the next op's read of the delta not counted), and the LoRA kernels with the expand the plan did not
choose. Used by scripts/gpu_bench.py; on CPU (a dry run) the torch reference runs eagerly and only the code path is
exercised."""
import time
from dataclasses import replace

import torch

from backend.lora.slots import PROJS, DeviceSlots, proj_shape
from backend.model.checkpoint import ModelConfig
from backend.model.self_check import random_adapter
from bench.step_profile import sync
from kernels.dispatch import load_ops

RANKS = [8, 16, 32, 64] * 4                   # W1's adapters, slot by slot; max_lora_rank 64
CASES = {                                     # name -> tokens per slot (slots in order)
    "decode, 16 tokens over 16 adapters": [1] * 16,
    "64 tokens over 16 adapters": [4] * 16,
    "256 tokens over 16 adapters": [16] * 16,
    "decode, 16 tokens on one rank-64 adapter": [0, 0, 0, 16] + [0] * 12,
}
CALLS = 20                                    # calls per timing


def lora_kernels(cfg: ModelConfig, device: str, bandwidth: float) -> dict:
    """{case: {projection: {gpu_us, host_us, bound_us, gemm_us}, "layer": totals}} at cfg's shape, bf16."""
    on_cuda = torch.device(device).type == "cuda"
    ops = load_ops("triton" if on_cuda else "torch", device)
    dtype = torch.bfloat16
    one_layer, slots = layer_slots(cfg, ops, device)
    result = {}
    for case, per_slot in CASES.items():
        token_slots = [slot for slot, n in enumerate(per_slot) for _ in range(n)]
        used = sorted(set(token_slots))
        row, totals = {}, dict.fromkeys(("gpu_us", "host_us", "bound_us", "gemm_us", "in_turn_us", "overlap_us",
                                         "folded_us", "gpu_us_other_expand"), 0.0)
        for proj in PROJS:
            in_dim, out_dim = proj_shape(one_layer, proj)
            segments = ops.lora.segments(token_slots, dtype)
            segments.use({name: t.to(device) for name, t in segments.tensors.items()})
            step_lora = ops.lora_for(segments, slots)
            x = torch.randn(len(token_slots), in_dim, device=device, dtype=dtype)
            out = torch.randn(len(token_slots), out_dim, device=device, dtype=dtype)
            weight = torch.randn(out_dim, in_dim, device=device, dtype=dtype) * in_dim ** -0.5
            projection = slots.projections[0][proj]
            lora = lambda: step_lora.apply(x, projection, out)                   # noqa: E731
            adapter_bytes = sum(RANKS[s] * (in_dim * len(projection.widths) + out_dim) * dtype.itemsize for s in used)
            entry = {"gpu_us": replay_us(lora, device), "host_us": host_us(lora, device),
                     "bound_us": adapter_bytes / bandwidth * 1e6,
                     "gemm_us": replay_us(lambda: torch.nn.functional.linear(x, weight), device)}
            entry |= beside_the_gemm(ops, slots, token_slots, proj, x, weight, device)
            row[proj] = entry
            for key in totals:
                totals[key] += entry[key]
        row["layer"] = totals | {"vs_bound": totals["gpu_us"] / totals["bound_us"],
                                 "vs_gemm": totals["gpu_us"] / totals["gemm_us"],
                                 "on_path_us": totals["overlap_us"] - totals["gemm_us"],
                                 "on_path_folded_us": totals["folded_us"] - totals["gemm_us"],
                                 "on_path_in_turn_us": totals["in_turn_us"] - totals["gemm_us"]}
        result[case] = row
    return result


def layer_slots(cfg: ModelConfig, ops, device: str, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """(cfg of one layer, its device slots holding RANKS' adapters on every module, slot by slot)."""
    one_layer = replace(cfg, num_layers=1)
    slots = DeviceSlots(one_layer, len(RANKS), max(RANKS), dtype, device, ops.lora)
    g = torch.Generator().manual_seed(0)
    for slot, rank in enumerate(RANKS):
        slots.load(slot, random_adapter(one_layer, rank, dtype, g))
    slots.copies.wait(list(range(len(RANKS))))
    return one_layer, slots


def beside_the_gemm(ops, slots, token_slots: list[int], proj: str, x: torch.Tensor, weight: torch.Tensor,
                    device: str) -> dict:
    """The projection's GEMM with its LoRA: in turn (the GEMM, then shrink and expand in place) and overlapped
    (shrink and expand on the side stream beside the GEMM, into the delta, then the merge: what graph steps run),
    folded (the same without the merge, left for the op after the GEMM), and the LoRA kernels with the other
    expand (rows one by one where the plan takes tensor cores, and the other way round): its GPU time, to keep what
    wins."""
    def step_lora(overlap: bool, fold: bool = False):
        segments = ops.lora.segments(token_slots, x.dtype)
        segments.use({name: t.to(device) for name, t in segments.tensors.items()})
        segments.overlap = overlap
        if fold:
            segments.token_slots = torch.tensor(token_slots, dtype=torch.int32, device=device)
        return ops.lora_for(segments, slots)
    in_turn, overlapped, folded, other = step_lora(False), step_lora(True), step_lora(True, True), step_lora(False)
    result = {"in_turn_us": replay_us(lambda: in_turn.linear(x, weight, None, 0, proj), device),
              "overlap_us": replay_us(lambda: overlapped.linear(x, weight, None, 0, proj), device),
              "folded_us": replay_us(lambda: folded.linear_deferred(x, weight, None, 0, proj), device)}
    projection = slots.projections[0][proj]
    out = torch.zeros(x.shape[0], weight.shape[0], dtype=x.dtype, device=device)
    other.apply(x, projection, out)                                    # plans the step
    if ops.lora.work_list:                                             # (the Triton family's)
        mma = other.prepare(x, projection).launch.mma
        other.use(projection, other.relaunched(projection, mma=not mma))
    result["gpu_us_other_expand"] = replay_us(lambda: other.apply(x, projection, out), device)
    return result


def replay_us(fn, device: str) -> float:
    """Microseconds per call of fn on the GPU: CALLS calls captured in one CUDA graph, the replay timed (eager on
    CPU)."""
    fn()                                                                # compile, allocate the step's scratch
    sync(device)
    if torch.device(device).type != "cuda":
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        return (time.perf_counter() - start) / CALLS * 1e6
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) * 1e3 / (5 * CALLS)


def host_us(fn, device: str) -> float:
    """Microseconds of host time per eager call: what the thread spends dispatching, the GPU not waited for."""
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    spent = time.perf_counter() - start
    sync(device)
    return spent / CALLS * 1e6


def summary(result: dict) -> list[str]:
    lines = []
    for case, row in result.items():
        layer = row["layer"]
        lines.append(f"  LoRA {case}: {layer['gpu_us']:.1f} us a layer on the GPU ({layer['vs_bound']:.1f}x the "
                     f"adapter-bytes bound {layer['bound_us']:.1f} us, {layer['vs_gemm']:.0%} of the base GEMMs "
                     f"{layer['gemm_us']:.1f} us), host {layer['host_us']:.1f} us; on the critical path "
                     f"{layer['on_path_us']:.1f} us beside the GEMMs ({layer['on_path_folded_us']:.1f} folded), "
                     f"{layer['on_path_in_turn_us']:.1f} in turn; "
                     f"with the other expand {layer['gpu_us_other_expand']:.1f} us")
    return lines
