"""Llama-family transformer over packed tokens: GQA attention on a paged KV cache, SwiGLU MLP, RMSNorm, RoPE."""
import torch
import torch.nn.functional as F

from backend.model.config import ModelConfig
from backend.model.context import StepContext
from backend.model.layers import linear, rms_norm, rope_cos_sin, silu_and_mul


class LlamaModel:
    """Weights as plain tensors (see loader.translation_table for their names) and one forward per step."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], ops):
        self.cfg = cfg
        self.w = weights
        self.ops = ops
        self.cos_sin = rope_cos_sin(cfg).to(weights["embed_tokens"].device)   # [max_positions, head_dim] fp32
        self.scale = cfg.head_dim ** -0.5

    def forward(self, ctx: StepContext, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                with_context: bool = False) -> torch.Tensor:
        """Logits [num_sampled, vocab] (fp32) for the last token of each sequence that samples this step, then
        (with_context) those of ctx.context_indices: [num_sampled + num_context, vocab]."""
        cfg, w = self.cfg, self.w
        h = F.embedding(ctx.input_ids, w["embed_tokens"])          # [num_tokens, hidden]
        for i in range(cfg.num_layers):
            h = h + self._attention(i, rms_norm(h, w[f"layers.{i}.input_norm"], cfg.rms_norm_eps), ctx, kv_caches[i])
            x = rms_norm(h, w[f"layers.{i}.post_attn_norm"], cfg.rms_norm_eps)
            gate_up = linear(x, w[f"layers.{i}.gate_up_proj"], None, ctx.lora, i, "gate_up")
            h = h + linear(silu_and_mul(gate_up), w[f"layers.{i}.down_proj"], None, ctx.lora, i, "down")
        rows = torch.cat([ctx.logits_indices, ctx.context_indices]) if with_context else ctx.logits_indices
        last = rms_norm(h[rows], w["norm"], cfg.rms_norm_eps)
        return F.linear(last, w["lm_head"]).float()

    def _attention(self, i: int, x: torch.Tensor, ctx: StepContext, kv_cache) -> torch.Tensor:
        cfg, w, ops = self.cfg, self.w, self.ops
        qkv = linear(x, w[f"layers.{i}.qkv_proj"], w.get(f"layers.{i}.qkv_bias"), ctx.lora, i, "qkv")
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)                 # [num_tokens, num_heads, head_dim]
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)              # [num_tokens, num_kv_heads, head_dim]
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        q, k = ops.rotary(q, k, ctx.positions, self.cos_sin)
        k_cache, v_cache = kv_cache
        ops.write_kv_cache(k, v, k_cache, v_cache, ctx.attn.slot_mapping)
        o = ops.paged_attention(q, k_cache, v_cache, ctx.attn, self.scale, cfg.sliding_window)
        return linear(o.flatten(1), w[f"layers.{i}.o_proj"], None, ctx.lora, i, "o")
