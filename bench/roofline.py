"""What this machine can do now (matmul in the bench's dtype, memory copy) and what a workload asks of it (FLOPs,
bytes)."""
import time

import torch

from backend.model.checkpoint import ModelConfig


def measure_roofline(dtype: str = "bfloat16") -> dict:
    """2048^3 matmul throughput in `dtype` (GFLOP/s) and memory copy bandwidth (GB/s), on this machine now."""
    a = torch.randn(2048, 2048, dtype=getattr(torch, dtype))
    b = torch.randn(2048, 2048, dtype=getattr(torch, dtype))
    a @ b
    t = time.perf_counter()
    for _ in range(5):
        a @ b
    gflops = 5 * 2 * 2048 ** 3 / (time.perf_counter() - t) / 1e9
    src = torch.empty(256 << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    gbps = 5 * 2 * src.numel() / (time.perf_counter() - t) / 1e9
    return {"roofline_gflops": gflops, "memory_gbps": gbps}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "cpu"


def layer_params(cfg: ModelConfig, dense_only: bool = False) -> int:
    """Weights one token touches in the decoder layers (projections and MLP, all layers; of a mixture, the router and
    the k experts the token is routed to); dense_only: the dense projections alone (what weight_dtype quantizes)."""
    h = cfg.hidden_size
    attention = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
    return sum(attention + 3 * h * cfg.intermediate_size * cfg.has_dense_mlp(i) + (not dense_only) * cfg.is_moe(i) * (
        cfg.num_experts * h + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size + cfg.shared_expert * h)
        for i in range(cfg.num_layers))


QUANTIZED_WIDTHS = {"auto": None, "int8": 1.0, "int4": 0.5, "fp8": 1.0}   # bytes a dense projection's weight,
                                                                           # scales aside


def weight_bytes(cfg: ModelConfig, dtype: str, weight_dtype: str = "auto", lm_head_dtype: str = "auto") -> float:
    """Bytes one decode step reads at least: every layer weight and the lm_head (weight_dtype int8, fp8, int4: the
    dense projections a byte or half a byte each, lm_head_dtype so the lm_head, their scales and zero points
    aside)."""
    width = torch.finfo(getattr(torch, dtype)).bits / 8
    projections, head = QUANTIZED_WIDTHS[weight_dtype], QUANTIZED_WIDTHS[lm_head_dtype]
    return (layer_params(cfg) * width - layer_params(cfg, dense_only=True) * (width - (projections or width))
            + cfg.vocab_size * cfg.hidden_size * (head or width))


def request_flops(cfg: ModelConfig, prompt_len: int, output_len: int) -> float:
    """2 x weights per token (the lm_head only where a token is sampled: the last prompt token and each output
    but the last), plus QK^T and PV over each token's context."""
    num_tokens = prompt_len + output_len - 1
    attention = 4 * cfg.num_layers * cfg.q_size * num_tokens * (num_tokens + 1) / 2
    return 2 * layer_params(cfg) * num_tokens + 2 * cfg.vocab_size * cfg.hidden_size * output_len + attention


def workload_flops(cfg: ModelConfig, requests: list[dict]) -> float:
    return sum(request_flops(cfg, len(r["prompt"]), r["max_new_tokens"]) for r in requests)
