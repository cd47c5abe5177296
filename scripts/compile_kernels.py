"""Compile every Triton kernel, in every configuration the launchers can choose, ahead of time for real GPUs
(PTX and cubin, no GPU needed), and check shared memory against each device's limit.

    python scripts/compile_kernels.py [--targets 80,90] [--jobs 2] [--resources]
--resources adds what ptxas (Triton's own) reports for each: registers per thread, spilled bytes, shared memory,
and the occupancy bound they give (warps per SM of 64). Exit status 1 if any configuration fails to compile or
needs more shared memory than the device has, and (with --resources) if a hot configuration spills.
"""
import argparse
import itertools
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)          # compile for real: the interpreter has no compiler
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernels.aot import (MAX_WARPS_PER_SM, SHARED_LIMIT, compile_kernel, occupancy_warps,  # noqa: E402,F401
                         resources, runtime_signature)

DTYPES = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}
HEAD_DIMS = (64, 80, 96, 128)                     # Llama/Mistral/Qwen2 128, SmolLM2 64, Phi-like 80/96
BLOCK_SIZES = tuple(2 ** i for i in range(9))     # every kv_block_size EngineConfig accepts: 1 ... 256
GROUPS = tuple(range(1, 9))                       # query heads per KV head
SPLITS = (1, 2, 4, 8, 16)                         # split-K counts num_kv_splits can choose
LORA_KERNELS = "kernels.lora.triton_kernels"


def attention_args(p: str, head_dim: int, block_size: int, group: int) -> dict:
    """Launch arguments of the attention kernel for a contiguous cache of 1000 blocks, 8 KV heads, q sliced from
    a fused qkv projection (as the model passes it)."""
    num_kv_heads, num_blocks, max_blocks = 8, 1000, 37
    num_heads = num_kv_heads * group
    qkv_width = (num_heads + 2 * num_kv_heads) * head_dim
    return dict(q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, out_ptr=p, part_acc_ptr="*fp32", part_ml_ptr="*fp32",
                block_tables_ptr="*i32", query_starts_ptr="*i32", seq_lens_ptr="*i32", num_seqs=7, scale=0.125,
                v_scale=1.0, window=0, softcap=50.0, stride_qt=qkv_width, stride_qh=head_dim,
                stride_ot=num_heads * head_dim, stride_oh=head_dim,
                stride_ch=num_blocks * block_size * head_dim, stride_cb=block_size * head_dim, stride_cs=head_dim,
                stride_bt=max_blocks)


QUANTIZED_CACHES = {"int8": ("*i8", 1), "fp8": ("*u8", 2)}     # kv_cache_dtype -> the caches' pointer type, QUANT


def attention_configurations(dtype: str, head_dim: int, block_size: int, group: int, splits=(1, 16),
                             softcap: bool = False, cache: str | None = None):
    """The tiles a decode step and a step with prompt chunks choose, each unsplit and split (softcap: scores
    soft-capped, Gemma 2; cache: an INT8 or FP8 KV cache)."""
    from kernels.paged_attention import attention_config
    p, tag = DTYPES[dtype], f"{dtype} d{head_dim} bs{block_size} g{group}" + (" softcap" if softcap else "")
    tag += f" {cache}-cache" if cache else ""
    pointer, quant = QUANTIZED_CACHES[cache] if cache else (p, 0)
    caches = {"k_cache_ptr": pointer, "v_cache_ptr": pointer} if cache else {}
    for step, max_query_len in (("decode", 1), ("prefill", 512)):
        cfg = attention_config(head_dim, block_size, group, max_query_len) | {"DOT_FP32": False, "SOFTCAP": softcap,
                                                                              "QUANT": quant}
        for num_splits in splits:
            yield (f"attention {step} {tag} splits{num_splits}", "kernels.paged_attention", "_attention_kernel",
                   attention_args(p, head_dim, block_size, group) | caches, cfg | {"NUM_SPLITS": num_splits})


def lora_delta_args(p: str, lora: bool) -> dict:
    """The pointers of a LoRA delta a fused op adds (fused.delta_args), stand-ins without one."""
    return dict(delta_ptr="*fp32", m_ptr=p, slots_ptr="*i32") if lora else dict(delta_ptr=p, m_ptr=p, slots_ptr=p)


def configurations():
    """(label, module, kernel name, runtime arguments, constexprs) for every choice the launchers make: each
    dtype x head dim at the default page, then every page size, GQA group and split count."""
    from kernels.fused import norm_config, rotary_config, silu_config
    for dtype in DTYPES:
        p = DTYPES[dtype]
        for hidden, lora in itertools.product((576, 4096, 8192), (False, True)):
            delta = lora_delta_args(p, lora)
            yield (f"add_rms_norm {dtype} h{hidden}" + (" lora" if lora else ""), "kernels.fused",
                   "_add_rms_norm_kernel",
                   dict(x_ptr=p, residual_ptr=p, weight_ptr=p, out_ptr=p, **delta, hidden=hidden, eps=1e-5,
                        stride_xt=hidden, stride_rt=hidden, stride_ot=hidden, stride_dt=hidden, stride_ms=hidden),
                   norm_config(hidden) | {"HAS_RESIDUAL": True, "HAS_DELTA": lora})
            if hidden == 4096:
                yield (f"silu_and_mul {dtype}" + (" lora" if lora else ""), "kernels.fused", "_silu_and_mul_kernel",
                       dict(gate_up_ptr=p, out_ptr=p, **delta, inter=14336, stride_gt=2 * 14336, stride_ot=14336,
                            stride_dt=2 * 14336, stride_ms=2 * 14336), silu_config() | {"HAS_DELTA": lora})
    for dtype, head_dim in itertools.product(DTYPES, HEAD_DIMS):
        p, width = DTYPES[dtype], 48 * head_dim
        for lora, cache in itertools.product((False, True), (None, "int8", "fp8")):
            pointer, quant = QUANTIZED_CACHES[cache] if cache else (p, 0)
            yield (f"rotary_and_cache {dtype} d{head_dim}" + (" lora" if lora else "")
                   + (f" {cache}-cache" if cache else ""), "kernels.fused", "_rotary_and_cache_kernel",
                   dict(q_ptr=p, k_ptr=p, v_ptr=p, q_out_ptr=p, k_cache_ptr=pointer, v_cache_ptr=pointer,
                        pos_ptr="*i32",
                        slot_ptr="*i32", cos_sin_ptr="*fp32", **lora_delta_args(p, lora), num_heads=32,
                        num_kv_heads=8, stride_qt=width, stride_qh=head_dim, stride_kt=width, stride_kh=head_dim,
                        stride_vt=width, stride_vh=head_dim, stride_ot=32 * head_dim, stride_oh=head_dim,
                        stride_ch=16000 * head_dim, stride_cs=head_dim, stride_cos=head_dim, stride_dt=width,
                        stride_ms=width, inv_k=8.0, inv_v=8.0),
                   rotary_config(head_dim, 32 + 8, cache is not None) | {"HAS_DELTA": lora, "QUANT": quant})
        yield from attention_configurations(dtype, head_dim, 16, 4)
        for cache in QUANTIZED_CACHES:
            yield from attention_configurations(dtype, head_dim, 16, 4, cache=cache)
        yield (f"attention_reduce {dtype} d{head_dim}", "kernels.paged_attention", "_reduce_kernel",
               dict(out_ptr=p, part_acc_ptr="*fp32", part_ml_ptr="*fp32", stride_ot=32 * head_dim, stride_oh=head_dim),
               {"HEAD_DIM": head_dim, "BLOCK_D": 1 << (head_dim - 1).bit_length(), "NUM_SPLITS": 16})
    for block_size in BLOCK_SIZES:
        if block_size != 16:
            yield from attention_configurations("bf16", 128, block_size, 4)
    for group in GROUPS:
        if group != 4:
            yield from attention_configurations("bf16", 128, 16, group)
    yield from attention_configurations("fp32", 64, 16, 3, splits=SPLITS[1:-1])
    for softcap in (False, True):                  # Gemma 3 4B's and Gemma 2 9B's heads: 256 wide, 2 to a KV head
        yield from attention_configurations("bf16", 256, 16, 2, softcap=softcap)
        for cache in QUANTIZED_CACHES:
            yield from attention_configurations("bf16", 256, 16, 2, softcap=softcap, cache=cache)
    yield from lora_configurations()
    yield from moe_configurations()
    yield from int8_configurations()
    yield from grouped_configurations()


MOE_SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}   # hidden, inter, experts, k


def moe_configurations():
    """The mixture's grouped GEMMs at Qwen3-30B-A3B's and Mixtral-8x7B's shapes, for a decode step of 64 tokens and
    a prompt chunk of 2048, in every dtype: gate and up, then down with the routing weights; and with adapters on
    the experts (8 slots, max_lora_rank 16 and 64), their shrinks (gate and up at once) and expands (into the
    base's output, down's times the weights)."""
    from kernels.moe import lora_config, moe_config

    def args(p: str, a: str, b: str, n_dim: int, k_dim: int, rows: int, rows_per_a: int, weights: bool,
             stride_at: int, stride_ct: int) -> dict:
        return dict(a_ptr=a, b_ptr=b, c_ptr=p, sorted_rows_ptr="*i32", block_experts_ptr="*i32",
                    weights_ptr="*fp32" if weights else p, num_rows=rows, n_dim=n_dim, k_dim=k_dim,
                    rows_per_a=rows_per_a, stride_at=stride_at, stride_be=n_dim * k_dim, stride_bn=k_dim,
                    stride_bk=1, stride_ct=stride_ct)

    for (name, (hidden, inter, experts, top_k)), dtype, tokens in itertools.product(MOE_SHAPES.items(), DTYPES,
                                                                                    (64, 2048)):
        p, rows = DTYPES[dtype], tokens * top_k
        cfg = moe_config(rows, experts, 4 if dtype == "fp32" else 2)
        tag = f"{dtype} {name} t{tokens}"
        for launch, n_dim, k_dim, rows_per_a, weights in (("gate_up", 2 * inter, hidden, top_k, False),
                                                          ("down", hidden, inter, 1, True)):
            yield (f"moe_{launch} {tag}", "kernels.moe", "_grouped_gemm_kernel",
                   args(p, p, p, n_dim, k_dim, rows, rows_per_a, weights, k_dim, n_dim),
                   dict(cfg) | {"MUL_WEIGHTS": weights, "ACCUMULATE": False, "DOT_FP32": False})
        adapters = "*fp16" if dtype == "fp32" else p                  # (lora_dtype auto: fp16 beside fp32)
        for rank in (16, 64):
            lora_tag = f"{tag} r{rank}"
            for launch, n_dim, k_dim, rows_per_a in (("shrink_gate_up", 2 * rank, hidden, top_k),
                                                     ("shrink_down", rank, inter, 1)):
                yield (f"moe_lora_{launch} {lora_tag}", "kernels.moe", "_grouped_gemm_kernel",
                       args(p, p, adapters, n_dim, k_dim, rows, rows_per_a, False, k_dim, n_dim),
                       dict(cfg) | {"MUL_WEIGHTS": False, "ACCUMULATE": False, "DOT_FP32": False})
            for launch, n_dim, stride_at, stride_ct, weights in (("expand_gate_up", inter, 2 * rank, 2 * inter, False),
                                                                 ("expand_down", hidden, rank, hidden, True)):
                yield (f"moe_lora_{launch} {lora_tag}", "kernels.moe", "_grouped_gemm_kernel",
                       args(p, p, adapters, n_dim, rank, rows, 1, weights, stride_at, stride_ct),
                       lora_config(dict(cfg), rank) | {"MUL_WEIGHTS": weights, "ACCUMULATE": True, "DOT_FP32": False})


INT8_SHAPES = {"8b qkv": (4096, 6144), "8b o": (4096, 4096), "8b gate_up": (4096, 28672), "8b down": (14336, 4096)}


def int8_configurations():
    """The INT8 weight-only GEMM over each projection of Llama-3.1-8B, for a decode step of 16 rows and a prompt
    chunk of 2048, with fp16, bf16 and fp32 activations (and a bias: Qwen2's qkv)."""
    from kernels.gemm import int8_config
    for (shape, (k_dim, n_dim)), dtype, rows in itertools.product(INT8_SHAPES.items(), DTYPES, (16, 2048)):
        p = DTYPES[dtype]
        args = dict(x_ptr=p, w_ptr="*i8", scale_ptr="*fp32", bias_ptr=p, y_ptr=p, num_rows=rows, n_dim=n_dim,
                    k_dim=k_dim, stride_xm=k_dim, stride_wn=k_dim, stride_ym=n_dim)
        yield (f"int8_gemm {dtype} {shape} t{rows}", "kernels.gemm", "_int8_gemm_kernel", args,
               int8_config(rows, 4 if dtype == "fp32" else 2) | {"HAS_BIAS": shape == "8b qkv", "DOT_FP32": False})


def grouped_configurations():
    """The INT4 and FP8 weight-only GEMM over the same projections (INT4 in groups of 128, FP8 a scale a row and
    in 128-wide blocks; SmolLM2's qkv: INT4 in groups of 64, FP8 a row of 576), the same rows and dtypes; FP8's
    e4m3 x e4m3 dots (sm_89 on: MIN_CAPABILITY) and the activations' quantization before them (fp8_rows)."""
    from kernels.gemm import FP8_ROWS_BLOCK, grouped_config
    shapes = INT8_SHAPES | {"smollm2 qkv": (576, 960)}
    formats = {"int4": (False, 2, lambda k: 64 if k == 576 else 128), "fp8": (True, 1, lambda k: k),
               "fp8 blocks": (True, 1, lambda k: 64 if k == 576 else 128)}
    for (shape, (k_dim, n_dim)), dtype, rows, (name, (fp8, per_byte, group_of)), dots in itertools.product(
            shapes.items(), DTYPES, (16, 2048), formats.items(), (False, True)):
        if dots and not fp8:
            continue
        p, group_size = DTYPES[dtype], group_of(k_dim)
        args = dict(x_ptr="*u8" if dots else p, x_scale_ptr="*fp32", w_ptr="*u8", scale_ptr="*fp32", zero_ptr="*u8",
                    bias_ptr=p, y_ptr=p, num_rows=rows, n_dim=n_dim, k_dim=k_dim, group_size=group_size,
                    stride_xm=k_dim, stride_wn=k_dim // per_byte, stride_ym=n_dim)
        label = name.replace("fp8", "fp8_dots") if dots else name
        yield (f"{label.replace(' ', '_')}_gemm {dtype} {shape} t{rows}", "kernels.gemm",
               "_grouped_scale_gemm_kernel", args,
               grouped_config(rows, 4 if dtype == "fp32" and not dots else 1, group_size, k_dim)
               | {"FP8": fp8, "FP8_DOTS": dots, "HAS_BIAS": shape == "8b qkv", "DOT_FP32": False})
    for dtype, k_dim in itertools.product(DTYPES, (576, 4096, 14336)):
        yield (f"fp8_rows {dtype} k{k_dim}", "kernels.gemm", "_fp8_rows_kernel",
               dict(x_ptr=DTYPES[dtype], q_ptr="*u8", scale_ptr="*fp32", k_dim=k_dim, stride_xm=k_dim,
                    stride_qm=k_dim), {"BLOCK_K": min(FP8_ROWS_BLOCK, 1 << (k_dim - 1).bit_length())})


def lora_configurations():
    """Each projection of Llama-3.1-8B (and SmolLM2's qkv) as the launchers plan it for a decode step (16 rows) and
    a prompt chunk (512: 64-row items), max_lora_rank 64 and 16 (and 128 at 8B decode), in every dtype pairing; and
    band widths no multiple of 16 (an intermediate size of 344, a head dim of 72: the expand's masked groups)."""
    import torch

    from kernels.lora.launch import block_m_for, max_work_items, plan_launch
    from bench.lora_plan import launch_args
    shapes = {"8b qkv": (4096, [4096, 1024, 1024]), "8b o": (4096, [4096]), "8b gate_up": (4096, [14336, 14336]),
              "8b down": (14336, [4096]), "smollm2 qkv": (576, [576, 192, 192]), "odd gate_up": (96, [344, 344]),
              "odd qkv": (96, [216, 72, 72])}
    cases = [(shape, tokens, 64) for shape in shapes if not shape.startswith("odd") for tokens in (16, 512)]
    cases += [("odd gate_up", 16, 64), ("odd qkv", 512, 64)]
    cases += [("8b qkv", 16, 16), ("8b down", 16, 16), ("8b qkv", 16, 128)]
    for dtype, weight_dtype in [("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "fp32"), ("fp32", "fp16")]:
        for shape, tokens, max_rank in cases:
            in_dim, widths = shapes[shape]
            block_m = block_m_for(tokens, torch.float32 if dtype == "fp32" else torch.bfloat16)
            launch = plan_launch(tokens, max_work_items(tokens, 18, block_m), in_dim, widths, max_rank, block_m,
                                 act_bytes=4 if dtype == "fp32" else 2)
            shrink, expand, merge = launch_args(launch, tokens, DTYPES[dtype], DTYPES[weight_dtype])
            tag = f"{dtype} adapters {weight_dtype} {shape} r{max_rank} t{tokens}"
            yield (f"lora_shrink {tag}", LORA_KERNELS, "_shrink_kernel", shrink,
                   launch.shrink_constexprs | launch.shrink_options | {"DOT_FP32": False})
            yield (f"lora_expand {tag}", LORA_KERNELS, "_expand_kernel", expand,
                   launch.expand_constexprs | launch.expand_options | {"DELTA": False, "DOT_FP32": False})
            delta = launch_args(launch, tokens, DTYPES[dtype], DTYPES[weight_dtype], delta=True)[1]
            yield (f"lora_expand_delta {tag}", LORA_KERNELS, "_expand_kernel", delta,     # beside the GEMM
                   launch.expand_constexprs | launch.expand_options | {"DELTA": True, "DOT_FP32": False})
            yield (f"lora_merge {tag}", LORA_KERNELS, "_merge_kernel", merge,
                   launch.merge_constexprs | launch.merge_options)


HOT = ("attention decode bf16 d128 bs16 g4", "lora_shrink bf16", "lora_expand bf16", "lora_expand_delta bf16",
       "lora_merge bf16", "add_rms_norm bf16", "silu_and_mul bf16", "rotary_and_cache bf16 d128",   # an 8B decode
       "moe_gate_up bf16", "moe_down bf16", "moe_lora_shrink_gate_up bf16", "moe_lora_shrink_down bf16",  # step;
       "moe_lora_expand_gate_up bf16", "moe_lora_expand_down bf16",                            # a mixture's, adapted
       "int8_gemm bf16", "int4_gemm bf16", "fp8_gemm bf16", "fp8_dots_gemm bf16",   # INT8, INT4 and FP8 weights
       "fp8_rows bf16")
MIN_CAPABILITY = {"fp8_dots": 89}                          # e4m3 tensor-core dots: Ada and Hopper on


def supported(label: str, cc: int) -> bool:
    return all(cc >= least for prefix, least in MIN_CAPABILITY.items() if label.startswith(prefix))


def compile_one(job) -> tuple[str, int, int | None, str, dict]:
    label, module, kernel, args, constexprs, cc, with_resources = job
    options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages") if k in constexprs}
    try:
        compiled = compile_kernel(module, kernel, args, constexprs, cc, options)
        assert compiled.asm["cubin"]
        report = resources(compiled, cc) if with_resources else {}
        return label, cc, compiled.metadata.shared, "", report
    except Exception as err:                       # report every failure, not just the first
        return label, cc, None, f"{type(err).__name__}: {str(err)[:300]}", {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="80,90")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--resources", action="store_true", help="registers, spills and occupancy from ptxas -v")
    parser.add_argument("--only", help="configurations whose label starts with one of these (a comma list; 'hot': "
                                       "what an 8B decode step runs)")
    args = parser.parse_args()
    only = HOT if args.only == "hot" else tuple(args.only.split(",")) if args.only else ("",)
    jobs = [c + (int(cc), args.resources) for cc in args.targets.split(",") for c in configurations()
            if c[0].startswith(only) and supported(c[0], int(cc))]
    failures = 0
    with ProcessPoolExecutor(args.jobs) as pool:
        for label, cc, shared, error, report in pool.map(compile_one, jobs):
            ok = not error and shared <= SHARED_LIMIT[cc]
            hot_spill = report.get("spill_bytes", 0) > 0 and label.startswith(HOT)
            failures += not ok or hot_spill
            detail = error or f"shared {shared} B (limit {SHARED_LIMIT[cc]})"
            if report:
                detail += (f", {report['registers']} registers, {report['spill_bytes']} B spilled, "
                           f"{report['num_warps']} warps: {report['warps_per_sm']}/{MAX_WARPS_PER_SM} warps per SM"
                           + (" (a hot configuration spills)" if hot_spill else ""))
            print(f"{'ok  ' if ok and not hot_spill else 'FAIL'} sm_{cc} {label:44s} {detail}", flush=True)
    print(f"{len(jobs) - failures} compiled, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
