"""Triton kernels compiled ahead of time for real GPUs (PTX and cubin, no GPU needed), with the resources ptxas
reports and the occupancy they allow: what scripts/compile_kernels.py and the LoRA cost plan (bench/lora_plan.py)
read. Run without TRITON_INTERPRET (the interpreter has no compiler)."""
import importlib
import re
import subprocess
import tempfile
from pathlib import Path

SHARED_LIMIT = {80: 164 * 1024, 89: 99 * 1024, 90: 228 * 1024}   # bytes per block (A100, L40S, H100)
REGISTERS_PER_SM, MAX_WARPS_PER_SM, MAX_BLOCKS_PER_SM = 65536, 64, 32


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


def compile_kernel(module: str, kernel: str, args: dict, constexprs: dict, cc: int, options: dict | None = None):
    """The kernel compiled for compute capability cc with these runtime arguments and constexprs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = getattr(importlib.import_module(module), kernel)
    fixed = {p.name for p in fn.params if p.do_not_specialize}
    signature, attrs, constants = runtime_signature(args, fixed)
    signature |= {name: "constexpr" for name in constexprs}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs | constants, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options or {})


def ptxas_report(ptx: str) -> dict:
    """Registers per thread and spilled bytes of a kernel, from `ptxas -v` (Triton's bundled ptxas)."""
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


def resources(compiled, cc: int) -> dict:
    """registers, spill_bytes, shared, num_warps and the warps (and blocks) per SM they allow."""
    report = ptxas_report(compiled.asm["ptx"]) | {"num_warps": compiled.metadata.num_warps,
                                                  "shared": compiled.metadata.shared}
    report["warps_per_sm"] = occupancy_warps(report["registers"], report["shared"], report["num_warps"], cc)
    report["blocks_per_sm"] = report["warps_per_sm"] // report["num_warps"]
    return report
