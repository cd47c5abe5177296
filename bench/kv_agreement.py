"""What an INT8 or FP8 KV cache changes in the default model's answers: 32 prompts of 64 tokens cut from
bench/perplexity.txt, 64 greedy tokens each with the cache in dtype (`auto`) and quantized; how many answers are
the same, how far the two agree before they first differ, and the mean log-prob difference of the `auto` answers'
tokens as each cache scores them (the quantized engine reads them as a prompt: teacher forcing, so a divergence
early on does not decide the figure), beside the same figure for the `auto` engine reading them as a prompt (the
noise floor: a prompt's rows and a decode step's round differently in bf16).

    python -m bench.kv_agreement                     # the default model, dtype auto (bf16 where the CPU has it)
    python -m bench.kv_agreement --kv-cache-dtype fp8
    python -m bench.kv_agreement --speed-context 4096   # and one sequence's decode tok/s after a 4096-token prompt

--speed-context N: one sequence decodes 128 tokens after a prompt of N tokens (the text repeated), with each cache;
tok/s of the decode steps alone, the best of three runs: what reading half the cache's bytes a step gives on this
machine.
"""
import time
import argparse
import platform
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "bench" / "perplexity.txt"


def answers(engine, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and their log probs for each prompt."""
    ids = [engine.add_request(p, max_new_tokens=max_new_tokens, return_log_probs=True, ignore_end_id=True)
           for p in prompts]
    tokens, log_probs = {i: [] for i in ids}, {i: [] for i in ids}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            log_probs[out.request_id] += out.log_probs
    return [tokens[i] for i in ids], [log_probs[i] for i in ids]


def scored(engine, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[float]]:
    """Each continuation's tokens' log probs given its prompt and the tokens before it (prompt log probs)."""
    ids = [engine.add_request(p + c, max_new_tokens=1, return_prompt_log_probs=True)
           for p, c in zip(prompts, continuations)]
    result = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.prompt_log_probs is not None:
                result[out.request_id] = out.prompt_log_probs.log_probs.tolist()
    return [result[i][len(p):] for i, p in zip(ids, prompts)]


def decode_tok_s(engine, prompt: list[int], num_tokens: int = 128) -> float:
    """One sequence's decode tok/s after its prompt (the first token, with the prefill, not counted)."""
    engine.add_request(prompt, max_new_tokens=num_tokens, ignore_end_id=True)
    first, count = None, 0
    while engine.has_unfinished:
        for out in engine.step():
            count += len(out.new_token_ids)
            first = first or time.perf_counter()
    return (count - 1) / (time.perf_counter() - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64, help="prompt tokens, and tokens generated")
    parser.add_argument("--kv-cache-dtype", default="int8", choices=("int8", "fp8"))
    parser.add_argument("--speed-context", type=int, default=0, metavar="N",
                        help="also one sequence's decode tok/s after an N-token prompt, each cache")
    args = parser.parse_args()

    from transformers import AutoTokenizer
    from backend import LLMEngine
    ids = AutoTokenizer.from_pretrained(args.model_dir)(TEXT.read_text())["input_ids"]
    stride = (len(ids) - args.tokens) // args.prompts
    prompts = [ids[i * stride:i * stride + args.tokens] for i in range(args.prompts)]
    kinds = ("auto", args.kv_cache_dtype)
    engines = {dtype: LLMEngine(args.model_dir, dtype=args.dtype, kv_cache_dtype=dtype) for dtype in kinds}
    (base, base_lp), (quant, _) = (answers(engines[d], prompts, args.tokens) for d in kinds)
    quant_lp, auto_lp = (scored(engines[d], prompts, base) for d in (args.kv_cache_dtype, "auto"))
    same = sum(a == b for a, b in zip(base, quant))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(base, quant)]
    diffs = [x - y for a, b in zip(base_lp, quant_lp) for x, y in zip(a, b)]
    floor = [x - y for a, b in zip(base_lp, auto_lp) for x, y in zip(a, b)]
    print(f"{platform.machine()}, {Path(args.model_dir).name}, dtype {engines['auto'].runner.dtype}: "
          f"{args.prompts} prompts x {args.tokens} tokens greedy, kv_cache_dtype auto against {args.kv_cache_dtype}")
    print(f"answers the same: {same}/{args.prompts}; tokens agreeing before the first difference: "
          f"{sum(prefix) / len(prefix):.1f} of {args.tokens} on average")
    print(f"log prob of the auto answers' tokens, auto minus {args.kv_cache_dtype}: "
          f"mean {sum(diffs) / len(diffs):+.4f}, "
          f"mean |difference| {sum(abs(d) for d in diffs) / len(diffs):.4f} over {len(diffs)} tokens (auto as a "
          f"prompt: mean {sum(floor) / len(floor):+.4f}, mean |difference| "
          f"{sum(abs(d) for d in floor) / len(floor):.4f})")
    if args.speed_context:
        long_prompt = (ids * (args.speed_context // len(ids) + 1))[:args.speed_context]
        speeds = {d: max(decode_tok_s(engines[d], long_prompt) for _ in range(3)) for d in kinds}
        print(f"decode after a {args.speed_context}-token prompt, one sequence: " +
              ", ".join(f"kv_cache_dtype {d} {v:.1f} tok/s" for d, v in speeds.items()))
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
