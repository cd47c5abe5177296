"""The real tritonserver with the engine on a GPU (scripts/gpu_check.sh --server): the tritonserver nvidia-pytriton
bundles, serving the core model on the tiny model with the engine on `--device`, streams three requests through
gRPC (the base model, an adapter sent with its weights, the same adapter by its task id), and checks their tokens
against the same requests run in this process. Within --timeout-s (180).

    python scripts/server_check.py [--device cuda] [--timeout-s 180]
Exit status 0: passed; 1: failed; 2: skipped (nvidia-pytriton or tritonclient not installed: on a machine without
network, install them from carried wheels, docs/gpu.md).
"""
import argparse
import importlib.util
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

MAX_TOKENS = 8
TASK_ID = 7


def missing() -> list[str]:
    return [name for name, module in (("nvidia-pytriton", "pytriton"), ("tritonclient[grpc]", "tritonclient.grpc"))
            if importlib.util.find_spec(module.split(".")[0]) is None]


def random_adapter(model_dir: Path, out: Path, rank: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """A TensorRT-LLM adapter on q, v and down of every layer, strong enough to change greedy tokens."""
    from backend.lora.format import module_shape
    from backend.lora.peft import save_trtllm
    from backend.checkpoint import ModelConfig
    cfg, rng = ModelConfig.from_dir(model_dir), np.random.default_rng(0)
    rows, config = [], []
    for layer in range(cfg.num_layers):
        for module in (1, 3, 6):
            in_dim, out_dim = module_shape(cfg, module)
            rows.append(np.concatenate([rng.standard_normal(rank * in_dim) * in_dim ** -0.5,
                                        rng.standard_normal(out_dim * rank) * rank ** -0.5]))
            config.append([module, layer, rank])
    weights = np.zeros((len(rows), max(map(len, rows))), np.float16)
    for i, row in enumerate(rows):
        weights[i, :len(row)] = row
    save_trtllm(out, weights, np.array(config, np.int32))
    return weights, np.array(config, np.int32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--timeout-s", type=float, default=180)
    args = parser.parse_args()
    started = time.monotonic()
    if missing():
        print(f"server_check: skipped: {' and '.join(missing())} not installed (docs/gpu.md)")
        return 2
    from client.grpc_client import LoraLLMClient
    from launch_server import free_ports, start_server, wait_ready
    from prepare_model import build_tiny

    from backend import LLMEngine
    work = Path(tempfile.mkdtemp(prefix="server_check-"))
    build_tiny(work / "model", seed=0, architecture="llama")
    weights, config = random_adapter(work / "model", work / "adapter")
    settings = {"LORA_LLM_MODEL_DIR": str(work / "model"), "LORA_LLM_DEVICE": args.device,
                "LORA_LLM_DTYPE": "float32", "LORA_LLM_KV_CACHE_MEMORY_BYTES": str(64 << 20),
                "LORA_LLM_MAX_LORA_RANK": "16"}
    http, grpc, metrics = free_ports(3)
    log = open(work / "tritonserver.log", "w")
    server = start_server(http, grpc, metrics, env=settings, log_file=log, models=["lora_llm"])
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 512, n).tolist() for n in (9, 17, 12)]
    tasks = [None, TASK_ID, TASK_ID]                       # the base; weights sent once; then by id
    try:
        wait_ready(server, http, timeout_s=max(10.0, args.timeout_s - (time.monotonic() - started)))
        print(f"server_check: tritonserver ready on {args.device} after {time.monotonic() - started:.1f} s")
        client = LoraLLMClient(f"127.0.0.1:{grpc}")
        try:
            served = [[t for chunk in client.generate(p, MAX_TOKENS, lora_task_id=t,
                                                      lora_dir=work / "adapter" if t else None, end_id=-1)
                       for t in chunk] for p, t in zip(prompts, tasks)]
        finally:
            client.close()
    except Exception as err:
        print(f"server_check: FAILED: {type(err).__name__}: {err}\n--- tritonserver log:\n"
              f"{(work / 'tritonserver.log').read_text()[-4000:]}")
        return 1
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    engine = LLMEngine(work / "model", device=args.device, dtype="float32", kv_cache_memory_bytes=64 << 20,
                       max_lora_rank=16)
    engine.add_lora(TASK_ID, weights, config)
    want = [engine.generate([p], max_new_tokens=MAX_TOKENS, lora_task_ids=[t], ignore_end_id=True)[0]
            for p, t in zip(prompts, tasks)]
    changed = want[1] != engine.generate([prompts[1]], max_new_tokens=MAX_TOKENS, ignore_end_id=True)[0]
    print(f"server_check: served {served}\nserver_check: in process {want}")
    ok = served == want and changed
    print(f"server_check: {'passed' if ok else 'FAILED'}: the three streams' tokens "
          f"{'equal' if served == want else 'differ from'} the in-process engine's (the adapter changes tokens: "
          f"{changed}), {time.monotonic() - started:.1f} s in all")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
