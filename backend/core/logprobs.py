"""Log probs beyond the chosen tokens': the prompt's, scored on the device as its chunks run, and the top
alternatives at each position; gathered on the host into a request's outputs.

A prompt token's log prob is that of the logits at the position before it, so a prompt of P tokens has P - 1 of
them: positions 0..P-2 of its chunks are scored (the last position's logits are the first sample's). Row 0 of a
request's prompt log probs stands for its first token, which nothing predicts: NaN, ids -1 (vLLM returns None).
"""
from dataclasses import dataclass
from typing import Callable

import torch

SCORE_VALUES = 1 << 23                        # logits of one slice of scored rows: [rows, vocab] fp32, 32 MiB


class PromptScores:
    """One step's scored prompt rows on the device: their positions among the step's tokens, the next prompt token
    of each, and how many top alternatives the step returns (its requests' largest k)."""

    def __init__(self, rows: torch.Tensor, targets: torch.Tensor, k: int):
        self.rows, self.targets, self.k = rows.long(), targets.long(), k
        self.values: torch.Tensor | None = None   # [n, 2 + k] fp32: each row's target's log prob and rank, then the
                                                  # top k's log probs
        self.ids: torch.Tensor | None = None      # [n, k] int32: the top k's ids

    def compute(self, logits_of: Callable[[torch.Tensor], torch.Tensor], vocab_size: int) -> None:
        """Semantics (in slices of rows, so that no more than SCORE_VALUES logits live at once):
            log_probs = logits_of(rows).log_softmax(-1)                      # [n, vocab] fp32
            chosen = log_probs.gather(1, targets[:, None])                    # [n, 1]
            rank = (log_probs > chosen).sum(-1, keepdim=True) + 1             # [n, 1]: 1 for the most likely
            values = cat([chosen, rank, log_probs.topk(k).values], dim=1)
            ids = log_probs.topk(k).indices"""
        n, k, step = self.rows.shape[0], self.k, max(1, SCORE_VALUES // vocab_size)
        device = self.rows.device
        self.values = torch.empty(n, 2 + k, dtype=torch.float32, device=device)
        self.ids = torch.empty(n, k, dtype=torch.int32, device=device)
        for start in range(0, n, step):
            end = min(n, start + step)
            log_probs = logits_of(self.rows[start:end]).log_softmax(-1)
            chosen = log_probs.gather(1, self.targets[start:end, None])
            self.values[start:end, 0] = chosen[:, 0]
            self.values[start:end, 1] = (log_probs > chosen).sum(-1) + 1
            if k:
                top = log_probs.topk(k)
                self.values[start:end, 2:] = top.values
                self.ids[start:end] = top.indices


@dataclass(slots=True)
class PromptLogProbs:
    """A request's prompt scored: row i is prompt token i given those before it (row 0: NaN, rank 0, ids -1)."""
    log_probs: torch.Tensor                   # [P] fp32
    ranks: torch.Tensor                       # [P] int32: 1 + the tokens more likely than it
    top_log_probs: torch.Tensor               # [P, k] fp32: the k most likely tokens at each position
    top_ids: torch.Tensor                     # [P, k] int32


def prompt_log_probs(chunks: dict[int, tuple[torch.Tensor, torch.Tensor]], k: int) -> PromptLogProbs:
    """A sequence's scored chunks (chunk start -> host values [n, 2 + k'] and ids [n, k'], k' >= k: its steps'
    largest k) as its prompt's log probs."""
    starts = sorted(chunks)
    first = torch.full((1, k + 2), float("nan"))
    first[0, 1] = 0
    values = torch.cat([first] + [chunks[s][0][:, :k + 2] for s in starts])
    ids = torch.cat([torch.full((1, k), -1, dtype=torch.int32)] + [chunks[s][1][:, :k] for s in starts])
    return PromptLogProbs(values[:, 0].contiguous(), values[:, 1].int(), values[:, 2:].contiguous(),
                          ids.contiguous())


def top_rows(top: tuple[torch.Tensor, torch.Tensor], row: int, k: int) -> tuple[list[int], list[float]]:
    """One sampled row's k top alternatives (host values [rows, k'] and ids [rows, k'], k' >= k) as lists."""
    values, ids = top
    return ids[row, :k].tolist(), values[row, :k].tolist()
