"""Beam search for one request: its beams are sequences of their own, which share the KV blocks of what they have in
common (a beam that takes another's place shares that beam's full blocks and copies its last, partial one).

Each round, every live beam offers its 2 x beam_width most likely next tokens (log probs after bias, penalties and
bans); once every live beam has offered, the search ranks them by cumulative log prob, as transformers'
`generate(num_beams=...)` does: the top 2k continuations; those among the first k that end (end id, stop word, the
length) become finished hypotheses scored cum / length ** length_penalty (the best k kept); the best k that do not end
run on. `early_stopping`: True ends the search once k hypotheses are finished; False once the best running beam,
scored at its current length, cannot beat the worst finished one; "never" scores it at the longest length where a
positive length penalty favours length. The request's outputs are its best `num_return_sequences` hypotheses.
"""
from dataclasses import dataclass
from typing import Callable

from backend.core.kv_cache import BlockManager
from backend.core.request import Sequence, Status

ENDED = -1.0e9                            # added to a continuation that ends, so that it does not run on (as HF)


@dataclass(slots=True)
class Hypothesis:
    """A beam's generated tokens, each one's log prob, their sum, and its rank: cum / length ** length_penalty."""
    output_ids: list[int]
    log_probs: list[float]
    cum_log_prob: float
    score: float = 0.0


@dataclass(slots=True)
class Continuation:
    beam: int                             # the live beam it extends (its index in rank order)
    token: int
    log_prob: float
    score: float                          # the beam's running score + log_prob


class BeamSearch:
    """One request's beams: `seqs` (every sequence it may use, beam_width of them) and, of them, the live ones in
    rank order with their running scores. Host bookkeeping only: the KV copies it asks for are the engine's to
    make."""

    def __init__(self, seqs: list[Sequence]):
        p = seqs[0].params
        self.width, self.length_penalty, self.early_stopping = p.beam_width, p.length_penalty, p.early_stopping
        self.seqs = seqs
        self.live: list[Sequence] = [seqs[0]]             # the first computes the prompt alone
        self.scores: list[float] = [0.0]                  # running scores (with ENDED where a beam ended and runs on)
        self.cum_log_probs: list[float] = [0.0]           # and the true sums
        self.finished: list[Hypothesis] = []              # best first, at most width
        self.improvable = True                            # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False
        self.offers: dict[Sequence, tuple[list[int], list[float]]] = {}

    def offer(self, seq: Sequence, ids: list[int], log_probs: list[float]) -> bool:
        """A live beam's most likely next tokens; True once every live beam has offered (`select` then)."""
        self.offers[seq] = (ids, log_probs)
        return len(self.offers) == len(self.live)

    def withdraw(self, seq: Sequence) -> None:
        """A beam preempted computes and offers again."""
        self.offers.pop(seq, None)

    def select(self, ends: Callable[[list[int]], bool]) -> list[Continuation]:
        """One round: the continuations that run on, best first (the finished hypotheses and `done` updated).
        ends(output_ids): those tokens end a beam (end id or stop word, min_tokens counted)."""
        k, p = self.width, self.live[0].params
        length = len(self.live[0].output_ids) + 1
        ranked = sorted((Continuation(b, t, lp, self.scores[b] + lp)
                         for b, seq in enumerate(self.live) for t, lp in zip(*self.offers[seq])),
                        key=lambda c: -c.score)[:2 * k]
        self.offers = {}
        hits = [length >= p.max_new_tokens or ends(self.live[c.beam].output_ids + [c.token]) for c in ranked]
        if self.improvable and not (len(self.finished) == k and self.early_stopping is True):
            new = [self._hypothesis(c, length) for c, hit in zip(ranked[:k], hits) if hit]
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:k]
        running = sorted(range(len(ranked)), key=lambda i: -(ranked[i].score + ENDED * hits[i]))[:k]
        kept = [ranked[i] for i in running]
        for i, c in zip(running, kept):
            c.score += ENDED * hits[i]
        if self.improvable:
            never = self.early_stopping == "never" and self.length_penalty > 0.0
            best = kept[0].score / (p.max_new_tokens if never else length) ** self.length_penalty
            worst = self.finished[-1].score if len(self.finished) == k else ENDED
            self.improvable = best > worst
        full = len(self.finished) == k and self.early_stopping is True
        self.done = not self.improvable or full or all(hits)
        return kept

    def _hypothesis(self, c: Continuation, length: int) -> Hypothesis:
        seq = self.live[c.beam]
        return Hypothesis(seq.output_ids + [c.token], seq.output_log_probs + [c.log_prob],
                          self.cum_log_probs[c.beam] + c.log_prob, c.score / length ** self.length_penalty)

    def advance(self, kept: list[Continuation],
                blocks: BlockManager) -> tuple[list[tuple[int, int]], list[Sequence], bool]:
        """The live beams become `kept`: a beam continued by one of its continuations stays where it is (its first);
        each other continuation takes a sequence that no continuation keeps (or one not started), with its parent's
        tokens and KV blocks (full ones shared, the partial last one copied). A parent always keeps its own sequence,
        so no table another beam shares from is given back this round. Returns the block copies to make (source,
        destination), the sequences that start running, and whether any sequence took another's place."""
        parents = [self.live[c.beam] for c in kept]
        length = len(parents[0].output_ids)                # every live beam's, before this round
        owner: list[Sequence | None] = [None] * len(kept)
        for i, parent in enumerate(parents):
            if parent not in owner:
                owner[i] = parent
        spare = [seq for seq in self.live if seq not in owner] + [
            seq for seq in self.seqs if seq.status is Status.WAITING and not seq.block_table and seq not in self.live]
        copies, started = [], []
        for i, (c, parent) in enumerate(zip(kept, parents)):
            if owner[i] is None:
                seq = owner[i] = spare.pop(0)
                if seq not in self.live:
                    started.append(seq)
                blocks.free(seq)
                copy = blocks.adopt(seq, parent)
                if copy is not None:
                    copies.append(copy)
                seq.output_ids, seq.output_log_probs = parent.output_ids[:length], parent.output_log_probs[:length]
            owner[i].output_ids.append(c.token)
            owner[i].output_log_probs.append(c.log_prob)
        moved = owner != parents
        self.cum_log_probs = [self.cum_log_probs[c.beam] + c.log_prob for c in kept]
        self.live, self.scores = owner, [c.score for c in kept]
        return copies, started, moved

    def running(self) -> list[Hypothesis]:
        """The live beams as they stand, best first (what a streaming response shows)."""
        return [Hypothesis(list(seq.output_ids), list(seq.output_log_probs), cum,
                           score / max(len(seq.output_ids), 1) ** self.length_penalty)
                for seq, cum, score in zip(self.live, self.cum_log_probs, self.scores)]

    def best(self, n: int) -> list[Hypothesis]:
        """The request's outputs: its n best finished hypotheses (running beams where fewer finished)."""
        return (self.finished + sorted(self.running(), key=lambda h: -h.score))[:n]
