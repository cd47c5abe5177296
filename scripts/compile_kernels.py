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
import re
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)          # compile for real: the interpreter has no compiler
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHARED_LIMIT = {80: 164 * 1024, 90: 228 * 1024}   # bytes per block (A100, H100)
DTYPES = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}
HEAD_DIMS = (64, 80, 96, 128)                     # Llama/Mistral/Qwen2 128, SmolLM2 64, Phi-like 80/96
BLOCK_SIZES = tuple(2 ** i for i in range(9))     # every kv_block_size EngineConfig accepts: 1 ... 256
GROUPS = tuple(range(1, 9))                       # query heads per KV head
SPLITS = (1, 2, 4, 8, 16)                         # split-K counts num_kv_splits can choose


def runtime_signature(args: dict, fixed: set[str] = frozenset()) -> tuple[dict, dict, dict]:
    """Signature, specialization attributes and extra constexprs as Triton's launcher derives them from the
    values it is given: an int equal to 1 becomes a constant, an int divisible by 16 and every pointer (the
    staging buffer's views and torch's allocations start 16-byte aligned) get tt.divisibility=16; ints the kernel
    names in do_not_specialize (`fixed`) get neither. Pointers are given as their type string ("*bf16")."""
    signature, attrs, constants = {}, {}, {}
    for i, (name, value) in enumerate(args.items()):
        if isinstance(value, str):
            signature[name], attrs[(i,)] = value, [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif name in fixed:
            signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
        elif value == 1:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs, constants


def attention_args(p: str, head_dim: int, block_size: int, group: int) -> dict:
    """Launch arguments of the attention kernel for a contiguous cache of 1000 blocks, 8 KV heads, q sliced from
    a fused qkv projection (as the model passes it)."""
    num_kv_heads, num_blocks, max_blocks = 8, 1000, 37
    num_heads = num_kv_heads * group
    qkv_width = (num_heads + 2 * num_kv_heads) * head_dim
    return dict(q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, out_ptr=p, part_acc_ptr="*fp32", part_ml_ptr="*fp32",
                block_tables_ptr="*i32", query_starts_ptr="*i32", seq_lens_ptr="*i32", num_seqs=7, scale=0.125,
                window=0, stride_qt=qkv_width, stride_qh=head_dim, stride_ot=num_heads * head_dim, stride_oh=head_dim,
                stride_ch=num_blocks * block_size * head_dim, stride_cb=block_size * head_dim, stride_cs=head_dim,
                stride_bt=max_blocks)


def attention_configurations(dtype: str, head_dim: int, block_size: int, group: int, splits=(1, 16)):
    """The tiles a decode step and a step with prompt chunks choose, each unsplit and split."""
    from kernels.paged_attention import attention_config
    p, tag = DTYPES[dtype], f"{dtype} d{head_dim} bs{block_size} g{group}"
    for step, max_query_len in (("decode", 1), ("prefill", 512)):
        cfg = attention_config(head_dim, block_size, group, max_query_len) | {"DOT_FP32": False}
        for num_splits in splits:
            yield (f"attention {step} {tag} splits{num_splits}", "kernels.paged_attention", "_attention_kernel",
                   attention_args(p, head_dim, block_size, group), cfg | {"NUM_SPLITS": num_splits})


def configurations():
    """(label, module, kernel name, runtime arguments, constexprs) for every choice the launchers make: each
    dtype x head dim at the default page, then every page size, GQA group and split count."""
    from kernels.fused import norm_config, rotary_config, silu_config
    from kernels.lora import expand_config, shrink_config
    for dtype in DTYPES:
        p = DTYPES[dtype]
        for hidden in (576, 4096, 8192):
            yield (f"add_rms_norm {dtype} h{hidden}", "kernels.fused", "_add_rms_norm_kernel",
                   dict(x_ptr=p, residual_ptr=p, weight_ptr=p, out_ptr=p, hidden=hidden, eps=1e-5, stride_xt=hidden,
                        stride_rt=hidden, stride_ot=hidden), norm_config(hidden) | {"HAS_RESIDUAL": True})
        yield (f"silu_and_mul {dtype}", "kernels.fused", "_silu_and_mul_kernel",
               dict(gate_up_ptr=p, out_ptr=p, inter=14336, stride_gt=2 * 14336, stride_ot=14336), silu_config())
    for dtype, head_dim in itertools.product(DTYPES, HEAD_DIMS):
        p, width = DTYPES[dtype], 48 * head_dim
        yield (f"rotary_and_cache {dtype} d{head_dim}", "kernels.fused", "_rotary_and_cache_kernel",
               dict(q_ptr=p, k_ptr=p, v_ptr=p, q_out_ptr=p, k_cache_ptr=p, v_cache_ptr=p, pos_ptr="*i32",
                    slot_ptr="*i32", cos_sin_ptr="*fp32", num_heads=32, stride_qt=width, stride_qh=head_dim,
                    stride_kt=width, stride_kh=head_dim, stride_vt=width, stride_vh=head_dim,
                    stride_ot=32 * head_dim, stride_oh=head_dim, stride_ch=16000 * head_dim, stride_cs=head_dim,
                    stride_cos=head_dim), rotary_config(head_dim))
        yield from attention_configurations(dtype, head_dim, 16, 4)
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
    seg = dict(seg_starts_ptr="*i32", seg_slots_ptr="*i32", ranks_ptr="*i32")
    in_dim, max_rank, bands, num_slots = 4096, 64, 3, 8                 # an 8B qkv projection, as stored on GPU
    cap, out_dim = bands * max_rank, 6144
    for dtype, weight_dtype in [("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "fp32"), ("fp32", "fp16")]:
        p, w, tag = DTYPES[dtype], DTYPES[weight_dtype], f"{dtype} adapters {weight_dtype}"
        for num_tokens in (8, 512):                                       # a decode step (split-K) and a prompt chunk
            cfg = shrink_config(in_dim, num_tokens) | {"DOT_FP32": False}
            yield (f"lora_shrink {tag} splitk{cfg['SPLIT_K']}", "kernels.lora", "_shrink_kernel",
                   dict(x_ptr=p, a_ptr=w, h_ptr="*fp32") | seg | dict(
                       in_dim=in_dim, cap=cap, max_rank=max_rank, stride_xt=in_dim, stride_as=cap * in_dim,
                       stride_ar=in_dim, stride_ak=1, stride_rb=num_slots, stride_hs=num_tokens * cap, stride_ht=cap),
                   cfg)
            yield (f"lora_expand {tag} splitk{cfg['SPLIT_K']}", "kernels.lora", "_expand_kernel",
                   dict(h_ptr="*fp32", b_ptr=w, out_ptr=p) | seg | dict(
                       bounds_ptr="*i32", max_rank=max_rank, num_n_blocks=64, stride_hs=num_tokens * cap,
                       stride_ht=cap, stride_bs=out_dim * cap, stride_bn=cap, stride_bk=1, stride_rb=num_slots,
                       stride_ot=out_dim),
                   expand_config() | {"SPLIT_K": cfg["SPLIT_K"], "DOT_FP32": False})


HOT = ("attention decode bf16 d128 bs16 g4", "lora_shrink bf16", "lora_expand bf16", "add_rms_norm bf16",
       "silu_and_mul bf16", "rotary_and_cache bf16 d128")      # what an 8B decode step runs
REGISTERS_PER_SM, MAX_WARPS_PER_SM, MAX_BLOCKS_PER_SM = 65536, 64, 32


def ptxas_report(ptx: str) -> dict:
    """Registers per thread and spilled bytes of a kernel, from `ptxas -v` (Triton's bundled ptxas)."""
    import tempfile

    import triton
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    arch = re.search(r"^\.target\s+(sm_\w+)", ptx, re.MULTILINE).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        out = subprocess.run([str(ptxas), "-v", "--gpu-name", arch, str(Path(tmp) / "k.ptx"), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True, check=True).stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", out)]
    return {"registers": int(re.search(r"Used (\d+) registers", out).group(1)), "spill_bytes": sum(spills)}


def occupancy_warps(registers: int, shared: int, num_warps: int, cc: int) -> int:
    """Resident warps per SM that the registers and shared memory allow (CUDA's occupancy rules: registers in
    units of 256 per warp, 1 KiB of shared memory reserved per block)."""
    per_warp = -(-registers * 32 // 256) * 256
    blocks = min(MAX_BLOCKS_PER_SM, REGISTERS_PER_SM // per_warp // num_warps, MAX_WARPS_PER_SM // num_warps)
    if shared:
        blocks = min(blocks, SHARED_LIMIT[cc] // (shared + 1024))
    return blocks * num_warps


def compile_one(job) -> tuple[str, int, int | None, str, dict]:
    label, module, kernel, args, constexprs, cc, resources = job
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = getattr(importlib.import_module(module), kernel)
    try:
        fixed = {p.name for p in fn.params if p.do_not_specialize}
        signature, attrs, constants = runtime_signature(args, fixed)
        signature |= {name: "constexpr" for name in constexprs}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs | constants, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32))
        assert compiled.asm["cubin"]
        report = {}
        if resources:
            report = ptxas_report(compiled.asm["ptx"]) | {"num_warps": compiled.metadata.num_warps}
            report["warps_per_sm"] = occupancy_warps(report["registers"], compiled.metadata.shared,
                                                     report["num_warps"], cc)
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
            if c[0].startswith(only)]
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
