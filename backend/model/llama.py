"""Llama-family transformer over packed tokens: GQA attention on a paged KV cache, a gated MLP, RMSNorm, RoPE; and
what other families add to it: RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3), norms on the
attention's and the MLP's outputs, per-layer windows and RoPE bases, GELU-tanh, scaled embeddings (Gemma 3); a
mixture of experts in place of the MLP, with a shared expert beside it (Qwen3-MoE, Qwen2-MoE, Mixtral)."""
from dataclasses import replace

import torch
import torch.nn.functional as F

from backend.model import rope
from backend.model.checkpoint import ModelConfig
from backend.model.context import StepContext
from kernels import reference


def route(logits: torch.Tensor, top_k: int, renormalize: bool, rounded_to: torch.dtype | None = None,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top k experts by softmax(logits) in fp32, their weights renormalized to sum 1 where asked and
    rounded to `rounded_to` where the model does (Qwen: to the logits' dtype): (weights fp32 [num_tokens, k],
    expert ids [num_tokens, k])."""
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if rounded_to is None else weights.to(rounded_to).float()), ids


class LlamaModel:
    """Weights as plain tensors (see loader.translation_table for their names) and one forward per step."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], ops, all_reduce=None):
        """cfg: this rank's share under tensor parallelism (ModelConfig.shard), whose row-parallel projections (o,
        down) give partial sums that all_reduce adds up in place."""
        self.cfg = cfg
        self.w = weights
        self.ops = ops
        self.all_reduce = all_reduce
        device = weights["embed_tokens"].device
        self.cos_sin = rope.cos_sin(cfg).to(device)                             # [rows, head_dim] fp32
        self.local_cos_sin = None if cfg.local_rope_theta is None else rope.cos_sin(   # sliding-window layers'
            replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None)).to(device)
        self.scale = cfg.attention_scale or cfg.head_dim ** -0.5
        self.kv_scales: list[tuple[float, float]] | None = None     # an INT8 KV cache's (k, v) scales by layer

    def forward(self, ctx: StepContext, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                with_context: bool = False, logits: bool = True) -> torch.Tensor | None:
        """Logits [num_sampled, vocab] (fp32) for the last token of each sequence that samples this step, then
        (with_context) those of ctx.context_indices: [num_sampled + num_context, vocab]; ctx.prompt_scores gets its
        rows' log probs. logits=False (a tensor parallel worker) runs the layers only. The pieces below are what
        piecewise graphs record between the attention calls (backend/model/piecewise.py)."""
        h, residual, delta = self.embed(ctx), None, None            # [num_tokens, hidden]; the stream layers add to
        for i in range(self.cfg.num_layers):
            q, residual = self.before_attention(i, h, residual, ctx, kv_caches[i], delta)
            h, residual, delta = self.after_attention(i, self.attention(i, q, ctx, kv_caches[i]), residual, ctx)
        if not logits:
            return None
        if ctx.prompt_scores is not None:
            ctx.prompt_scores.compute(lambda rows: self.logits(h, residual, rows), self.cfg.vocab_size)
        rows = torch.cat([ctx.logits_indices, ctx.context_indices]) if with_context else ctx.logits_indices
        return self.logits(h, residual, rows)

    def embed(self, ctx: StepContext) -> torch.Tensor:
        h = F.embedding(ctx.input_ids, self.w["embed_tokens"])
        return h if self.cfg.embedding_scale == 1.0 else h * torch.tensor(self.cfg.embedding_scale, dtype=h.dtype)

    def before_attention(self, i: int, h: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext,
                         kv_cache, delta=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i up to its attention: the norm (adding delta, the LoRA the layer before left in h), q/k/v (with
        adapters: their LoRA added by the rotary op where the step folds, unless a norm of q and k comes first),
        RoPE and the new tokens' K/V into the cache. Returns q [num_tokens, num_heads, head_dim] and the residual
        stream."""
        cfg, w, ops = self.cfg, self.w, self.ops
        x, residual = ops.add_rms_norm(h, residual, w[f"layers.{i}.input_norm"], cfg.rms_norm_eps, delta)
        qkv, delta = self.project(x, i, "qkv", ctx, defer=not cfg.qk_norm, bias=w.get(f"layers.{i}.qkv_bias"))
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)                 # [num_tokens, num_heads, head_dim]
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)              # [num_tokens, num_kv_heads, head_dim]
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:                                             # (v as k: the rotary ops take them alike)
            q, k = self.head_norm(q, w[f"layers.{i}.q_norm"]), self.head_norm(k, w[f"layers.{i}.k_norm"])
            v = v.contiguous()
        k_cache, v_cache = kv_cache
        cos_sin = self.cos_sin if self.local_cos_sin is None or cfg.window(i) is None else self.local_cos_sin
        q = ops.rotary_and_cache(q, k, v, ctx.positions, cos_sin, k_cache, v_cache, ctx.attn.slot_mapping, delta,
                                 kv_scales=self.kv_scales[i] if self.kv_scales else None)
        return q, residual

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x alone, no residual: [num_tokens, dim]."""
        return self.ops.add_rms_norm(x, None, weight, self.cfg.rms_norm_eps)[0]

    def head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head: [num_tokens, heads, head_dim] -> the same, contiguous."""
        num_heads, head_dim = x.shape[1:]
        return self.ops.add_rms_norm(x.reshape(-1, head_dim), None, weight, self.cfg.rms_norm_eps)[0].view(
            -1, num_heads, head_dim)

    def attention(self, i: int, q: torch.Tensor, ctx: StepContext, kv_cache) -> torch.Tensor:
        """[num_tokens, num_heads * head_dim]: each token's attention over its sequence's cached context."""
        k_cache, v_cache = kv_cache
        return self.ops.paged_attention(q, k_cache, v_cache, ctx.attn, self.scale, self.cfg.window(i),
                                        self.cfg.attn_logit_softcap,
                                        kv_scales=self.kv_scales[i] if self.kv_scales else None).flatten(1)

    def after_attention(self, i: int, o: torch.Tensor, residual: torch.Tensor, ctx: StepContext,
                        ) -> tuple[torch.Tensor, torch.Tensor, object | None]:
        """Layer i from its attention's output: o (with adapters), the norm, the MLP (with adapters). Returns h, the
        residual stream and the LoRA delta of down left for the next layer's norm to add (None: in h already).
        Where a step folds LoRA (layers.linear_deferred), the op after each GEMM adds its delta: o's and down's the
        residual add (where nothing comes between: no all-reduce, no norm of its own), gate_up's the activation
        (and qkv's the rotary op, before_attention)."""
        cfg, w, ops = self.cfg, self.w, self.ops
        into_stream = self.all_reduce is None and not cfg.sandwich_norms
        h, delta = self.project(o, i, "o", ctx, defer=into_stream)
        if self.all_reduce is not None:
            self.all_reduce(h)
        if cfg.sandwich_norms:
            h = self.norm(h, w[f"layers.{i}.attn_out_norm"])
        x, residual = ops.add_rms_norm(h, residual, w[f"layers.{i}.post_attn_norm"], cfg.rms_norm_eps, delta)
        if cfg.is_moe(i):
            h, delta = self.mixture(i, x, ctx), None
        else:
            h, delta = self.mlp(i, x, ctx, defer=into_stream and i < cfg.num_layers - 1)
        if self.all_reduce is not None:
            self.all_reduce(h)
        if cfg.sandwich_norms:
            h = self.norm(h, w[f"layers.{i}.mlp_out_norm"])
        if ctx.between_layers is not None:
            ctx.between_layers()
        return h, residual, delta

    def mlp(self, i: int, x: torch.Tensor, ctx: StepContext, defer: bool) -> tuple[torch.Tensor, object | None]:
        """Layer i's gated MLP (or shared expert) with adapters: gate_up, the activation, down (whose LoRA delta is
        left for the next op where `defer`)."""
        gate_up, delta = self.project(x, i, "gate_up", ctx, defer=True)
        act = (self.ops.silu_and_mul(gate_up, delta) if self.cfg.hidden_act == "silu"
               else reference.gelu_tanh_and_mul(gate_up, delta))
        return self.project(act, i, "down", ctx, defer=defer)

    def mixture(self, i: int, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Layer i's mixture of experts: the router's top k experts of each token, their gated MLPs summed by the
        routing weights (ops.fused_moe), and the shared expert scaled by its sigmoid gate; each with adapters (the
        router, every expert, the shared expert and its gate). [num_tokens, hidden]"""
        cfg, w, lora = self.cfg, self.w, ctx.lora
        logits = self.ops.linear(x, w[f"layers.{i}.router"], None)                 # [num_tokens, num_experts]
        if lora is not None:
            lora.add_router(i, x, logits)
        weights, ids = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                             None if cfg.architecture == "MixtralForCausalLM" else logits.dtype)
        h = self.ops.fused_moe(x, w[f"layers.{i}.experts_gate_up"], w[f"layers.{i}.experts_down"], weights, ids,
                               None if lora is None else lora.experts(i, x, cfg.num_experts_per_tok))
        if cfg.shared_expert:
            shared, _ = self.mlp(i, x, ctx, defer=False)
            gate = F.linear(x, w[f"layers.{i}.shared_expert_gate"])                  # [num_tokens, 1]
            if lora is not None:
                lora.add_shared_gate(i, x, gate)
            h = h + torch.sigmoid(gate) * shared
        return h

    def project(self, x: torch.Tensor, i: int, proj: str, ctx: StepContext, defer: bool,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, object | None]:
        """Layer i's projection of x with adapters; defer: its LoRA delta may be left for the next op."""
        weight = self.w[f"layers.{i}.{proj}_proj"]
        if ctx.lora is None:                               # no adapter in the step: the GEMM alone
            return self.ops.linear(x, weight, bias), None
        if defer:                                          # (out, LoraDelta) where the step folds, else (out, None)
            return ctx.lora.linear_deferred(x, weight, bias, i, proj)
        return ctx.lora.linear(x, weight, bias, i, proj), None

    def logits(self, h: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[len(rows), vocab] fp32: the final norm and the LM head over the rows asked for."""
        last, _ = self.ops.add_rms_norm(h[rows], residual[rows], self.w["norm"], self.cfg.rms_norm_eps)
        logits = self.ops.linear(last, self.w["lm_head"], None).float()
        cap = self.cfg.final_logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap
