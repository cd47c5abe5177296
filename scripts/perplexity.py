"""The default model's perplexity on a fixed text (bench/perplexity.txt: a snapshot of this project's own prose,
kept as it is so the figures compare), for each weight_dtype, kv_cache_dtype and lm_head_dtype asked: what a quantized base or
cache costs in accuracy. The text is cut into windows scored as prompts (the engine's prompt log probs), each token
given those before it in its window (read back from the cache: an INT8 cache's values).

    python scripts/perplexity.py                                   # weight_dtype auto and int8, the default model
    python scripts/perplexity.py --weight-dtypes auto --kv-cache-dtypes auto,int8
    python scripts/perplexity.py --weight-dtypes int8 --dtype float32 --window 256
    python scripts/perplexity.py --weight-dtypes auto,int8,int4 --lm-head-dtypes auto,int8
"""
import argparse
import itertools
import math
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = ROOT / "bench" / "perplexity.txt"


def perplexity(model_dir: str, ids: list[int], window: int, **engine_kwargs) -> tuple[float, int]:
    """(exp of the mean negative log prob, tokens scored) over the windows of ids."""
    from backend import LLMEngine
    engine = LLMEngine(model_dir, **engine_kwargs)
    windows = [ids[start:start + window] for start in range(0, len(ids), window)]
    for i, tokens in enumerate(w for w in windows if len(w) > 1):
        engine.add_request(tokens, request_id=i, max_new_tokens=1, return_prompt_log_probs=True)
    total, count = 0.0, 0
    while engine.has_unfinished:
        for out in engine.step():
            if out.prompt_log_probs is not None:
                log_probs = out.prompt_log_probs.log_probs[1:]               # (row 0 has no context)
                total, count = total + float(log_probs.sum()), count + log_probs.numel()
    engine.close()
    return math.exp(-total / count), count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--weight-dtypes", default="auto,int8", help="a comma list of weight_dtype values")
    parser.add_argument("--kv-cache-dtypes", default="auto", help="a comma list of kv_cache_dtype values")
    parser.add_argument("--lm-head-dtypes", default="auto", help="a comma list of lm_head_dtype values")
    parser.add_argument("--dtype", default="auto", help="the activations' (auto: bf16 where the CPU has it)")
    parser.add_argument("--kernel-backend", default="auto")
    parser.add_argument("--window", type=int, default=512, help="tokens per scored window")
    args = parser.parse_args()

    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(args.model_dir)(TEXT.read_text())["input_ids"]
    print(f"{platform.machine()}, {Path(args.model_dir).name}, {TEXT.relative_to(ROOT)}: {len(ids)} tokens in "
          f"windows of {args.window}, dtype {args.dtype}, kernels {args.kernel_backend}", flush=True)
    for weight_dtype, kv_cache_dtype, lm_head_dtype in itertools.product(
            *(names.split(",") for names in (args.weight_dtypes, args.kv_cache_dtypes, args.lm_head_dtypes))):
        value, count = perplexity(args.model_dir, ids, args.window, dtype=args.dtype, weight_dtype=weight_dtype,
                                  kv_cache_dtype=kv_cache_dtype, lm_head_dtype=lm_head_dtype,
                                  kernel_backend=args.kernel_backend)
        print(f"weight_dtype {weight_dtype:5s} kv_cache_dtype {kv_cache_dtype:5s} lm_head_dtype {lm_head_dtype:5s}: "
              f"perplexity {value:.3f} over {count} tokens", flush=True)


if __name__ == "__main__":
    main()
