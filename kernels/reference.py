"""Torch implementations of every kernel: the CPU serving path and the oracle the Triton kernels are tested against.

Layouts shared with kernels/*.py:
    k_cache, v_cache: [num_kv_heads, num_blocks, block_size, head_dim]; slot = block_id * block_size + offset
        (head-major: one head's context gathers into a contiguous [num_seqs, context, head_dim] batch)
        an INT8 (int8) or FP8 (uint8: e4m3 bits) cache holds quantize_kv(x, scale) with one scale per layer for K
        and one for V (kv_scales: (k_scale, v_scale), kernels/quant.py), which attention reads as dequantize_kv
        (fp32 math where the cache is quantized)
    block_tables: [num_seqs, max_blocks] int32 (entries past a sequence's blocks are never read, and cache
        positions past its length never reach a result: they may hold another request's stale values, or NaN)
    query_starts: [num_seqs + 1] int32, seq_lens: [num_seqs] int32 (context length including the new tokens)
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.lora.executor import LoraExecutor as lora_executor  # noqa: F401 (an op)
from kernels.lora.reference import add_lora_delta, add_qkv_delta, lora_apply  # noqa: F401 (LoRA's oracle)
from kernels.metadata import AttentionMetadata, ExpertLora
from kernels.quant import QUANTIZED_WEIGHTS, Fp8Weight, QuantizedWeight, dequantize_kv, quantize_fp8, quantize_kv


def prepare_weight(name: str, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
    """A weight as `linear` takes it (here: as it is), given its name in the model (backend/model/llama.py)."""
    return weight


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias); weight: [out_dim, in_dim], or INT8 / INT4 / FP8 dequantized into x's dtype for this
    call (an FP8 one with fp8_activations: x's rows quantized as kernels/gemm.fp8_rows does, both in fp32)."""
    if isinstance(weight, Fp8Weight) and weight.fp8_activations:
        rows = quantize_fp8(x).dequantize(torch.float32)
        return F.linear(rows, weight.dequantize(torch.float32), None if bias is None else bias.float()).to(x.dtype)
    if isinstance(weight, QUANTIZED_WEIGHTS):
        return F.linear(x, weight.dequantize(x.dtype), bias)
    return F.linear(x, weight, bias)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_scales: tuple[float, float] | None = None) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] -> the cache slots named by slot_mapping [num_tokens] (an INT8
    or FP8 cache: quantize_kv against kv_scales; a bf16 one beside fp32 k, v: rounded)."""
    num_kv_heads, head_dim = k_cache.shape[0], k_cache.shape[3]
    if kv_scales is not None:
        k, v = quantize_kv(k, kv_scales[0], k_cache.dtype), quantize_kv(v, kv_scales[1], v_cache.dtype)
    k_cache.view(num_kv_heads, -1, head_dim)[:, slot_mapping] = k.transpose(0, 1).to(k_cache.dtype)
    v_cache.view(num_kv_heads, -1, head_dim)[:, slot_mapping] = v.transpose(0, 1).to(v_cache.dtype)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE. q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim],
    cos_sin: [max_positions, head_dim] fp32 (cos in the first half, sin in the second)."""
    half = q.shape[-1] // 2
    cs = cos_sin[positions]                   # [num_tokens, head_dim]
    cos = cs[:, None, :half].to(q.dtype)
    sin = cs[:, None, half:].to(q.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


def rotary_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, delta=None, kv_scales: tuple[float, float] | None = None
                     ) -> torch.Tensor:
    """RoPE of q and k, then k and v into the cache (write_kv_cache); returns the rotated q. q, k and v with the qkv
    projection's LoRA delta added first (add_qkv_delta)."""
    q, k, v = add_qkv_delta(q, k, v, delta)
    q, k = rotary(q, k, positions, cos_sin)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    return q


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, delta=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x), the sum written into residual (None: x alone), x with its LoRA delta
    added first (add_lora_delta). The variance in fp32, as Llama computes it. x, residual: [num_tokens, hidden]."""
    x = add_lora_delta(x, delta)
    if residual is not None:
        residual += x
        x = residual
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype), x


def silu_and_mul(gate_up: torch.Tensor, delta=None) -> torch.Tensor:
    """[num_tokens, 2 * inter] -> silu(gate) * up [num_tokens, inter], gate_up with its LoRA delta added first."""
    gate, up = add_lora_delta(gate_up, delta).chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor, delta=None) -> torch.Tensor:
    """[num_tokens, 2 * inter] -> gelu_tanh(gate) * up [num_tokens, inter] (Gemma's MLP; every backend's, unfused),
    gate_up with its LoRA delta added first."""
    gate, up = add_lora_delta(gate_up, delta).chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, lora: ExpertLora | None = None, add_lora=None) -> torch.Tensor:
    """Each token through its k experts' gated MLPs (with each row's adapter on its expert: `lora`), summed by its
    routing weights in fp32: the rows grouped by expert, one GEMM pair per expert with rows (the ids read on the
    host: no CUDA graph records this one), the adapted rows' LoRA by (slot, expert) group (`add_lora`, by default
    `add_group_lora`; the compiled CPU backend passes its own).
    x [num_tokens, hidden]; w_gate_up [num_experts, 2 * inter, hidden]; w_down [num_experts, hidden, inter];
    topk_weights [num_tokens, k] fp32; topk_ids [num_tokens, k] -> [num_tokens, hidden] in x's dtype."""
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w_gate_up.shape[0], w_down.shape[2]
    add_lora = add_lora or add_group_lora
    flat = topk_ids.flatten()                                                    # row t * k + j: token t's j-th
    experts = _groups(flat, num_experts)
    gate_up = x.new_empty(num_tokens * top_k, 2 * inter)
    for expert, rows in experts:
        gate_up[rows] = F.linear(x[rows // top_k], w_gate_up[expert])
    if lora is not None:
        add_lora(gate_up, x, top_k, lora.row_slots, flat, num_experts, lora.gate_up_a,
                 [lora.gate_up_b[0], lora.gate_up_b[1]], lora.slot_ranks)
    act = silu_and_mul(gate_up)
    down = x.new_empty(num_tokens * top_k, x.shape[1])
    for expert, rows in experts:
        down[rows] = F.linear(act[rows], w_down[expert])
    if lora is not None:
        add_lora(down, act, 1, lora.row_slots, flat, num_experts, lora.down_a, [lora.down_b], lora.slot_ranks)
    return (down.view(num_tokens, top_k, -1).float() * topk_weights[..., None].float()).sum(1).to(x.dtype)


def add_group_lora(out: torch.Tensor, x: torch.Tensor, rows_per_x: int, row_slots: torch.Tensor,
                   row_experts: torch.Tensor, num_experts: int, a: torch.Tensor, bs: list[torch.Tensor],
                   slot_ranks: torch.Tensor | None = None) -> None:
    """out[i] += row i's LoRA through its group g = row_slots[i] * num_experts + row_experts[i] (rows of slot -1:
    none): h = x[i // rows_per_x] @ a[g].T, cut into len(bs) equal parts, part j expanded by bs[j][g].T into its own
    columns. a [groups, rank, in], bs [groups, out_j, rank / parts]; slot_ranks (host, [slots]): each slot's rank,
    past which its matrices are zero."""
    adapted = (row_slots >= 0).nonzero().flatten()
    groups = row_slots[adapted].long() * num_experts + row_experts[adapted].long()
    ranks = None if slot_ranks is None else slot_ranks.repeat_interleave(num_experts)
    out[adapted] += _lora_rows(x[adapted // rows_per_x], a, bs, groups, ranks).to(out.dtype)


GATHERED_ROWS = 128         # up to this many adapted rows (a decode step's), their matrices gathered: a few batched
                            # matmuls instead of a shrink and an expand per group
PADDED_WASTE = 2.0          # more rows (a prompt chunk's): laid out per group, padded to the longest group's while
                            # that makes at most this many rows per row, else a shrink and an expand per group


def _lora_rows(x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor], groups: torch.Tensor,
               ranks: torch.Tensor | None = None) -> torch.Tensor:
    """Row i's LoRA through group groups[i] (add_group_lora's), [n, sum out_j] in x's dtype; ranks: each group's."""
    if x.shape[0] <= GATHERED_ROWS:
        h = torch.bmm(a[groups].to(x.dtype), x[:, :, None])[..., 0].chunk(len(bs), dim=1)
        return torch.cat([torch.bmm(b[groups].to(x.dtype), part[:, :, None])[..., 0] for b, part in zip(bs, h)], 1)
    counts = torch.bincount(groups, minlength=a.shape[0])
    active = counts.nonzero().flatten()
    if 2 * active.numel() >= a.shape[0]:                             # most groups: all of them, the stacks as they are
        active = torch.arange(a.shape[0], device=x.device)
    longest = int(counts.max()) if groups.numel() else 0
    if active.numel() * longest <= PADDED_WASTE * x.shape[0]:        # groups alike in size: padded, batched
        return _padded_lora_rows(x, a, bs, groups, counts, active, longest)
    out = x.new_zeros(x.shape[0], sum(b.shape[1] for b in bs))
    part_rank = a.shape[1] // len(bs)
    for group, rows in _groups(groups, a.shape[0]):
        r = part_rank if ranks is None else int(ranks[group])
        if r:
            x_g = x[rows]
            out[rows] = torch.cat([F.linear(F.linear(x_g, a[group, j * part_rank:j * part_rank + r].to(x.dtype)),
                                            b[group, :, :r].to(x.dtype)) for j, b in enumerate(bs)], dim=1)
    return out


def _padded_lora_rows(x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor], groups: torch.Tensor,
                      counts: torch.Tensor, active: torch.Tensor, longest: int) -> torch.Tensor:
    """_lora_rows with the rows laid out [active groups, longest, in], zero-padded: one batched shrink and one
    batched expand per part."""
    order = torch.argsort(groups, stable=True)
    sorted_groups = groups[order]
    slot_of = torch.empty(a.shape[0], dtype=torch.long, device=x.device)
    slot_of[active] = torch.arange(active.numel(), device=x.device)
    position = torch.arange(groups.numel(), device=x.device) - (counts.cumsum(0) - counts)[sorted_groups]
    padded = x.new_zeros(active.numel(), longest, x.shape[1])
    padded[slot_of[sorted_groups], position] = x[order]
    whole = active.numel() == a.shape[0]

    def stack(t: torch.Tensor) -> torch.Tensor:
        return (t if whole else t[active]).to(x.dtype).transpose(1, 2)

    h = torch.bmm(padded, stack(a)).chunk(len(bs), dim=2)                           # [groups, longest, rank]
    out = torch.empty(x.shape[0], sum(b.shape[1] for b in bs), dtype=x.dtype, device=x.device)
    column, where = 0, slot_of[sorted_groups]
    for b, part in zip(bs, h):                                                     # each part into its columns
        out[order, column:column + b.shape[1]] = torch.bmm(part, stack(b))[where, position]
        column += b.shape[1]
    return out


def _groups(keys: torch.Tensor, num_groups: int) -> list[tuple[int, torch.Tensor]]:
    """(group, its positions in keys) for each group with any, in group order."""
    order = torch.argsort(keys, stable=True)
    groups, start = [], 0
    for group, count in enumerate(torch.bincount(keys, minlength=num_groups).tolist()):
        if count:
            groups.append((group, order[start:start + count]))
        start += count
    return groups


def slot_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
              out: torch.Tensor, add_lora=None) -> None:
    """out[t] += x[t] @ a[slot].T @ b[slot].T for each token t with an adapter (slot = token_slots[t] >= 0): the
    LoRA of a projection kept whole per slot (a mixture's router, a shared expert's gate), add_group_lora over groups
    that are slots. a [num_slots, rank, in], b [num_slots, out, rank]."""
    (add_lora or add_group_lora)(out, x, 1, token_slots, torch.zeros_like(token_slots, dtype=torch.long), 1, a, [b])


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache[:, block_ids] as [num_kv_heads, *block_ids.shape, block_size, head_dim]; index_select over whole
    blocks copies faster than advanced indexing on CPU."""
    num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    rows = cache.view(num_kv_heads, num_blocks, block_size * head_dim).index_select(1, block_ids.flatten())
    return rows.view(num_kv_heads, *block_ids.shape, block_size, head_dim)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    num_blocks = -(-length // cache.shape[2])
    blocks = _gather_blocks(cache, block_table[:num_blocks])
    return blocks.flatten(1, 2)[:, :length]                                  # [num_kv_heads, length, head_dim]


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


@dataclass(slots=True)
class TorchPlan:
    """How the torch reference splits a step, built once and reused by every layer: prefill sequences one by one,
    decode sequences (one query each) batched in a padded copy."""
    prefill_ids: list[int]
    decode_token_ids: torch.Tensor            # [num_decode] int64: each decode sequence's query row
    decode_block_tables: torch.Tensor         # [num_decode, num_blocks] int32, trimmed to the longest context
    decode_seq_lens: torch.Tensor             # [num_decode] int64
    decode_valid: torch.Tensor                # [num_decode, num_blocks * block_size] bool: positions in the context
    decode_padding: torch.Tensor              # [num_padding] int64: flat (sequence, position) past seq_len

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int) -> "TorchPlan":
        starts, seq_lens, device = meta.query_starts_list, meta.seq_lens_list, meta.block_tables.device
        decode_ids = [s for s in range(len(seq_lens)) if starts[s + 1] - starts[s] == 1]
        prefill_ids = [s for s in range(len(seq_lens)) if starts[s + 1] - starts[s] > 1]
        num_blocks = -(-max((seq_lens[s] for s in decode_ids), default=0) // block_size)
        tables = meta.block_tables[torch.tensor(decode_ids, dtype=torch.int64, device=device), :num_blocks]
        decode_seq_lens = meta.seq_lens[decode_ids].long()
        valid = torch.arange(num_blocks * block_size, device=device)[None, :] < decode_seq_lens[:, None]
        return cls(prefill_ids, torch.tensor([starts[s] for s in decode_ids], dtype=torch.int64, device=device),
                   tables, decode_seq_lens, valid, (~valid).flatten().nonzero().flatten())


def step_plan(meta: AttentionMetadata, block_size: int) -> TorchPlan:
    if meta.torch_plan is None:
        meta.torch_plan = TorchPlan.build(meta, block_size)
    return meta.torch_plan


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, softcap: float | None = None,
                    kv_scales: tuple[float, float] | None = None) -> torch.Tensor:
    """Causal attention of packed queries over each sequence's paged context (K/V already written); softcap: the
    scores soft-capped first, softcap * tanh(scores / softcap) (Gemma 2); kv_scales: an INT8 cache's scales (its
    K and V dequantized, the math in fp32).

    q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]. Sequence s owns queries
    query_starts[s]:query_starts[s+1], the last tokens of its seq_lens[s] context tokens.
    """
    plan = step_plan(meta, k_cache.shape[2])
    out = torch.empty_like(q)
    prefill_attention(q, k_cache, v_cache, meta, plan, scale, sliding_window, out, softcap, kv_scales)
    if len(plan.decode_token_ids):
        out[plan.decode_token_ids] = _decode_attention(q[plan.decode_token_ids], k_cache, v_cache, plan, scale,
                                                       sliding_window, softcap, kv_scales).to(q.dtype)
    return out


def _dequantized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_scales: tuple[float, float] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, K and V as attention computes with them: in q's dtype (a bf16 cache beside fp32 q widened), or in fp32
    with an INT8 or FP8 cache's values dequantized."""
    if kv_scales is None:
        return q, k.to(q.dtype), v.to(q.dtype)
    return q.float(), dequantize_kv(k, kv_scales[0]), dequantize_kv(v, kv_scales[1])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      plan: TorchPlan, scale: float, sliding_window: int | None, out: torch.Tensor,
                      softcap: float | None = None, kv_scales: tuple[float, float] | None = None) -> None:
    """paged_attention's rows of the plan's prefill sequences, written into out, one sequence at a time."""
    for s in plan.prefill_ids:
        start, end, length = meta.query_starts_list[s], meta.query_starts_list[s + 1], meta.seq_lens_list[s]
        qs, k, v = _dequantized(q[start:end], _gather_context(k_cache, meta.block_tables[s], length)[None],
                                _gather_context(v_cache, meta.block_tables[s], length)[None], kv_scales)
        q_pos = torch.arange(length - (end - start), length, device=q.device)
        mask = _window_mask(q_pos, torch.arange(length, device=q.device), sliding_window)
        if softcap:                                       # scores capped before the mask: no fused kernel
            group = q.shape[1] // k.shape[1]
            scores = torch.einsum("thd,hkd->htk", qs.float(), k[0].repeat_interleave(group, 0).float())
            scores = softcap * torch.tanh(scores * scale / softcap)
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
            out[start:end] = torch.einsum("htk,hkd->thd", probs, v[0].repeat_interleave(group, 0)).to(out.dtype)
            continue
        o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], k, v, attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1).to(out.dtype)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TorchPlan, scale: float,
                      sliding_window: int | None, softcap: float | None = None,
                      kv_scales: tuple[float, float] | None = None) -> torch.Tensor:
    """One query per sequence, all sequences at once. q: [num_seqs, num_heads, head_dim]."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    k = _gather_blocks(k_cache, plan.decode_block_tables).flatten(2, 3)   # [num_kv_heads, num_seqs, context, head_dim]
    v = _gather_blocks(v_cache, plan.decode_block_tables).flatten(2, 3)
    q, k, v = _dequantized(q, k, v, kv_scales)
    if len(plan.decode_padding):              # stale (even NaN) values past a context must not meet a zero weight
        v.view(num_kv_heads, -1, head_dim).index_fill_(1, plan.decode_padding, 0)
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale    # [num_kv_heads, num_seqs, group, context]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    valid = plan.decode_valid
    if sliding_window is not None:
        k_pos = torch.arange(k.shape[2], device=q.device)
        valid = valid & (k_pos[None, :] > plan.decode_seq_lens[:, None] - 1 - sliding_window)
    scores.masked_fill_(~valid[None, :, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)        # [num_kv_heads, num_seqs, group, head_dim]
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)
