"""Llama-family transformer over packed tokens: GQA attention on a paged KV cache, SwiGLU MLP, RMSNorm, RoPE."""
import torch
import torch.nn.functional as F

from backend.model.config import ModelConfig
from backend.model.context import StepContext
from backend.model.layers import linear, rope_cos_sin


class LlamaModel:
    """Weights as plain tensors (see loader.translation_table for their names) and one forward per step."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], ops, all_reduce=None):
        """cfg: this rank's share under tensor parallelism (ModelConfig.shard), whose row-parallel projections (o,
        down) give partial sums that all_reduce adds up in place."""
        self.cfg = cfg
        self.w = weights
        self.ops = ops
        self.all_reduce = all_reduce
        self.cos_sin = rope_cos_sin(cfg).to(weights["embed_tokens"].device)   # [max_positions, head_dim] fp32
        self.scale = cfg.head_dim ** -0.5

    def forward(self, ctx: StepContext, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                with_context: bool = False, logits: bool = True) -> torch.Tensor | None:
        """Logits [num_sampled, vocab] (fp32) for the last token of each sequence that samples this step, then
        (with_context) those of ctx.context_indices: [num_sampled + num_context, vocab]. logits=False (a tensor
        parallel worker) runs the layers only."""
        cfg, w, ops = self.cfg, self.w, self.ops
        h = F.embedding(ctx.input_ids, w["embed_tokens"])          # [num_tokens, hidden]
        residual = None                                             # the stream the layers add to
        for i in range(cfg.num_layers):
            x, residual = ops.add_rms_norm(h, residual, w[f"layers.{i}.input_norm"], cfg.rms_norm_eps)
            h = self._attention(i, x, ctx, kv_caches[i])
            x, residual = ops.add_rms_norm(h, residual, w[f"layers.{i}.post_attn_norm"], cfg.rms_norm_eps)
            gate_up = linear(ops, x, w[f"layers.{i}.gate_up_proj"], None, ctx.lora, i, "gate_up")
            h = linear(ops, ops.silu_and_mul(gate_up), w[f"layers.{i}.down_proj"], None, ctx.lora, i, "down")
            if self.all_reduce is not None:
                self.all_reduce(h)
            if ctx.between_layers is not None:
                ctx.between_layers()
        if not logits:
            return None
        rows = torch.cat([ctx.logits_indices, ctx.context_indices]) if with_context else ctx.logits_indices
        last, _ = ops.add_rms_norm(h[rows], residual[rows], w["norm"], cfg.rms_norm_eps)
        return ops.linear(last, w["lm_head"], None).float()

    def _attention(self, i: int, x: torch.Tensor, ctx: StepContext, kv_cache) -> torch.Tensor:
        cfg, w, ops = self.cfg, self.w, self.ops
        qkv = linear(ops, x, w[f"layers.{i}.qkv_proj"], w.get(f"layers.{i}.qkv_bias"), ctx.lora, i, "qkv")
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)                 # [num_tokens, num_heads, head_dim]
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)              # [num_tokens, num_kv_heads, head_dim]
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        k_cache, v_cache = kv_cache
        q = ops.rotary_and_cache(q, k, v, ctx.positions, self.cos_sin, k_cache, v_cache, ctx.attn.slot_mapping)
        o = ops.paged_attention(q, k_cache, v_cache, ctx.attn, self.scale, cfg.sliding_window)
        out = linear(ops, o.flatten(1), w[f"layers.{i}.o_proj"], None, ctx.lora, i, "o")
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out
