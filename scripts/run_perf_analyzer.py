"""Run the perf_analyzer 2.51 shipped in the tritonclient wheel against lora_llm, streaming over gRPC.

    python scripts/run_perf_analyzer.py [--url 127.0.0.1:8001] [--concurrency 4] [--requests 32]
        [--input-len 32] [--output-len 16] [--lora-task-id N [--lora-dir DIR]] [--vocab-size 49152]

With --lora-task-id alone the requests name a cached adapter; with --lora-dir each request also carries its
weights (lora_weights [N, R] fp16, lora_config [N, 3]). Extra arguments after -- go to perf_analyzer.
"""
import argparse
import base64
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from backend.serving.heartbeat import core_key_headers  # noqa: E402


def library_dir() -> Path:
    """perf_analyzer 2.51 wants libb64.so.0d and libcudart.so.12; nvidia-pytriton's wheel carries both (and the server
    bundle of scripts/pack_server.py, which also has them under those names)."""
    import pytriton
    libs = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"
    out = Path(sys.prefix) / "perf_analyzer_libs"
    out.mkdir(exist_ok=True)
    for pattern, name in (("libb64-*.so.0d", "libb64.so.0d"), ("libcudart-*.so.12*", "libcudart.so.12")):
        [target] = glob.glob(str(libs / pattern))[:1]
        link = out / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return out


def input_data(args) -> dict:
    rng = random.Random(0)
    entry = {"request_output_len": [args.output_len], "streaming": [True]}
    if args.lora_task_id is not None:
        entry["lora_task_id"] = [args.lora_task_id]
    if args.lora_dir:
        from backend.lora.peft import load_lora_dir
        weights, config = load_lora_dir(args.lora_dir)
        weights, config = weights.reshape(-1, weights.shape[-1]), config.reshape(-1, 3)
        fp16 = weights.astype("float16").tobytes()              # perf_analyzer takes fp16 only as base64
        entry["lora_weights"] = {"b64": base64.b64encode(fp16).decode(), "shape": list(weights.shape)}
        entry["lora_config"] = {"content": config.reshape(-1).tolist(), "shape": list(config.shape)}
    data = []
    for _ in range(8):
        ids = [rng.randrange(3, args.vocab_size) for _ in range(args.input_len)]
        data.append({"input_ids": {"content": ids, "shape": [len(ids)]}} | entry)
    return {"data": data}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--model", default="lora_llm")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32, help="requests per measurement window")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--lora-task-id", type=int)
    parser.add_argument("--lora-dir")
    args, extra = parser.parse_known_args()
    data_file = Path(tempfile.mkdtemp(prefix="perf-analyzer-")) / "input_data.json"
    data_file.write_text(json.dumps(input_data(args)))
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{library_dir()}:{env.get('LD_LIBRARY_PATH', '')}"
    binary = Path(sys.prefix) / "bin" / "perf_analyzer"            # the venv's; else the PATH's (the server bundle's)
    cmd = [str(binary) if binary.is_file() else shutil.which("perf_analyzer") or "perf_analyzer", "-m", args.model, "-u", args.url, "-i", "grpc",
           "--streaming", "--input-data", str(data_file), "--concurrency-range", str(args.concurrency),
           "--measurement-mode", "count_windows", "--measurement-request-count", str(args.requests),
           "--max-trials", "3", "--stability-percentage", "999"] + [a for a in extra if a != "--"]
    cmd += [f"-H{name}:{value}" for name, value in core_key_headers("grpc").items()]     # (see the docstring)
    print(" ".join(cmd), flush=True)
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
