"""The real tritonserver with the engine on a device (scripts/gpu_check.sh --server), on a random-weight model of a
real shape, every answer checked against the same request run in this process:
  - perf_analyzer (streaming, the base model) reports a throughput;
  - gRPC streams: the base model; an adapter sent with its weights, then by task id; a DoRA adapter whose
    lora_config has four columns, then by id; a stream cancelled after its second token (its KV blocks freed), then
    the base request again;
  - where the shape takes the bundled tokenizer (tiny-shape, smollm2-135m-shape): the ensemble, text in and out, and
    the OpenAI API with an adapter by name;
  - the server's device memory (free memory before it started and once ready) and the KV cache it chose;
  - --crash: tritonserver under the supervisor (scripts/launch_server.py) killed with SIGKILL mid-stream: the client
    gets an error within its timeout, no stub of the old server lives on, the device memory is back before the new
    server loads, and the restarted server serves.

    python bench/server_check.py [--shape tiny-shape|smollm2-135m-shape|llama-3.1-8b-shape] [--device cuda]
        [--crash] [--timeout-s 300] [--out FILE.json]
Exit status 0: passed; 1: failed; 2: skipped (no tritonserver or tritonclient: scripts/pack_server.py builds a
bundle, scripts/unpack_server.sh puts it on the paths).
"""
import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "scripts"))

from crash_check import crash_check                                                   # noqa: E402
from server_probe import (MAX_TOKENS, free_device_bytes, metric, openai_completion, perf_analyzer,  # noqa: E402
                          stream)

LORA, DORA = 7, 8                       # task ids
TEXT_PROMPT = "The three largest oceans are"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def missing() -> list[str]:
    return [name for name, module in (("tritonserver (nvidia-pytriton)", "pytriton"), ("tritonclient", "tritonclient"))
            if importlib.util.find_spec(module) is None]


def tokenizer_dir() -> Path | None:
    """The default model's tokenizer: built here, or carried in the server bundle."""
    for path in (ROOT / "models" / "smollm2-135m-instruct", Path(os.environ.get("LORA_LLM_SERVER_BUNDLE", "/-")) /
                 "tokenizer"):
        if (path / "tokenizer.json").is_file():
            return path
    return None


def build(shape: str, root: Path, device: str) -> tuple[Path, bool]:
    """A random-weight checkpoint of `shape` in root (the tokenizer's vocabulary and files where the shape takes
    them): (its dir, whether it has a tokenizer)."""
    from gpu_bench import cached_model
    tokenizer = tokenizer_dir() if shape in ("tiny-shape", "smollm2-135m-shape") else None
    out = cached_model(shape, root, device, shape + "-text" if tokenizer else shape,
                       **({"vocab_size": 49152} if tokenizer else {}))
    for name in TOKENIZER_FILES if tokenizer else ():
        if (tokenizer / name).is_file():
            shutil.copy2(tokenizer / name, out / name)
    return out, tokenizer is not None


def random_adapter(model_dir: Path, rank: int, modules: tuple[int, ...], dora: tuple[int, ...] = (),
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """TensorRT-LLM tensors for `modules` of every layer, strong enough to change greedy tokens; with `dora`, a
    four-column lora_config and magnitudes for those modules."""
    from backend.model.checkpoint import ModelConfig
    from backend.lora.format import module_shape
    cfg, rng = ModelConfig.from_dir(model_dir), np.random.default_rng(seed)
    rows, config = [], []
    for layer in range(cfg.num_layers):
        for module in modules:
            in_dim, out_dim = module_shape(cfg, module)
            parts = [rng.standard_normal(rank * in_dim) * in_dim ** -0.5,
                     rng.standard_normal(out_dim * rank) * rank ** -0.5]
            if module in dora:
                parts.append(rng.uniform(0.5, 1.5, out_dim))
            rows.append(np.concatenate(parts))
            config.append([module, layer, rank] + ([int(module in dora)] if dora else []))
    weights = np.zeros((len(rows), max(map(len, rows))), np.float16)
    for i, row in enumerate(rows):
        weights[i, :len(row)] = row
    return weights, np.array(config, np.int32)


def token_requests(vocab: int, weights: dict) -> list[tuple[str, dict, int | None]]:
    """(what, the request's arrays, its task id) for the gRPC streams."""
    from client.grpc_client import input_arrays
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, vocab, n).tolist() for n in (9, 17, 12, 21, 14)]
    ask = lambda prompt, task=None, *tensors: input_arrays(prompt, MAX_TOKENS, True, task, *tensors, end_id=-1)  # noqa
    return [("base", ask(prompts[0]), None),
            ("LoRA with its weights", ask(prompts[1], LORA, *weights[LORA]), LORA),
            ("LoRA by id", ask(prompts[2], LORA), LORA),
            ("DoRA, four-column config", ask(prompts[3], DORA, *weights[DORA]), DORA),
            ("DoRA by id", ask(prompts[4], DORA), DORA)]


def server_settings(model_dir: Path, args) -> dict:
    return {"LORA_LLM_MODEL_DIR": str(model_dir), "LORA_LLM_DEVICE": args.device, "LORA_LLM_DTYPE": args.dtype,
            "LORA_LLM_MAX_LORA_RANK": "16", "LORA_LLM_MAX_LORAS": "4"}


def serve_and_check(model_dir: Path, has_text: bool, requests: list, peft_dir: Path, args, report: dict) -> dict:
    """Every request (token_requests' and the rest) through a server: {what: (tokens or text, error)}."""
    from server_process import (QUICK_EXIT_TIMEOUT_S, free_ports, is_ready, start_frontend, start_server, stop_server,
                               wait_ready)
    http, grpc, metrics = free_ports(3)
    url = f"127.0.0.1:{grpc}"
    models = ["lora_llm"] + (["preprocessing", "postprocessing", "ensemble"] if has_text else [])
    free0 = free_device_bytes(args.device)
    started = time.monotonic()
    server = start_server(http, grpc, metrics, env=server_settings(model_dir, args), models=models,
                          log_file=open(args.work / "tritonserver.log", "w"), exit_timeout_s=QUICK_EXIT_TIMEOUT_S)
    frontend = None
    served = {}
    try:
        wait_ready(server, http, timeout_s=args.timeout_s)
        report["ready_s"] = time.monotonic() - started
        report["server_gpu_bytes"] = None if free0 is None else free0 - free_device_bytes(args.device)
        report["kv_cache_tokens"] = 16 * int(metric(metrics, "lora_llm_kv_blocks", 'state="free"'))
        memory = "-" if free0 is None else f"{report['server_gpu_bytes'] / 2**30:.2f} GiB"
        print(f"server_check: tritonserver ({report['tritonserver']}) ready on {args.device} in "
              f"{report['ready_s']:.1f} s; its device memory {memory}; KV cache {report['kv_cache_tokens']} tokens",
              flush=True)
        for what, arrays, _ in requests:
            chunks, error = stream(url, arrays)
            served[what] = ([int(t) for c in chunks for t in c.reshape(-1)], error)
        base = requests[0][1]
        long = base | {"request_output_len": np.array([[256]], np.int32)}
        chunks, error = stream(url, long, cancel_after=2)
        deadline = time.monotonic() + 10
        while metric(metrics, "lora_llm_kv_blocks", 'state="used"') and time.monotonic() < deadline:
            time.sleep(0.05)
        used = metric(metrics, "lora_llm_kv_blocks", 'state="used"')
        served["cancelled mid-stream"] = (len(chunks), error or (f"{used:.0f} KV blocks still used 10 s after the "
                                                                 "cancel" if used else None))
        chunks, error = stream(url, base)
        served["base after the cancel"] = ([int(t) for c in chunks for t in c.reshape(-1)], error)
        served["perf_analyzer"] = perf_analyzer(url, args.vocab_size)
        if has_text:
            chunks, error = stream(url, {"text_input": np.array([[TEXT_PROMPT]], object),
                                         "max_tokens": np.array([[MAX_TOKENS]], np.int32),
                                         "stream": np.array([[False]]),
                                         "exclude_input_in_output": np.array([[True]])},
                                   model="ensemble", output="text_output")
            served["ensemble text"] = ("".join(c.reshape(-1)[0].decode() for c in chunks), error)
            store = args.work / "store"
            shutil.copytree(peft_dir, store / "rand")
            [port] = free_ports(1)
            frontend = start_frontend(model_dir, grpc, port, "--adapter-store", str(store),
                                      log_file=open(args.work / "frontend.log", "w"))
            deadline = time.monotonic() + 120
            while not is_ready(port, "/health") and time.monotonic() < deadline and frontend.poll() is None:
                time.sleep(0.2)
            try:
                served["OpenAI, adapter by name"] = (openai_completion(port, "rand", text_ids(model_dir)), None)
            except Exception as err:
                served["OpenAI, adapter by name"] = ("", f"{type(err).__name__}: {err}\n"
                                                         f"{(args.work / 'frontend.log').read_text()[-2000:]}")
    finally:
        if frontend is not None:
            frontend.terminate()
            frontend.wait(timeout=30)
        stop_server(server, QUICK_EXIT_TIMEOUT_S)
    return served


def text_ids(model_dir: Path) -> list[int]:
    from backend.text import load_tokenizer
    return load_tokenizer(model_dir)(TEXT_PROMPT)["input_ids"]


def in_process(model_dir: Path, has_text: bool, weights: dict, requests: list, peft_dir: Path, args) -> dict:
    """The same requests, one at a time, on an engine set up as the server's."""
    from backend import LLMEngine
    from backend.text import load_tokenizer
    engine = LLMEngine(model_dir, device=args.device, dtype=args.dtype, max_lora_rank=16, max_loras=4)
    for task, (w, c) in weights.items():
        engine.add_lora(task, w, c)
    engine.add_lora_dir(9, peft_dir)
    run = lambda ids, task=None, ignore=True: engine.generate([ids], max_new_tokens=MAX_TOKENS,  # noqa: E731
                                                              lora_task_ids=[task], ignore_end_id=ignore)[0]
    want = {what: (run(arrays["input_ids"].reshape(-1).tolist(), task), None) for what, arrays, task in requests}
    want["cancelled mid-stream"] = (2, None)
    want["base after the cancel"] = want["base"]
    want["perf_analyzer"] = (True, None)
    base_of = {what: run(arrays["input_ids"].reshape(-1).tolist()) for what, arrays, task in requests if task}
    changed = all(want[what][0] != tokens for what, tokens in base_of.items())
    if has_text:
        tokenizer = load_tokenizer(model_dir)
        want["ensemble text"] = (tokenizer.decode(run(text_ids(model_dir), ignore=False), skip_special_tokens=True),
                                 None)
        want["OpenAI, adapter by name"] = (tokenizer.decode(run(text_ids(model_dir), 9), skip_special_tokens=True),
                                           None)
    del engine
    return want | {"adapters change the tokens": (changed, None)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m-shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--crash", action="store_true", help="also SIGKILL tritonserver mid-stream")
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--out", type=Path, help="the figures as JSON")
    parser.add_argument("--models-dir", type=Path, help="where the models are built (and found, if built there)")
    args = parser.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    started = time.monotonic()
    if missing():
        print(f"server_check: skipped: {' and '.join(missing())} not installed (scripts/pack_server.py)")
        return 2
    from backend.model.checkpoint import ModelConfig
    from bench.adapters import adapter_dirs
    from server_process import pytriton_dir
    work = args.work = Path(tempfile.mkdtemp(prefix="server_check-"))
    model_dir, has_text = build(args.shape, args.models_dir or work, args.device)
    weights = {LORA: random_adapter(model_dir, 8, (1, 3, 6)),
               DORA: random_adapter(model_dir, 16, (1, 2, 3, 4, 5, 6, 7), dora=(4, 6), seed=1)}
    peft_dir = adapter_dirs(str(model_dir), (8,))[0]
    args.vocab_size = ModelConfig.from_dir(model_dir).vocab_size
    requests = token_requests(args.vocab_size, weights)
    report = {"shape": args.shape, "device": args.device, "dtype": args.dtype,
              "tritonserver": str(pytriton_dir() / "tritonserver" / "bin" / "tritonserver")}
    try:
        served = serve_and_check(model_dir, has_text, requests, peft_dir, args, report)
    except Exception as err:
        print(f"server_check: FAILED: {type(err).__name__}: {err}\n--- tritonserver log:\n"
              f"{(work / 'tritonserver.log').read_text()[-4000:]}")
        return 1
    want = in_process(model_dir, has_text, weights, requests, peft_dir, args)
    failures = []
    for what, (value, _) in want.items():
        got, error = served.get(what, (value, None))
        ok = error is None and got == value
        print(f"server_check: {'ok  ' if ok else 'FAIL'} {what}: {got!r}" + ("" if ok else f" want {value!r}")
              + (f" error: {error}" if error else ""), flush=True)
        failures += [] if ok else [what]
    report["checks"] = {what: what not in failures for what in want}
    if args.crash:
        base = requests[0][1]["input_ids"].reshape(-1).tolist()
        failures += crash_check(server_settings(model_dir, args), args, (base, want["base"][0]), report)
    report["passed"] = not failures
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print(f"server_check: {'passed' if not failures else 'FAILED: ' + '; '.join(failures)} ({args.shape} on "
          f"{args.device}, {time.monotonic() - started:.1f} s in all)")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
