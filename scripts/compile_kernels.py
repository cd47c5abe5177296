"""Compile every Triton kernel, in every configuration the launchers can choose, ahead of time for real GPUs
(PTX and cubin, no GPU needed), and check shared memory against each device's limit.

    python scripts/compile_kernels.py [--targets 80,90] [--jobs 2]
Exit status 1 if any configuration fails to compile or needs more shared memory than the device has.
"""
import argparse
import itertools
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)          # compile for real: the interpreter has no compiler
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHARED_LIMIT = {80: 164 * 1024, 90: 228 * 1024}   # bytes per block (A100, H100)
DTYPES = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (16, 32)


def configurations():
    """(label, module, kernel name, signature, constexprs) for every choice the launchers make."""
    from kernels.kv_cache import write_kv_config
    from kernels.lora import expand_config, shrink_config
    from kernels.paged_attention import decode_config, prefill_config
    from kernels.rotary import rotary_config
    i32 = "i32"
    for dtype, head_dim in itertools.product(DTYPES, HEAD_DIMS):
        p = DTYPES[dtype]
        yield (f"write_kv {dtype} d{head_dim}", "kernels.kv_cache", "_write_kv_kernel",
               dict(k_ptr=p, v_ptr=p, k_cache_ptr=p, v_cache_ptr=p, slot_ptr="*i64", stride_kt=i32, stride_kh=i32,
                    stride_vt=i32, stride_vh=i32, stride_ch=i32, stride_cs=i32), write_kv_config(head_dim))
        yield (f"rotary {dtype} d{head_dim}", "kernels.rotary", "_rotary_kernel",
               dict(x_ptr=p, out_ptr=p, pos_ptr="*i64", cos_sin_ptr="*fp32", stride_xt=i32, stride_xh=i32,
                    stride_ot=i32, stride_oh=i32, stride_cs=i32), rotary_config(head_dim))
        attn = dict(q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, out_ptr=p)
        meta = dict(block_tables_ptr="*i32", query_starts_ptr="*i32", seq_lens_ptr="*i32", scale="fp32", window=i32,
                    stride_qt=i32, stride_qh=i32, stride_ot=i32, stride_oh=i32, stride_ch=i32, stride_cb=i32,
                    stride_cs=i32, stride_bt=i32)
        for block_size in BLOCK_SIZES:
            yield (f"prefill {dtype} d{head_dim} bs{block_size}", "kernels.paged_attention", "_prefill_kernel",
                   attn | meta, prefill_config(head_dim, block_size) | {"GROUP": 4, "DOT_FP32": False})
            for max_seq_len in (512, 8192):        # no split-K, and the largest split count
                cfg = decode_config(head_dim, block_size, 4, 1, 1, max_seq_len)
                yield (f"decode {dtype} d{head_dim} bs{block_size} splits{cfg['NUM_SPLITS']}",
                       "kernels.paged_attention", "_decode_kernel",
                       attn | dict(part_acc_ptr="*fp32", part_ml_ptr="*fp32") | meta, cfg | {"DOT_FP32": False})
        yield (f"decode_reduce {dtype} d{head_dim}", "kernels.paged_attention", "_decode_reduce_kernel",
               dict(out_ptr=p, part_acc_ptr="*fp32", part_ml_ptr="*fp32", query_starts_ptr="*i32", stride_ot=i32,
                    stride_oh=i32), {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "NUM_SPLITS": 16})
    for dtype in DTYPES:
        p = DTYPES[dtype]
        seg = dict(seg_starts_ptr="*i32", seg_slots_ptr="*i32", ranks_ptr="*i32")
        yield (f"lora_shrink {dtype}", "kernels.lora", "_shrink_kernel",
               dict(x_ptr=p, a_ptr=p, h_ptr=p) | seg | dict(in_dim=i32, stride_xt=i32, stride_as=i32,
                                                             stride_ar=i32, stride_ak=i32, stride_ht=i32),
               shrink_config(4096) | {"DOT_FP32": False})
        yield (f"lora_expand {dtype}", "kernels.lora", "_expand_kernel",
               dict(h_ptr=p, b_ptr=p, out_ptr=p) | seg | dict(out_dim=i32, stride_ht=i32, stride_bs=i32,
                                                              stride_bn=i32, stride_bk=i32, stride_ot=i32),
               expand_config(4096) | {"DOT_FP32": False})


def compile_one(job) -> tuple[str, int, int | None, str]:
    label, module, kernel, signature, constexprs, cc = job
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = getattr(importlib.import_module(module), kernel)
    try:
        src = ASTSource(fn=fn, signature=signature | {n: "constexpr" for n in constexprs}, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32))
        assert compiled.asm["cubin"]
        return label, cc, compiled.metadata.shared, ""
    except Exception as err:                       # report every failure, not just the first
        return label, cc, None, f"{type(err).__name__}: {str(err)[:300]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="80,90")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    jobs = [c + (int(cc),) for cc in args.targets.split(",") for c in configurations()]
    failures = 0
    with ProcessPoolExecutor(args.jobs) as pool:
        for label, cc, shared, error in pool.map(compile_one, jobs):
            ok = not error and shared <= SHARED_LIMIT[cc]
            failures += not ok
            detail = error or f"shared {shared} B (limit {SHARED_LIMIT[cc]})"
            print(f"{'ok  ' if ok else 'FAIL'} sm_{cc} {label:40s} {detail}", flush=True)
    print(f"{len(jobs) - failures} compiled, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
