"""python -m client --text "..." [--lora-dir DIR --lora-task-id N] [--stream] [--max-tokens N] ...

Prints tokens as they arrive. --input-ids "1 2 3" sends token ids and prints ids instead of text.
"""
import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from backend.text import IncrementalDetokenizer   # noqa: E402
from client.grpc_client import LoraLLMClient      # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", help="a user message (the chat template is applied)")
    what.add_argument("--input-ids", help="space-separated token ids, sent as they are")
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--model", default="lora_llm")
    parser.add_argument("--tokenizer-dir", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--lora-task-id", type=int)
    parser.add_argument("--lora-dir", help="a PEFT or TensorRT-LLM adapter directory (sent once per task id)")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int)
    args = parser.parse_args()
    if args.lora_dir and args.lora_task_id is None:
        parser.error("--lora-dir needs --lora-task-id")

    scalars = dict(temperature=args.temperature, runtime_top_k=args.top_k, runtime_top_p=args.top_p, seed=args.seed)
    detok = None
    if args.text is not None:
        from backend.text import tokenizer_from_dir
        tokenizer = tokenizer_from_dir(args.tokenizer_dir)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.text}], add_generation_prompt=True,
                                            tokenize=True)
        input_ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        scalars["end_id"] = tokenizer.eos_token_id
        detok = IncrementalDetokenizer(tokenizer)
    else:
        input_ids = [int(t) for t in args.input_ids.split()]
    client = LoraLLMClient(args.url, args.model)
    try:
        for chunk in client.generate(input_ids, args.max_tokens, args.stream, args.lora_task_id, args.lora_dir,
                                     exclude_input_in_output=True, **scalars):
            print(detok.add(chunk) if detok else " ".join(map(str, chunk)), end="" if detok else "\n", flush=True)
        if detok:
            print()
    finally:
        client.close()


if __name__ == "__main__":
    main()
