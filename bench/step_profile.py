"""One decode step on the GPU, measured: kernel launches (the most frequent by name), the share of GPU time in
attention / LoRA / GEMMs (torch.profiler), and the step's wall time eager and as a CUDA graph replay. Used by
scripts/gpu_bench.py."""
import gc
import time

import torch
from torch.profiler import ProfilerActivity, profile

KINDS = {"attention": ("_attention_kernel", "_reduce_kernel"),
         "lora": ("_shrink_kernel", "_expand_kernel", "_merge_kernel"),
         "gemm": ("gemm", "gemv", "cutlass", "xmma", "splitk", "sm80_", "sm90_")}


def sync(device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device) -> None:
    """What a dropped engine held, back: its cycles collected, and on CUDA the cached blocks returned."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def kind_of(kernel_name: str) -> str:
    name = kernel_name.lower()
    return next((kind for kind, marks in KINDS.items() if any(mark.lower() in name for mark in marks)), "other")


def decode_step_profile(engine, requests: list[dict], num_timed: int = 20) -> dict:
    """Start `requests` (all decoding once their prompts are in), then profile one eager decode step and time
    num_timed steps each way (eager, graph replay when the engine has graphs). On CPU (a dry run) no kernel is
    counted."""
    device = engine.runner.device
    start_decoding(engine, requests, 4 * num_timed + 8)
    runner, graphs = engine.runner, engine.runner.graphs
    runner.graphs = None                                               # eager steps first
    try:
        engine.step()
        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.step()
            sync(device)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset"))]
        busy, by_name = {}, {}
        for e in kernels:
            busy[kind_of(e.name)] = busy.get(kind_of(e.name), 0.0) + e.device_time
            count, us = by_name.get(e.name, (0, 0.0))
            by_name[e.name] = (count + 1, us + e.device_time)
        total = sum(busy.values()) or 1.0
        result = {"num_seqs": len(requests), "launches_per_step": len(kernels),
                  "kernels": {name[:60]: (count, round(us, 1)) for name, (count, us)
                              in sorted(by_name.items(), key=lambda item: -item[1][0])[:16]},
                  "launches_per_layer": len(kernels) / engine.model_config.num_layers,
                  "gpu_time_share": {kind: t / total for kind, t in sorted(busy.items())},
                  "gpu_busy_ms": sum(busy.values()) / 1e3,                  # the kernels' own time, eager
                  "step_ms_eager": _step_ms(engine, num_timed, device)}
    finally:
        runner.graphs = graphs
    if graphs is not None:
        result["step_ms_graph"] = _step_ms(engine, num_timed, device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.step()
            sync(device)
        calls = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU
                 and e.name.startswith(("cuda", "cu")) and ("Launch" in e.name or "Memcpy" in e.name)]
        result["graph_step_host_calls"] = {name: calls.count(name) for name in sorted(set(calls))}
    abort_all(engine)
    return result


def decode_step_ms(engine, requests: list[dict], num_timed: int = 20) -> float:
    """The wall time of a decode step of `requests` once their prompts are in (through the graphs where the engine
    has them)."""
    start_decoding(engine, requests, 2 * num_timed + 8)
    _step_ms(engine, 2, engine.runner.device)                          # steady: kept buffers, warm graphs
    ms = _step_ms(engine, num_timed, engine.runner.device)
    abort_all(engine)
    return ms


def start_decoding(engine, requests: list[dict], max_new_tokens: int) -> None:
    """Add the requests and step until every prompt is in."""
    for r in requests:
        engine.add_request(r["prompt"], lora=r.get("lora_task_id"), max_new_tokens=max_new_tokens,
                           ignore_end_id=True)
    while any(seq.num_computed_tokens < len(seq.prompt_ids) for members in engine.seqs.values() for seq in members):
        engine.step()


def abort_all(engine) -> None:
    for request_id in list(engine.seqs):
        engine.abort(request_id)
    while engine.has_unfinished:
        engine.step()


def _step_ms(engine, num_steps: int, device) -> float:
    sync(device)
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    sync(device)
    return (time.perf_counter() - start) / num_steps * 1e3


def decode_attention_vs_bound(cfg, bandwidth: float, num_seqs: int = 64, context: int = 1000,
                              num_iters: int = 50, device: str = "cuda") -> dict:
    """The Triton decode attention over num_seqs contexts of `context` tokens (bf16, 16-token pages, scattered
    through the pool) against the time to read their K and V once at the measured copy bandwidth."""
    from kernels.metadata import AttentionMetadata
    from kernels.paged_attention import paged_attention
    block_size = 16
    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(num_seqs, blocks_per_seq)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    meta = AttentionMetadata(starts, seq_lens, tables, torch.zeros(num_seqs, dtype=torch.int32, device=device),
                             list(range(num_seqs + 1)), [context] * num_seqs, 1, context)
    q = torch.randn(num_seqs, cfg.num_heads, cfg.head_dim, dtype=torch.bfloat16, device=device)
    paged_attention(q, k_cache, v_cache, meta, cfg.head_dim ** -0.5)
    sync(device)
    start = time.perf_counter()
    for _ in range(num_iters):
        paged_attention(q, k_cache, v_cache, meta, cfg.head_dim ** -0.5)
    sync(device)
    seconds = (time.perf_counter() - start) / num_iters
    kv_bytes = 2 * num_seqs * context * cfg.num_kv_heads * cfg.head_dim * 2
    bound = kv_bytes / (bandwidth / 2)                                 # the copy bandwidth counts read + write
    return {"num_seqs": num_seqs, "context": context, "us": seconds * 1e6, "bound_us": bound * 1e6,
            "vs_bound": seconds / bound}


def single_sequence_attention(cfg, contexts=(128, 256, 512, 1024, 2048), num_replays: int = 20,
                              device: str = "cuda") -> dict:
    """W3's attention: one sequence decoding over `contexts` tokens, one call a layer (each layer its own cache),
    replayed as a CUDA graph as a decode graph would: microseconds a layer at the split count the decode graphs
    use (bucket 1, the context's class) and at one split (no reduce kernel). What the split rule costs a single
    stream, for the next GPU run to settle. On CPU (a dry run, under the Triton interpreter) the calls run eagerly."""
    from backend.model.graphs import CONTEXT_CLASSES
    from kernels.metadata import AttentionMetadata
    from kernels.paged_attention import decode_graph_splits, paged_attention
    block_size, num_layers, dev = 16, cfg.num_layers, torch.device(device)
    classes = sorted({min(c, cfg.max_position_embeddings) for c in CONTEXT_CLASSES + (cfg.max_position_embeddings,)})
    q = torch.randn(1, cfg.num_heads, cfg.head_dim, dtype=torch.bfloat16, device=device)
    results = {}
    for context in contexts:
        context_class = next(c for c in classes if c >= context)
        splits = decode_graph_splits(1, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size, context_class, dev)
        num_blocks = -(-context // block_size)
        shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
        caches = [(torch.randn(shape, dtype=torch.bfloat16, device=device),
                   torch.randn(shape, dtype=torch.bfloat16, device=device)) for _ in range(num_layers)]
        meta = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32, device=device),
                                 torch.tensor([context], dtype=torch.int32, device=device),
                                 torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
                                 torch.zeros(1, dtype=torch.int32, device=device), [0, 1], [context], 1, context_class)
        case = {"graph_splits": splits}
        for label, num_splits in (("us_graph_splits", splits), ("us_one_split", 1)):
            def layers():
                for k, v in caches:
                    paged_attention(q, k, v, meta, cfg.head_dim ** -0.5, num_splits=num_splits)
            layers()                                                    # compiles, outside the capture
            sync(device)
            replay = layers
            if dev.type == "cuda":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    layers()
                replay = graph.replay
            replay()
            sync(device)
            start = time.perf_counter()
            for _ in range(num_replays):
                replay()
            sync(device)
            case[label] = (time.perf_counter() - start) / (num_replays * num_layers) * 1e6
        results[context] = case
    return results
