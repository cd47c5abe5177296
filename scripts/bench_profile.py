"""One decode step on the GPU, measured: kernel launches, the share of GPU time in attention / LoRA / GEMMs
(torch.profiler), and the step's wall time eager and as a CUDA graph replay. Used by scripts/gpu_bench.py."""
import time

import torch
from torch.profiler import ProfilerActivity, profile

KINDS = {"attention": ("_attention_kernel", "_reduce_kernel"), "lora": ("_shrink_kernel", "_expand_kernel"),
         "gemm": ("gemm", "gemv", "cutlass", "xmma", "splitk", "sm80_", "sm90_")}


def kind_of(kernel_name: str) -> str:
    name = kernel_name.lower()
    return next((kind for kind, marks in KINDS.items() if any(mark.lower() in name for mark in marks)), "other")


def decode_step_profile(engine, requests: list[dict], num_timed: int = 20) -> dict:
    """Start `requests` (all decoding once their prompts are in), then profile one eager decode step and time
    num_timed steps each way (eager, graph replay when the engine has graphs). On CPU (a dry run) no kernel is
    counted."""
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    for r in requests:
        engine.add_request(r["prompt"], lora_task_id=r.get("lora_task_id"), max_new_tokens=4 * num_timed + 8,
                           ignore_end_id=True)
    while any(seq.num_computed_tokens < len(seq.prompt_ids) for members in engine.seqs.values() for seq in members):
        engine.step()
    runner, graphs = engine.runner, engine.runner.graphs
    runner.graphs = None                                               # eager steps first
    try:
        engine.step()
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.step()
            sync()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset"))]
        busy = {}
        for e in kernels:
            busy[kind_of(e.name)] = busy.get(kind_of(e.name), 0.0) + e.device_time
        total = sum(busy.values()) or 1.0
        result = {"num_seqs": len(requests), "launches_per_step": len(kernels),
                  "launches_per_layer": len(kernels) / engine.model_config.num_layers,
                  "gpu_time_share": {kind: t / total for kind, t in sorted(busy.items())},
                  "step_ms_eager": _step_ms(engine, num_timed, sync)}
    finally:
        runner.graphs = graphs
    if graphs is not None:
        result["step_ms_graph"] = _step_ms(engine, num_timed, sync)
    for request_id in list(engine.seqs):
        engine.abort(request_id)
    while engine.has_unfinished:
        engine.step()
    return result


def _step_ms(engine, num_steps: int, sync) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    sync()
    return (time.perf_counter() - start) / num_steps * 1e3
