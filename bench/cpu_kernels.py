"""The compiled CPU kernels alone, at one decode step's shapes for the model (every layer's own operands, so they come
from memory as in a step): the GEMMs of every layer and the lm_head at a few row counts, decode attention over
paged caches, LoRA of 16 adapters over every band. Prints each one's median time and the rate it reads its operands
at, to judge a kernel change in isolation (docs/performance.md quotes it); the engine-level figures come from
scripts/bench.py.

    .venv/bin/python -m bench.cpu_kernels                         # SmolLM2-135M, ~15 s
    .venv/bin/python -m bench.cpu_kernels --kernels linear --rows 1,32,128
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from backend.lora.format import module_shape
from backend.lora.slots import BANDS, MAX_BANDS, PROJS, DeviceSlots, proj_shape
from backend.model.checkpoint import ModelConfig
from bench import ROOT
from kernels import cpu_ext
from kernels.lora.family import LoraFamily

LORA_RANKS = (8, 16, 32, 64) * 4          # W1's adapters, two decode tokens each
BLOCK_SIZE = 16


def median_ms(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench_linear(cfg: ModelConfig, rows: list[int], rounds: int) -> None:
    shapes = [proj_shape(cfg, proj) for proj in PROJS]                  # (in_dim, out_dim)
    layers = [[cpu_ext.pack_linear(torch.randn(n, k)) for k, n in shapes] for _ in range(cfg.num_layers)]
    head = cpu_ext.pack_linear(torch.randn(cfg.vocab_size // 16 * 16, cfg.hidden_size))
    weight_bytes = 4 * sum(p.numel() for ps in layers for p in ps) + 4 * head.numel()
    for m in rows:
        xs = [torch.randn(m, k) for k, _ in shapes]

        def step():
            for panels in layers:
                for x, p in zip(xs, panels):
                    cpu_ext.panel_linear(x, p, None)
            cpu_ext.panel_linear(xs[0], head, None)
        ms = median_ms(step, rounds)
        gflop = 2 * m * weight_bytes / 4 / 1e9
        print(f"linear    {m:4d} rows  {ms:7.1f} ms  {weight_bytes / ms / 1e6:5.1f} GB/s  "
              f"{gflop / ms * 1e3:6.1f} GFLOP/s")


def bench_attention(cfg: ModelConfig, num_seqs: int, context: int, shuffle_pages: bool, dtype: torch.dtype,
                    cache_dtype: torch.dtype, rounds: int) -> None:
    longest = context or 300
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32) if context else \
        torch.randint(100, 300, (num_seqs,), dtype=torch.int32)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32)           # one decode row each
    max_blocks = longest // BLOCK_SIZE + 1
    num_blocks = num_seqs * max_blocks
    shape = (cfg.num_kv_heads, num_blocks, BLOCK_SIZE, cfg.head_dim)
    order = torch.randperm if shuffle_pages else torch.arange
    layers = [(torch.randn(shape).to(cache_dtype), torch.randn(shape).to(cache_dtype),
               order(num_blocks).view(num_seqs, max_blocks).int()) for _ in range(cfg.num_layers)]
    q = torch.randn(num_seqs, cfg.num_heads, cfg.head_dim).to(dtype)
    kv_bytes = 2 * cache_dtype.itemsize * int(seq_lens.sum()) * cfg.kv_size * cfg.num_layers

    def step():
        for k_cache, v_cache, tables in layers:
            cpu_ext.paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, cfg.head_dim ** -0.5, None)
    ms = median_ms(step, rounds)
    pages = "shuffled" if shuffle_pages else "in order"
    contexts = context if context else "100-300"
    print(f"attention {num_seqs:4d} seqs  {ms:7.2f} ms  {kv_bytes / ms / 1e6:5.1f} GB/s  (contexts {contexts}, "
          f"pages {pages}, {str(dtype).removeprefix('torch.')} q, {str(cache_dtype).removeprefix('torch.')} cache, "
          f"{cfg.num_layers} layers)")


def bench_lora(cfg: ModelConfig, rounds: int) -> None:
    num_slots, max_rank = len(LORA_RANKS), max(LORA_RANKS)
    family = LoraFamily.of("cpu", "cpu")                                                   # the compiled kernels'
    slots = DeviceSlots(cfg, num_slots, max_rank, torch.float16, family=family)
    for layer in range(cfg.num_layers):
        for proj in PROJS:
            slots.a[layer][proj].normal_(0, 0.05)
            slots.b[layer][proj].normal_(0, 0.05)
    for band in range(MAX_BANDS):
        slots.ranks[:, :, band] = torch.tensor(LORA_RANKS, dtype=torch.int32)
    segments = family.segments([slot for slot in range(num_slots) for _ in range(2)], torch.float32)
    xs = {proj: torch.randn(2 * num_slots, proj_shape(cfg, proj)[0]) for proj in PROJS}
    outs = {proj: torch.zeros(2 * num_slots, proj_shape(cfg, proj)[1]) for proj in PROJS}
    bands = [module_shape(cfg, module) for modules in BANDS.values() for module in modules]   # (in_dim, out_dim)
    adapter_bytes = 2 * sum(r * (i + o) for r in LORA_RANKS for i, o in bands) * cfg.num_layers

    def step():
        for projections in slots.projections:
            for proj, projection in projections.items():
                cpu_ext.lora_apply(xs[proj], projection, segments, outs[proj])
    ms = median_ms(step, rounds)
    print(f"lora      {num_slots:4d} fp16 adapters (ranks 8-64, 2 tokens each, 7 modules)  {ms:7.1f} ms  "
          f"{adapter_bytes / ms / 1e6:5.1f} GB/s")


def main(doc: str = __doc__) -> None:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--kernels", default="linear,attention,lora", help="a comma list of linear, attention, lora")
    parser.add_argument("--rows", default="1,16,32,128,512", help="the GEMMs' row counts")
    parser.add_argument("--seqs", type=int, default=32, help="decode attention's sequences")
    parser.add_argument("--context", type=int, default=0, help="decode attention's context (0: 100-300 at random)")
    parser.add_argument("--shuffle-pages", action="store_true", help="each sequence's KV pages scattered")
    parser.add_argument("--dtype", default="float32", help="decode attention's queries")
    parser.add_argument("--cache-dtype", default=None, help="decode attention's cache (default: --dtype; bfloat16 "
                        "beside float32 as dtype auto serves where the CPU has no bf16 arithmetic)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    cfg = ModelConfig.from_hf(json.loads((Path(args.model_dir) / "config.json").read_text()))
    torch.manual_seed(0)
    kernels = args.kernels.split(",")
    if "linear" in kernels:
        bench_linear(cfg, [int(m) for m in args.rows.split(",")], args.rounds)
    if "attention" in kernels:
        dtype = getattr(torch, args.dtype)
        bench_attention(cfg, args.seqs, args.context, args.shuffle_pages, dtype,
                        getattr(torch, args.cache_dtype) if args.cache_dtype else dtype, args.rounds)
    if "lora" in kernels:
        bench_lora(cfg, args.rounds)


if __name__ == "__main__":
    main()
