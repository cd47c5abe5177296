"""The compiled CPU kernels (kernels/cpu/*.cpp): built from source with the machine's g++ and Python headers by
`python -m kernels.cpu_ext` (scripts/setup.sh runs it), loaded from that build afterwards.

The build goes to .build/ in the repository (not kept in git); -march=native tunes it to the machine that builds
it, which is the one that runs it (x86-64-v3 at least: AVX2, FMA, F16C); `target` builds for other flags instead
(-march=x86-64-v3: what an AVX2 CPU runs, measured on a newer one; a build directory of their own). -fopenmp is what
makes at::parallel_for parallel (without it the loops run on one thread); the extension then shares torch's own
libgomp, already loaded under the same soname."""
import hashlib
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from kernels.lora.reference import add_lora_delta, add_qkv_delta
from kernels.quant import Int4Weight, Int8Weight

NAME = "lora_llm_cpu"
SOURCES = [Path(__file__).parent / "cpu" / name
           for name in ("paged_attention.cpp", "fused.cpp", "lora.cpp", "linear.cpp", "moe_lora.cpp")]
NATIVE = "-march=native"
AVX2 = "-march=x86-64-v3"           # what a CPU with AVX2, FMA and F16C (and no AVX-512) runs
ARCH_FLAGS = NATIVE
BUILD_DIR = Path(__file__).resolve().parent.parent / ".build" / NAME

_module = None


def target(arch_flags: str) -> None:
    """Build and load the kernels for `arch_flags` in place of -march=native (bench.llamacpp_baseline --isa), in a
    build directory of their own. Before the first load."""
    global ARCH_FLAGS, BUILD_DIR
    if _module is not None and arch_flags != ARCH_FLAGS:
        raise RuntimeError(f"the CPU kernels are loaded already, built with {ARCH_FLAGS}")
    ARCH_FLAGS = arch_flags
    BUILD_DIR = BUILD_DIR.parent / (NAME if arch_flags == NATIVE else
                                    f"{NAME}-{hashlib.sha1(arch_flags.encode()).hexdigest()[:8]}")


def load(verbose: bool = False):
    """The extension module; built (or rebuilt when a source changed) on first use. A clear error when the
    toolchain is missing."""
    global _module
    if _module is None:
        from torch.utils import cpp_extension
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        try:
            with build_lock(), pinned_ninja_first():
                _module = cpp_extension.load(NAME, [str(s) for s in SOURCES],
                                             extra_cflags=["-O3", *ARCH_FLAGS.split(), "-fopenmp"],
                                             extra_ldflags=["-fopenmp"], build_directory=str(BUILD_DIR),
                                             verbose=verbose)
        except Exception as err:
            raise RuntimeError(f"cannot build the compiled CPU kernels ({err}); they need g++ and the Python "
                               "headers (apt-get install g++ python3-dev) and the ninja package. "
                               "kernel_backend 'torch' runs without them") from err
    return _module


@contextmanager
def build_lock():
    """One builder at a time, by a lock the kernel releases when its holder dies (flock), with the holder's pid
    written in it. torch's own lock file outlives a build that was killed, and every later load waited for it (up to
    a stale-lock limit of 10 minutes, with no word): whoever holds ours is the only builder, so a torch lock found
    then was left by a dead one and goes at once."""
    import fcntl
    with open(BUILD_DIR / "owner.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            print(f"[cpu_ext] waiting for the CPU kernels' build by pid {f.read().strip() or '?'}", file=sys.stderr,
                  flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        (BUILD_DIR / "lock").unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def pinned_ninja_first():
    """torch runs the first `ninja` on PATH. Two ninja versions keep build logs ninja cannot share (a system 1.11
    and the pinned 1.13 hash commands differently), so a process that finds the other one than the last builder
    rebuilds everything (~1 min): the server's stub (venv first on PATH) and `.venv/bin/python` (system first)
    took turns. The pinned one (the `ninja` package in requirements.txt) goes first while we build."""
    try:
        import ninja
    except ImportError:
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path])
    try:
        yield
    finally:
        os.environ["PATH"] = path


def available() -> bool:
    try:
        load()
        return True
    except RuntimeError:
        return False


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_starts: torch.Tensor, scale: float,
                    sliding_window: int | None, softcap: float | None = None,
                    kv_scales: tuple[float, float] | None = None) -> torch.Tensor:
    """Semantics: for each sequence s with L = seq_lens[s] and query rows [query_starts[s], query_starts[s + 1]) at
    the last positions of its context, the row at position p attends to positions [0, p] (the last sliding_window
    of them):
        k[j], v[j] = cache[kv_head, block_tables[s, j // block_size], j % block_size]
        s = q[row, h] @ k[window].T * scale
        if softcap: s = softcap * tanh(s / softcap)
        out[row, h] = softmax(s) @ v[window]
    h's KV head = h // (num_heads // num_kv_heads). q: [num_rows, num_heads, head_dim]; the tables int32; an INT8
    cache (kv_scales): k, v = dequantize_kv(k, kv_scales[0]), dequantize_kv(v, kv_scales[1]) (kernels.quant)."""
    k_scale, v_scale = kv_scales or (1.0, 1.0)
    return load().paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_starts, scale,
                                  sliding_window or 0, softcap or 0.0, k_scale, v_scale)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, delta=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: x = add_lora_delta(x, delta); if residual is not None: residual += x (in place), x = residual
        return weight * (x.float() * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype), x
    x, residual: [num_tokens, hidden]. (A delta comes only from graph steps: torch's addition here.)"""
    x = add_lora_delta(x, delta)
    return load().add_rms_norm(x, residual, weight, eps), x if residual is None else residual


def silu_and_mul(gate_up: torch.Tensor, delta=None) -> torch.Tensor:
    """Semantics: gate, up = add_lora_delta(gate_up, delta).chunk(2, -1); return silu(gate) * up.
    gate_up: [num_tokens, 2 * inter]."""
    return load().silu_and_mul(add_lora_delta(gate_up, delta))


def rotary_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, delta=None, kv_scales: tuple[float, float] | None = None
                     ) -> torch.Tensor:
    """Semantics: q, k, v = add_qkv_delta(q, k, v, delta); q, k = rotary(q, k, positions, cos_sin) (in place);
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, kv_scales); return q. q: [num_tokens, num_heads,
    head_dim], k, v: [num_tokens, num_kv_heads, head_dim]."""
    q, k, v = add_qkv_delta(q, k, v, delta)
    k_scale, v_scale = kv_scales or (1.0, 1.0)
    load().rotary_and_cache(q, k, v, positions.int(), cos_sin, k_cache, v_cache, slot_mapping.int(), k_scale,
                            v_scale)
    return q


def lora_apply(x: torch.Tensor, proj, segments, out: torch.Tensor) -> None:
    """Semantics: for each band i of the projection (backend/lora/slots.Projection) and each segment s of tokens
    [starts[s], starts[s+1]) with slot = segments.slots[s] >= 0 and r = proj.ranks[i, slot] > 0, rows = i * max_rank:
        out[tokens, bounds[i]:bounds[i+1]] += (x[tokens] @ proj.a[slot, rows:rows + r].T)
                                              @ proj.b[slot, bounds[i]:bounds[i+1], rows:rows + r].T
    x: [num_tokens, in_dim], proj.a: [num_slots, cap, in_dim], proj.b: [num_slots, out_dim, cap] (CPU slots, stored
    rank-major; x's dtype or a narrower one, widened on load), out: [num_tokens, out_dim]. Then, where proj.dora[i,
    slot]: out[tokens, bounds[i]:bounds[i+1]] *= proj.m[slot, bounds[i]:bounds[i+1]] (a DoRA module's magnitude)."""
    load().lora_apply(x, proj.a, proj.b, proj.ranks, proj.bounds, proj.m, proj.dora, proj.max_rank, segments.starts,
                      segments.slots, out)


def linear_lora(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, proj, segments) -> torch.Tensor:
    """Semantics: out = panel_linear(x, panels, bias); lora_apply(x, proj, segments, out); return out. While the GEMM
    computes (bound by its FMAs at a decode step's rows) it pulls into the cache the adapter rows the LoRA then reads
    for segments of up to 3 tokens, instead of the LoRA waiting on memory for them."""
    return load().linear_lora(x, panels, bias, proj.a, proj.b, proj.ranks, proj.bounds, proj.m, proj.dora,
                              proj.max_rank, segments.starts, segments.slots)


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """Semantics: weight.view(N // 16, 16, K).transpose(1, 2).contiguous()   # fp32 [N, K] -> panels [N / 16, K, 16]"""
    return load().pack_linear(weight)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Semantics: F.linear(x.float(), panels.transpose(1, 2).reshape(N, K).float(), bias).to(x.dtype)
    # x [M, K], panels fp32 or bf16 [N / 16, K, 16] -> [M, N] in x's dtype (computed in fp32)"""
    return load().panel_linear(x, panels, bias)


def amx_available() -> bool:
    """Whether amx_linear runs here: a CPU with AMX-BF16 tiles, a build that reads them and a kernel that grants
    them to this process."""
    return load().amx_available()


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """Semantics: weight.view(N // 16, 16, K // 2, 2).permute(0, 2, 1, 3).contiguous()
    # bf16 [N, K] -> pair panels [N / 16, K / 2, 16, 2]: each row of a panel one k pair of its 16 columns"""
    N, K = weight.shape
    return weight.view(N // 16, 16, K // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_pairs(pairs: torch.Tensor) -> torch.Tensor:
    """Semantics: the weight [N, K] pack_pairs took."""
    num_panels, half_k = pairs.shape[:2]
    return pairs.permute(0, 2, 1, 3).reshape(num_panels * 16, half_k * 2)


def amx_linear(x: torch.Tensor, pairs: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Semantics: F.linear(x.float(), unpack_pairs(pairs).float(), bias).bfloat16()
    # x bf16 [M, K] (K % 32 == 0), pairs bf16 [N / 16, K / 2, 16, 2], bias fp32 [N] -> [M, N] bf16, on AMX tiles"""
    return load().amx_linear(x, pairs, bias)


def amx_dequantized_linear(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """Semantics: amx_linear(x, pack_pairs(dequantize_panels(weight, torch.bfloat16)), bias)
    # x bf16 [M, K] (K % 32 == 0), an Int8Weight, Int4Weight or Fp8Weight in panels -> [M, N] bf16; each group of
    panels dequantized in the thread's cache-sized buffer, never the whole weight"""
    return load().amx_dequantized_linear(x, *_panel_args(weight), bias)


def int8_panel_linear(x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """Semantics: F.linear(x.float(), panels.transpose(1, 2).reshape(N, K).float() * scale[:, None], bias).to(x.dtype)
    # x [M, K] fp32/bf16/fp16, panels int8 [N / 16, K, 16], scale fp32 [N] -> [M, N] in x's dtype"""
    return load().int8_panel_linear(x, panels, scale, bias)


def int4_panel_linear(x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Semantics: F.linear(x.float(), Int4Weight(panels, scale, zero, group_size).dequantize(torch.float32),
    bias).to(x.dtype)
    # x [M, K] fp32/bf16/fp16, panels uint8 [N / 16, K, 8], scale fp32 / zero uint8 [K / group_size, N] -> [M, N]"""
    return load().int4_panel_linear(x, panels, scale, zero, group_size, bias)


def _panel_args(weight) -> tuple:
    """An Int8Weight, Int4Weight or Fp8Weight in panels as the bindings that take any of them read it: panels,
    scale, zero point (INT4's; else None) and group size (INT8: 0, a scale per output channel)."""
    if isinstance(weight, Int8Weight):
        return weight.data, weight.scale, None, 0
    zero = weight.zero if isinstance(weight, Int4Weight) else None
    return weight.data, weight.scale, zero, weight.group_size


def dequantize_panels(weight, dtype: torch.dtype) -> torch.Tensor:
    """Semantics: weight.dequantize(torch.float32).to(dtype)   # an Int8Weight, Int4Weight or Fp8Weight in panels
    -> [N, K] in bf16 or fp16, each value as the panel GEMM reads it"""
    return load().dequantize_panels(*_panel_args(weight), dtype)


def fp8_panel_linear(x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor, group_size: int,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """Semantics: F.linear(x.float(), Fp8Weight(panels, scale, group_size).dequantize(torch.float32), bias).to(x.dtype)
    # x [M, K] fp32/bf16/fp16, panels uint8 [N / 16, K, 16] (e4m3 bits), scale fp32 [K / group_size, N] -> [M, N]"""
    return load().fp8_panel_linear(x, panels, scale, group_size, bias)


def expert_lora_add(out: torch.Tensor, x: torch.Tensor, rows_per_x: int, row_slots: torch.Tensor,
                    row_experts: torch.Tensor, num_experts: int, a: torch.Tensor, bs: list[torch.Tensor],
                    slot_ranks: torch.Tensor) -> None:
    """Semantics: kernels.reference.add_group_lora(out, x, rows_per_x, row_slots, row_experts, num_experts, a, bs,
    slot_ranks), each adapted row's matrices read in place up to its slot's rank (rounded up to 8), the sums in fp32
    rounded once into out. Widths (in, rank, every out) multiples of 8."""
    load().expert_lora_add(x, rows_per_x, row_slots, row_experts, num_experts, a, bs, slot_ranks, out)


def claim_order(costs: list[int], num_threads: int, turns: list[int]) -> list[int]:
    """The item each turn's thread claims (-1: none left) when the items of `costs` are shared among num_threads
    threads, as every parallel kernel here splits its work (kernels/cpu/claims.h)."""
    return load().claim_order(costs, num_threads, turns)


if __name__ == "__main__":
    load(verbose="-v" in sys.argv)
    print(f"[setup] compiled CPU kernels ready in {BUILD_DIR}")
