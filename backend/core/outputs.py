"""What a step hands the serving layer: its outputs by the batch.

Most outputs of a decode step are a sequence's new token and nothing else. Those stay rows of plain values (the
sequence, the token, its log prob, the sequence's metrics and the step's time) until a server sends them: a
StepOutput is made for each where it is read (`as_output`), on the server's responder thread, off the engine's.
Every other output (a sequence that finished, failed, or sends logits) is a StepOutput from the start.
"""
from dataclasses import dataclass, field, replace
from typing import Hashable, Iterator

import torch

from backend.core.logprobs import PromptLogProbs, prompt_log_probs
from backend.core.request import SeqMetrics, Sequence

TokenRow = tuple[Sequence, int, float, SeqMetrics, int]    # (sequence, token, log prob, its metrics, step time ns)


@dataclass(slots=True)
class StepOutput:
    request_id: Hashable
    new_token_ids: list[int]
    finished: bool = False                    # this sequence is done
    finish_reason: str | None = None          # "stop", "length", "abort", "error"
    log_probs: list[float] = field(default_factory=list)
    error: str | None = None
    sequence_index: int = 0                   # which of the request's num_return_sequences
    request_finished: bool = False            # every sequence of the request is done: its last output
    metrics: SeqMetrics | None = None         # a copy: the sequence's figures as of this output
    generation_logits: torch.Tensor | None = None   # [vocab] fp32 of the new token, when asked for
    context_logits: torch.Tensor | None = None      # [prompt_len, vocab] fp32, with the first token, when asked for
    top_ids: list[list[int]] = field(default_factory=list)            # by new token: its top_log_probs alternatives
    top_log_probs: list[list[float]] = field(default_factory=list)
    prompt_log_probs: PromptLogProbs | None = None  # with the first token, when asked for (return_prompt_log_probs)
    beams: list | None = None                 # beam search: each beam's tokens so far, best first (core/beams.py's
                                              # Hypothesis); when the request finishes, its best hypotheses

    def __reduce__(self):
        """Pickled as its fields in order (to a stub, backend/serving/channel.py): half the bytes of a dataclass's
        default and less than half its time to read back (docs/performance.md)."""
        return StepOutput, tuple(getattr(self, name) for name in self.__slots__)


class StepOutputs:
    """A step's outputs in order: token rows and StepOutputs (`entries`). Iterating gives StepOutputs. A token
    row's metrics object is the sequence's own, which is replaced, never changed, where the figures a row reports
    change after it (backend/core/kv_cache.py copies it before counting blocks); its last token time is the row's."""
    __slots__ = ("entries",)

    def __init__(self):
        self.entries: list[TokenRow | StepOutput] = []

    def __iter__(self) -> Iterator[StepOutput]:
        return map(as_output, self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __repr__(self) -> str:
        return f"StepOutputs({list(self)!r})"


def as_output(entry: TokenRow | StepOutput) -> StepOutput:
    """An entry of StepOutputs as a StepOutput."""
    if type(entry) is StepOutput:
        return entry
    seq, token, log_prob, m, time_ns = entry
    metrics = SeqMetrics(m.arrival_time_ns, m.first_scheduled_time_ns, m.first_token_time_ns, time_ns,
                         m.num_new_blocks, m.num_reused_blocks)
    return StepOutput(seq.request_id, [token], log_probs=[log_prob] if seq.params.return_log_probs else [],
                      sequence_index=seq.sequence_index, metrics=metrics)


def merged(outs: list[StepOutput]) -> StepOutput:
    """One sequence's outputs of several steps as one: their tokens, log probs and alternatives in order, the first's
    prompt outputs, the last's state (finished, metrics). None has generation logits."""
    first, last = outs[0], outs[-1]
    return replace(last, new_token_ids=[t for o in outs for t in o.new_token_ids],
                   log_probs=[lp for o in outs for lp in o.log_probs], top_ids=[t for o in outs for t in o.top_ids],
                   top_log_probs=[t for o in outs for t in o.top_log_probs], context_logits=first.context_logits,
                   prompt_log_probs=first.prompt_log_probs)


def request_of(entry: TokenRow | StepOutput) -> Hashable:
    return entry.request_id if type(entry) is StepOutput else entry[0].request_id


def token_output(seq: Sequence, token: int, log_prob: float, logits: torch.Tensor | None,
                 top: tuple[list[int], list[float]] | None, scored: bool) -> StepOutput:
    """The output of a sequence's new token that brings more than the token: its logits [vocab], its top
    alternatives (ids, log probs), the prompt's log probs and prompt logits with the first token (`scored`: asked
    for, taken from the sequence here)."""
    p = seq.params
    out = StepOutput(seq.request_id, [token], log_probs=[log_prob] if p.return_log_probs else [],
                     sequence_index=seq.sequence_index, metrics=seq.metrics.copy(), generation_logits=logits)
    if top is not None:
        out.top_ids, out.top_log_probs = [top[0]], [top[1]]
    if scored:
        out.prompt_log_probs, seq.prompt_scores = prompt_log_probs(seq.prompt_scores, p.top_log_probs), {}
    if seq.context_logits and len(seq.output_ids) == 1:
        out.context_logits = torch.cat([seq.context_logits[first] for first in sorted(seq.context_logits)])
        seq.context_logits = {}
    return out
