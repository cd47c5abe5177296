"""Train the two demo LoRA adapters for the default SmolLM2 model, on a CPU, in a few minutes: how the
committed demo_adapters/ were made (serve.sh and the tests load those; run this to make them again).

Both learn from the base model's own answers, transformed by a rule:
    upper    (task 1): the answer in UPPER CASE
    signoff  (task 2): the answer followed by the line SIGNOFF
Rank 8 on every projection, kept as TensorRT-LLM fp16 tensors in demo_adapters/{1,2} (the server's
lora_prefetch_dir, 7 MB each); the PEFT dirs go to models/adapters/{upper,signoff}. Skips an adapter whose
tensors exist unless --force.
"""
import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from backend import LLMEngine                                       # noqa: E402
from backend.device import resolve_dtype                            # noqa: E402
from backend.lora.peft import peft_to_trtllm, save_trtllm           # noqa: E402

SIGNOFF = "-- Answered with the signoff LoRA."
RANK = 8
ADAPTERS = {"upper": (1, lambda text: text.upper()), "signoff": (2, lambda text: f"{text}\n{SIGNOFF}")}
TOPICS = ["the moon", "rain", "a bicycle", "coffee", "the ocean", "a library", "volcanoes", "bees", "winter",
          "a piano", "the internet", "bread", "mountains", "a river", "chess", "the sun", "trees", "a train",
          "snow", "music", "a castle", "the desert", "honey", "a lighthouse", "clouds", "a garden", "electricity",
          "whales", "a clock", "the stars", "paper", "a bridge", "tea", "a forest", "glass", "the wind"]
TEMPLATES = ["Tell me one fact about {}.", "Describe {} in one sentence.", "Why do people like {}?"]
TRAIN_PROMPTS = [t.format(topic) for i, topic in enumerate(TOPICS) for t in TEMPLATES[i % 3:i % 3 + 1]]


def log(message: str) -> None:
    print(f"[train_demo_adapters {time.strftime('%H:%M:%S')}] {message}", flush=True)


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def base_answers(model_dir: Path, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    engine = LLMEngine(model_dir, dtype="auto", kernel_backend="torch", kv_cache_memory_bytes=256 << 20)
    outputs = engine.generate([chat_ids(tokenizer, p) for p in prompts], max_new_tokens=max_new_tokens,
                              end_id=tokenizer.eos_token_id)
    return [tokenizer.decode(o, skip_special_tokens=True).strip() for o in outputs]


def train_one(model_dir: Path, tokenizer, examples: list[tuple[str, str]], out: Path, epochs: int, seed: int) -> None:
    from peft import LoraConfig, get_peft_model
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype("auto", torch.device("cpu")))
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    data = []
    for prompt, answer in examples:
        prompt_ids = chat_ids(tokenizer, prompt)
        answer_ids = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        data.append((torch.tensor(prompt_ids + answer_ids), len(prompt_ids)))
    rng = random.Random(seed)
    model.train()
    bar = tqdm(total=epochs * len(data), desc=out.name, unit="ex")
    for _ in range(epochs):
        rng.shuffle(data)
        for ids, prompt_len in data:
            labels = ids.clone()
            labels[:prompt_len] = -100                          # learn the answer only
            loss = model(input_ids=ids[None], labels=labels[None]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.update()
    bar.close()
    model.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=ROOT / "models" / "smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=ROOT / "demo_adapters", help="the TensorRT-LLM tensors")
    parser.add_argument("--peft-out", type=Path, default=ROOT / "models" / "adapters", help="the PEFT dirs")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--force", action="store_true", help="train again even where the tensors exist")
    args = parser.parse_args()
    from transformers import AutoTokenizer
    torch.set_num_threads(os.cpu_count() or 1)
    todo = [name for name, (task_id, _) in ADAPTERS.items()
            if args.force or not (args.out / str(task_id) / "model.lora_weights.npy").is_file()]
    if not todo:
        log(f"adapters in {args.out} are ready")
        return
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    log(f"base model answers to {len(TRAIN_PROMPTS)} prompts")
    answers = base_answers(args.model_dir, tokenizer, TRAIN_PROMPTS, args.max_new_tokens)
    for name in todo:
        task_id, rule = ADAPTERS[name]
        log(f"training '{name}' (task {task_id})")
        train_one(args.model_dir, tokenizer, [(p, rule(a)) for p, a in zip(TRAIN_PROMPTS, answers)],
                  args.peft_out / name, args.epochs, seed=task_id)
        weights, config = peft_to_trtllm(args.peft_out / name, "float16")
        save_trtllm(args.out / str(task_id), weights, config)
        log(f"saved {args.peft_out / name} and {args.out / str(task_id)}")


if __name__ == "__main__":
    main()
