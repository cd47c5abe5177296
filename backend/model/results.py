"""What a launched step brings back: its one download (the sampled tokens, and what some rows asked for beside them),
and the host values once it has landed."""
from dataclasses import dataclass, field

import torch

from backend.core.scheduler import Batch
from backend.device import Download
from backend.model.batch import LaunchRows


@dataclass(slots=True, eq=False)
class LaunchedStep:
    """A step whose device work is queued: its results come back through `download`, which holds, in order: the
    tokens [num_sampled] (with log probs: [2, num_sampled]), the asked-for logits [len(rows.wanted), vocab], the
    top alternatives (log probs and ids [num_sampled, top_k]), the scored prompt rows (PromptScores' values and
    ids) - each where the step has any."""
    batch: Batch
    rows: LaunchRows                          # its rows: rows_of (each sampling sequence -> its row of `tokens`),
                                              # wanted, needs_last_tokens, ends
    tokens: torch.Tensor                      # [num_sampled] sampled ids, on the device: the next step's inputs
    download: Download
    top_k: int = 0                            # top alternatives downloaded for every sampled row
    scored: list[tuple[object, int, int]] = field(default_factory=list)   # (sequence, chunk start, rows) scored
    ahead: bool = False                       # left in flight while the next step launches: its samples count as
                                              # pending tokens of their sequences until it is collected

    @property
    def rows_of(self) -> dict:
        return self.rows.rows_of


@dataclass(slots=True)
class StepResults:
    """A launched step's values on the host, by sampled row."""
    tokens: list[int]
    log_probs: list[float]                    # 0.0 where no row asked
    logits: dict[int, torch.Tensor]           # row -> [vocab] fp32, for the rows that asked
    top: tuple[torch.Tensor, torch.Tensor] | None = None   # [num_sampled, top_k] log probs, ids


def keep_chunk(chunks: dict, start: int, value) -> None:
    """A prompt chunk's rows, kept by their first position; a chunk at 0 starts the prompt again (a preemption)."""
    if start == 0:
        chunks.clear()
    chunks[start] = value


def collect(step: LaunchedStep) -> StepResults:
    """Wait for a step's download and split it (see LaunchedStep); scored prompt chunks go to their sequences'
    prompt_scores."""
    host, *extra = step.download.wait()
    extra = iter(extra)
    logits = dict(zip(step.rows.wanted, next(extra).clone())) if step.rows.wanted else {}   # off the pinned buffer
    top = (next(extra), next(extra)) if step.top_k else None
    if step.scored:
        values, ids, offset = next(extra), next(extra), 0
        for seq, start, num_rows in step.scored:
            rows = slice(offset, offset + num_rows)
            keep_chunk(seq.prompt_scores, start, (values[rows].clone(), ids[rows].clone()))
            offset += num_rows
    if host.dim() == 1:                                       # no row asked for log probs
        return StepResults(host.tolist(), [0.0] * host.shape[0], logits, top)
    return StepResults(host[0].long().tolist(), host[1].tolist(), logits, top)
