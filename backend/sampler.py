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


def _sample_row(logits: torch.Tensor, seq: Sequence) -> int:
    p = seq.params
    logits = logits / p.temperature
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p        # keep the smallest set reaching top_p
        logits = logits.index_fill(0, order[drop], float("-inf"))
    probs = logits.softmax(-1)
    noise = torch.empty_like(probs).exponential_(1.0, generator=seq.generator)
    return int((probs / noise).argmax())


class Sampler:
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float | None]]:
        """logits: [num_seqs, vocab] fp32 (modified in place). Returns each sequence's token and its log prob
        (None where not asked for)."""
        apply_penalties(logits, seqs)
        apply_bans(logits, seqs)
        tokens = logits.argmax(-1).tolist()
        for row, seq in enumerate(seqs):
            if not seq.params.greedy:
                tokens[row] = _sample_row(logits[row], seq)
        log_probs: list[float | None] = [None] * len(seqs)
        rows = [row for row, seq in enumerate(seqs) if seq.params.return_log_probs]
        if rows:
            chosen = torch.log_softmax(logits[rows], dim=-1)[torch.arange(len(rows)), [tokens[r] for r in rows]]
            for row, value in zip(rows, chosen.tolist()):
                log_probs[row] = value
        return tokens, log_probs
