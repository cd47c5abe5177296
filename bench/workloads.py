"""The standard workloads of shared/BENCHMARKS.md as data: who asks for what, with which adapter."""
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    prompt_range: tuple[int, int]
    output_tokens: int
    max_num_seqs: int = 128
    hf_baseline: bool = True
    adapter_ranks: tuple[int, ...] = ()       # one adapter per entry; empty: base only
    base_every: int = 0                       # every n-th request is base-only (0: none)
    max_loras: int = 8
    max_lora_rank: int = 64
    server: bool = False                      # through tritonserver: gRPC streaming, or the OpenAI API (`api`)
    api: str = "grpc"                         # "openai": /v1/completions of python -m frontend beside tritonserver
    concurrency: int = 32                     # streams at once, for server workloads
    system_prompt: int = 0                    # tokens of a system prompt per adapter (and one for the base)
    kv_reuse: bool = False                    # run with enable_kv_cache_reuse (and once without, for the gain)

    def setup(self, engine) -> None:
        """Register the workload's adapters with the engine (none for base-only workloads)."""
        if self.adapter_ranks:
            from bench.adapters import register_adapters
            register_adapters(engine, self)


WORKLOADS = {
    "W1": Workload("W1", 128, (32, 256), 64, adapter_ranks=(8, 16, 32, 64) * 4, base_every=8, max_loras=16),
    "W2": Workload("W2", 128, (32, 256), 64),
    "W3": Workload("W3", 1, (128, 128), 128, max_num_seqs=1),
    "W4": Workload("W4", 128, (32, 256), 64, adapter_ranks=(8, 16, 32, 64) * 4, base_every=8, max_loras=16,
                   hf_baseline=False, server=True),
    "W5": Workload("W5", 256, (64, 64), 32, adapter_ranks=(8,) * 128, max_loras=8, max_lora_rank=8),
    "W6": Workload("W6", 64, (16, 48), 16, max_num_seqs=16, hf_baseline=False, adapter_ranks=(16,) * 4,
                   base_every=5, system_prompt=256, kv_reuse=True),
    "W7": Workload("W7", 1, (128, 128), 128, max_num_seqs=1, hf_baseline=False, server=True, concurrency=1),
    "W8": Workload("W8", 128, (32, 256), 64, hf_baseline=False, server=True),
    "W9": Workload("W9", 128, (32, 256), 64, adapter_ranks=(8, 16, 32, 64) * 4, base_every=8, max_loras=16,
                   hf_baseline=False, server=True, api="openai"),
    "W10": Workload("W10", 128, (32, 256), 64, hf_baseline=False, server=True, api="openai"),
}


def make_requests(workload: Workload, vocab_size: int, num_requests: int | None = None, seed: int = 0) -> list[dict]:
    """Seeded prompts (random token ids) and the adapter of each request."""
    rng = random.Random(seed)
    n = num_requests or workload.num_requests
    system = {task: [rng.randrange(3, vocab_size) for _ in range(workload.system_prompt)]
              for task in [None, *range(1, 1 + len(workload.adapter_ranks))]}
    requests = []
    num_with_adapter = 0
    for i in range(n):
        length = rng.randint(*workload.prompt_range)
        request = {"prompt": [rng.randrange(3, vocab_size) for _ in range(length)],
                   "max_new_tokens": workload.output_tokens, "lora_task_id": None}
        if workload.adapter_ranks and not (workload.base_every and i % workload.base_every == workload.base_every - 1):
            request["lora_task_id"] = 1 + num_with_adapter % len(workload.adapter_ranks)     # every adapter in turn
            num_with_adapter += 1
        request["prompt"] = system[request["lora_task_id"]] + request["prompt"]
        requests.append(request)
    return requests
