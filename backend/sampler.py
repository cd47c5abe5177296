"""Next-token choice for a whole batch: penalties, bans, then greedy or seeded temperature / top-k / top-p."""
import torch

from backend.request import Sequence


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Repetition (over prompt and output, divides positive logits), presence and frequency (over output)."""
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)))
            values = logits[row, seen]
            logits[row, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.output_ids:
            tokens, counts = torch.tensor(seq.output_ids).unique(return_counts=True)
            logits[row, tokens] -= p.presence_penalty + p.frequency_penalty * counts.float()


def apply_bans(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """end_id before min_tokens, and the last token of every bad word whose prefix was just generated."""
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.end_id is not None and len(seq.output_ids) < p.min_tokens:
            logits[row, p.end_id] = float("-inf")
        for word in p.bad_words:
            prefix = word[:-1]
            if not prefix or seq.token_ids[-len(prefix):] == prefix:
                logits[row, word[-1]] = float("-inf")


def sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Temperature, top-k and top-p for all rows at once, then one exponential race per row (Gumbel-max in its
    exponential form) with each sequence's own generator, so seeded requests repeat whatever their batch.
    logits: [num_rows, vocab] fp32 -> tokens [num_rows] int64."""
    params = [seq.params for seq in seqs]
    logits = logits / torch.tensor([p.temperature for p in params])[:, None]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < logits.shape[1] else 0 for p in params])
    if top_k.any():
        top = torch.topk(logits, int(top_k.max())).values
        kth = top.gather(1, (top_k - 1).clamp(min=0)[:, None])
        logits = logits.masked_fill((logits < kth) & (top_k > 0)[:, None], float("-inf"))
    top_p = torch.tensor([p.top_p for p in params])
    if (top_p < 1.0).any():
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p[:, None]          # keep the smallest set reaching top_p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    noise = torch.empty_like(probs)
    for row, seq in enumerate(seqs):
        noise[row].exponential_(1.0, generator=seq.generator)
    return (probs / noise).argmax(-1)


class Sampler:
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float | None]]:
        """logits: [num_seqs, vocab] fp32 (modified in place). Returns each sequence's token and its log prob
        (None where not asked for)."""
        apply_penalties(logits, seqs)
        apply_bans(logits, seqs)
        tokens = logits.argmax(-1).tolist()
        sampled_rows = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
        if sampled_rows:
            picks = sample_rows(logits[sampled_rows], [seqs[row] for row in sampled_rows])
            for row, token in zip(sampled_rows, picks.tolist()):
                tokens[row] = token
        log_probs: list[float | None] = [None] * len(seqs)
        rows = [row for row, seq in enumerate(seqs) if seq.params.return_log_probs]
        if rows:
            chosen = torch.log_softmax(logits[rows], dim=-1)[torch.arange(len(rows)), [tokens[r] for r in rows]]
            for row, value in zip(rows, chosen.tolist()):
                log_probs[row] = value
        return tokens, log_probs
