"""Torch implementations of every kernel: the CPU serving path and the oracle the Triton kernels are tested against.

Layouts shared with kernels/*.py:
    k_cache, v_cache: [num_kv_heads, num_blocks, block_size, head_dim]; slot = block_id * block_size + offset
        (head-major: one head's context gathers into a contiguous [num_seqs, context, head_dim] batch)
    block_tables: [num_seqs, max_blocks] int32 (entries past a sequence's blocks are never read, and cache
        positions past its length never reach a result: they may hold another request's stale values, or NaN)
    query_starts: [num_seqs + 1] int32, seq_lens: [num_seqs] int32 (context length including the new tokens)
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata


def prepare_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights as `linear` takes them (here: as they are)."""
    return weights


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias); weight: [out_dim, in_dim]."""
    return F.linear(x, weight, bias)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] -> the cache slots named by slot_mapping [num_tokens]."""
    num_kv_heads, head_dim = k_cache.shape[0], k_cache.shape[3]
    k_cache.view(num_kv_heads, -1, head_dim)[:, slot_mapping] = k.transpose(0, 1)
    v_cache.view(num_kv_heads, -1, head_dim)[:, slot_mapping] = v.transpose(0, 1)


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
                     slot_mapping: torch.Tensor, delta=None) -> torch.Tensor:
    """RoPE of q and k, then k and v into the cache; returns the rotated q. q, k and v with the qkv projection's LoRA
    delta added first (add_qkv_delta)."""
    q, k, v = add_qkv_delta(q, k, v, delta)
    q, k = rotary(q, k, positions, cos_sin)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q


def add_lora_delta(x: torch.Tensor, delta) -> torch.Tensor:
    """x with a projection's LoRA product added (kernels/lora_overlap.LoraDelta; None: x as it is): each row with an
    adapter ((x.float() + delta) * m[slot]).to(x.dtype), the bits lora_merge gives."""
    if delta is None:
        return x
    rows = (delta.token_slots >= 0).nonzero().flatten()
    out = x.clone()
    scale = delta.m[delta.token_slots[rows].long()].float()
    out[rows] = ((x[rows].float() + delta.delta[rows]) * scale).to(x.dtype)
    return out


def add_qkv_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, delta) -> tuple[torch.Tensor, ...]:
    """q, k, v [num_tokens, heads, head_dim] with the qkv projection's LoRA delta added (add_lora_delta over its
    columns: q's, then k's, then v's); as they are where delta is None."""
    if delta is None:
        return q, k, v
    qkv = add_lora_delta(torch.cat([t.flatten(1) for t in (q, k, v)], dim=1), delta)
    parts = qkv.split([t.shape[1] * t.shape[2] for t in (q, k, v)], dim=1)
    return tuple(part.reshape(t.shape) for part, t in zip(parts, (q, k, v)))


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


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache[:, block_ids] as [num_kv_heads, *block_ids.shape, block_size, head_dim]; index_select over whole
    blocks copies ~3x faster than advanced indexing on CPU."""
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
                    scale: float, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of packed queries over each sequence's paged context (K/V already written); softcap: the
    scores soft-capped first, softcap * tanh(scores / softcap) (Gemma 2).

    q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]. Sequence s owns queries
    query_starts[s]:query_starts[s+1], the last tokens of its seq_lens[s] context tokens.
    """
    plan = step_plan(meta, k_cache.shape[2])
    out = torch.empty_like(q)
    prefill_attention(q, k_cache, v_cache, meta, plan, scale, sliding_window, out, softcap)
    if len(plan.decode_token_ids):
        out[plan.decode_token_ids] = _decode_attention(q[plan.decode_token_ids], k_cache, v_cache, plan, scale,
                                                       sliding_window, softcap)
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      plan: TorchPlan, scale: float, sliding_window: int | None, out: torch.Tensor,
                      softcap: float | None = None) -> None:
    """paged_attention's rows of the plan's prefill sequences, written into out, one sequence at a time."""
    for s in plan.prefill_ids:
        start, end, length = meta.query_starts_list[s], meta.query_starts_list[s + 1], meta.seq_lens_list[s]
        k = _gather_context(k_cache, meta.block_tables[s], length)[None]
        v = _gather_context(v_cache, meta.block_tables[s], length)[None]
        q_pos = torch.arange(length - (end - start), length, device=q.device)
        mask = _window_mask(q_pos, torch.arange(length, device=q.device), sliding_window)
        if softcap:                                       # scores capped before the mask: no fused kernel
            group = q.shape[1] // k.shape[1]
            scores = torch.einsum("thd,hkd->htk", q[start:end].float(), k[0].repeat_interleave(group, 0).float())
            scores = softcap * torch.tanh(scores * scale / softcap)
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
            out[start:end] = torch.einsum("htk,hkd->thd", probs, v[0].repeat_interleave(group, 0))
            continue
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None], k, v, attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TorchPlan, scale: float,
                      sliding_window: int | None, softcap: float | None = None) -> torch.Tensor:
    """One query per sequence, all sequences at once. q: [num_seqs, num_heads, head_dim]."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    k = _gather_blocks(k_cache, plan.decode_block_tables).flatten(2, 3)   # [num_kv_heads, num_seqs, context, head_dim]
    v = _gather_blocks(v_cache, plan.decode_block_tables).flatten(2, 3)
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


def active_bands(proj, segments) -> list[tuple]:
    """(band, its ranks by slot) of each module band of a projection (backend/lora/slots.Projection) that a slot of
    the step has a rank in."""
    slot_ids = {slot for slot in segments.slots_list if slot >= 0}
    bands = [(band, band.host_ranks.tolist()) for band in proj.bands]
    return [(band, ranks) for band, ranks in bands if any(ranks[slot] for slot in slot_ids)]


def lora_apply(x: torch.Tensor, proj, segments, out: torch.Tensor) -> None:
    """Every band of a projection: out[:, band.columns] += lora_expand(lora_shrink(x, band.a), band.b); then, for
    the tokens of a slot with DoRA modules in the projection, out[tokens] *= proj.m[slot] (a magnitude scales its
    module's whole output, base included; 1 where the slot has no DoRA module)."""
    for band, ranks_list in active_bands(proj, segments):
        lora_apply_band(x, band.a, band.b, segments, band.ranks, ranks_list, out[:, slice(*band.columns)])
    dora_scale(proj, segments, out)


def dora_scale(proj, segments, out: torch.Tensor) -> None:
    """out[tokens of a slot with DoRA modules in the projection] *= proj.m[slot]."""
    starts = segments.starts_list
    dora = {slot for band in proj.bands if band.host_dora is not None
            for slot in band.host_dora.nonzero().flatten().tolist()}
    for s, slot in enumerate(segments.slots_list):
        if slot >= 0 and slot in dora:
            rows = out[starts[s]:starts[s + 1]]
            rows.copy_((rows.float() * proj.m[slot].float()).to(rows.dtype))


def lora_apply_band(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, segments, ranks: torch.Tensor,
                    ranks_list: list[int], out: torch.Tensor) -> None:
    """One module band: out += lora_expand(lora_shrink(x)) (see both)."""
    lora_expand(lora_shrink(x, lora_a, segments, ranks, ranks_list), lora_b, segments, ranks, ranks_list, out)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, segments, ranks: torch.Tensor,
                ranks_list: list[int]) -> torch.Tensor:
    """h[start:end, :rank[slot]] = x[start:end] @ lora_a[slot, :rank[slot]].T for each segment with a slot.

    x: [num_tokens, in_dim]; lora_a: [num_slots, cap, in_dim], in x's dtype or a narrower one (widened to x's for
    the matmul) -> h: [num_tokens, cap] in x's dtype (zeros where unused). One batched matmul over the segments'
    padded grid when they have one, else one matmul per segment.
    """
    h = x.new_zeros(x.shape[0], lora_a.shape[1])
    grid = segments.padded
    if grid is not None:
        rank = max(ranks_list[slot] for slot in grid.slot_ids)
        if rank:
            a = lora_a[grid.slot_start:grid.slot_start + grid.num_slots, :rank].transpose(1, 2).to(x.dtype)
            x_grid = _to_grid(x[grid.token_start:], grid)                    # [num_slots, max_len, in_dim]
            h_grid = torch.bmm(x_grid, a).masked_fill_(_past_rank(ranks, grid, rank), 0)   # [.., max_len, rank]
            h[grid.token_start:, :rank] = _from_grid(h_grid, grid)
        return h
    starts = segments.starts_list
    for s, slot in enumerate(segments.slots_list):
        rank = ranks_list[slot] if slot >= 0 else 0
        if rank:
            h[starts[s]:starts[s + 1], :rank] = x[starts[s]:starts[s + 1]] @ lora_a[slot, :rank].T.to(x.dtype)
    return h


def lora_expand(h: torch.Tensor, lora_b: torch.Tensor, segments, ranks: torch.Tensor, ranks_list: list[int],
                out: torch.Tensor) -> None:
    """out[start:end] += h[start:end, :rank[slot]] @ lora_b[slot, :, :rank[slot]].T for each segment with a slot.

    h: [num_tokens, cap]; lora_b: [num_slots, out_dim, cap]; out: [num_tokens, out_dim], updated in place.
    """
    grid = segments.padded
    if grid is not None:
        rank = max(ranks_list[slot] for slot in grid.slot_ids)
        if rank:
            b = lora_b[grid.slot_start:grid.slot_start + grid.num_slots, :, :rank].transpose(1, 2).to(h.dtype)
            h_grid = _to_grid(h[grid.token_start:, :rank], grid).masked_fill_(_past_rank(ranks, grid, rank), 0)
            out[grid.token_start:] += _from_grid(torch.bmm(h_grid, b), grid)
        return
    starts = segments.starts_list
    for s, slot in enumerate(segments.slots_list):
        rank = ranks_list[slot] if slot >= 0 else 0
        if rank:
            out[starts[s]:starts[s + 1]] += h[starts[s]:starts[s + 1], :rank] @ lora_b[slot, :, :rank].T.to(h.dtype)


def _to_grid(rows: torch.Tensor, grid) -> torch.Tensor:
    """[num_rows, dim] -> [num_slots, max_len, dim], zeros where a slot has fewer tokens (or none): padding
    rows stay zero through both matmuls."""
    padded = rows.new_zeros(grid.num_slots * grid.max_len, rows.shape[1]).index_copy_(0, grid.rows.long(), rows)
    return padded.view(grid.num_slots, grid.max_len, -1)


def _past_rank(ranks: torch.Tensor, grid, rank: int) -> torch.Tensor:
    """[num_slots, 1, rank] bool: the columns past each slot's own rank, which lower-rank slots must ignore."""
    slot_ranks = ranks[grid.slot_start:grid.slot_start + grid.num_slots, None, None]
    return torch.arange(rank, device=ranks.device) >= slot_ranks


def _from_grid(padded: torch.Tensor, grid) -> torch.Tensor:
    return padded.flatten(0, 1).index_select(0, grid.rows)
