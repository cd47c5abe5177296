"""The torch reference of LoRA (every backend's oracle, what the torch backend runs): each module band of a
projection per segment, or one batched matmul over the step's padded grid; DoRA's magnitudes; and a projection's
product left for the op after its GEMM (kernels/lora/executor.LoraDelta) added as that op adds it."""
import torch


def add_lora_delta(x: torch.Tensor, delta) -> torch.Tensor:
    """x with a projection's LoRA product added (kernels/lora/executor.LoraDelta; None: x as it is): each row with an
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
