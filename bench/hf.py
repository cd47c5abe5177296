"""Baselines measured in the same run as the engine: Hugging Face transformers (+ PEFT) generate."""
import time

import torch
from tqdm import tqdm


def run_hf(model_dir: str, requests: list[dict], dtype: str, workload, batch_size: int = 8,
           device: str = "cpu") -> dict:
    """generate() in batches of `batch_size` with left padding, every output forced to its full length."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    adapter_names = None
    churn = len(workload.adapter_ranks) > workload.max_loras     # W5: adapters come and go, batch by batch
    if workload.adapter_ranks:
        from bench.adapters import attach_peft_adapters
        model, adapter_names = attach_peft_adapters(model, workload, loaded=1 if churn else None)
    num_tokens = 0
    start = time.perf_counter()
    for b in tqdm(range(0, len(requests), batch_size), desc=f"{workload.name} HF", unit="batch", leave=False):
        chunk = requests[b:b + batch_size]
        width = max(len(r["prompt"]) for r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(chunk):
            ids[row, width - len(r["prompt"]):] = torch.tensor(r["prompt"])
            mask[row, width - len(r["prompt"]):] = 1
        new = chunk[0]["max_new_tokens"]
        kwargs = {}
        if churn:
            from bench.adapters import swap_adapters
            swap_adapters(model, workload, {r["lora_task_id"] for r in chunk} - {None})
        if adapter_names is not None:
            kwargs["adapter_names"] = [adapter_names.get(r["lora_task_id"], "__base__") for r in chunk]
        with torch.inference_mode():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False, max_new_tokens=new,
                                 min_new_tokens=new, pad_token_id=0, **kwargs)
        num_tokens += (out.shape[1] - width) * len(chunk)
    if device != "cpu":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {"tok_s": num_tokens / elapsed, "seconds": elapsed, "output_tokens": num_tokens}
