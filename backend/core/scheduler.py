"""In-flight batching: which sequences run this step, and how many of their tokens.

Every step packs the decode tokens of running sequences with prefill chunks of waiting ones under
`max_num_seqs` and a token budget. A decode is just a chunk of one token: a sequence computes the tokens
the cache lacks, and samples when its chunk reaches its last token. When blocks run out, the newest running
sequence is preempted: its blocks are freed and its tokens recomputed later.
"""
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from backend.config import EngineConfig
from backend.core.kv_cache import BlockManager
from backend.core.request import Sequence, Status


class AdapterSlots(Protocol):
    """The device tier of the adapter cache as the scheduler sees it."""
    def can_acquire(self, task_id: int | None) -> bool: ...
    def acquire(self, task_id: int | None) -> None: ...
    def release(self, task_id: int | None) -> None: ...


class ScheduledSeq:
    """A sequence's chunk in a step. samples: the chunk reaches the sequence's last token, so the step yields its
    next (computed unless the caller knows it)."""
    __slots__ = ("seq", "num_new_tokens", "samples")

    def __init__(self, seq: Sequence, num_new_tokens: int, samples: bool | None = None):
        self.seq = seq
        self.num_new_tokens = num_new_tokens
        self.samples = seq.num_computed_tokens + num_new_tokens == seq.num_tokens if samples is None else samples

    def __repr__(self) -> str:
        return f"ScheduledSeq({self.seq.request_id!r}, {self.num_new_tokens}, samples={self.samples})"


@dataclass(frozen=True, slots=True)
class StepSummary:
    """A step's composition, as TensorRT-LLM's inflight batcher reports it."""
    num_scheduled: int = 0                    # sequences in the step
    num_context: int = 0                      # of them, with prompt tokens (a chunk of their context phase)
    num_context_tokens: int = 0               # those prompt tokens
    num_generation: int = 0                   # sequences decoding one generated token
    time: float = 0.0                         # when it was scheduled (time.time())
    num_tokens: int = 0                       # every token the step computes

    @property
    def is_decode(self) -> bool:
        """Each sequence feeds in one generated token: no prompt chunk in the step."""
        return self.num_context == 0 and self.num_tokens == self.num_scheduled


@dataclass(slots=True)
class Batch:
    items: list[ScheduledSeq]
    num_preemptions: int = 0                  # the scheduler's preemptions until this batch (a preempted sequence
                                              # starts over, though it may be admitted again in the same step)
    all_decode: bool = False                  # known to be every item one generated token that samples
    grown: list[Sequence] | None = None       # and then: the sequences given a block this step (the only tables
                                              # that changed since the last step)

    def summary(self, now: float) -> StepSummary:
        if self.all_decode:
            n = len(self.items)
            return StepSummary(n, 0, 0, n, now, n)
        num_context = num_context_tokens = num_tokens = 0
        for item in self.items:
            num_tokens += item.num_new_tokens
            if item.seq.num_computed_tokens < len(item.seq.prompt_ids):
                num_context += 1
                num_context_tokens += item.num_new_tokens
        return StepSummary(len(self.items), num_context, num_context_tokens, len(self.items) - num_context, now,
                           num_tokens)

    @property
    def is_decode(self) -> bool:
        """Each sequence feeds in one generated token: no prompt chunk in the step."""
        return self.summary(0.0).is_decode


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, adapters: AdapterSlots | None = None):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.blocks = blocks
        self.adapters = adapters
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []       # in admission order; the last is the newest
        self.num_preemptions = 0
        self.decoding: list[ScheduledSeq] | None = None     # the last batch, while it is every running sequence
                                                            # decoding one token (steady decoding)
        self.num_decoded = 0                # steady steps since: each sequence has computed and sampled as many more
        self.steps_to_length = 0            # steady steps until a sequence samples its last token
        self.phases: list[list[Sequence]] = []      # its sequences by computed tokens mod the block size

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_paused(self) -> int:
        """Waiting sequences that ran before and were preempted (TensorRT-LLM's paused requests)."""
        return sum(1 for seq in self.waiting if seq.num_preemptions)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_forks(self, first: Sequence, others: list[Sequence]) -> list[tuple[int, int]]:
        """The other samples of a prompt, queued to start from the first one's cache: they share its full prompt
        blocks and copy the block holding the last prompt token, which each computes again to sample its own first
        token. Returns the block copies (source, destination) to make."""
        copies = []
        for seq in others:
            copy = self.blocks.fork(first, seq, len(seq.prompt_ids) - 1)
            if copy is not None:
                copies.append(copy)
            self.add(seq)
        return copies

    def schedule(self) -> Batch:
        if self.decoding is not None and (not self.waiting or len(self.running) >= self.max_num_seqs):
            batch = self._schedule_decoding()
            if batch is not None:
                return batch
        self.decoding = None
        items: list[ScheduledSeq] = []
        budget = self.max_num_batched_tokens
        pending = deque(self.running)
        kept: list[Sequence] = []
        preempted = False
        block_size = self.blocks.block_size
        while pending and budget > 0:
            seq = pending.popleft()
            num_output = len(seq.output_ids) + seq.num_pending_tokens     # (Sequence's properties, inlined: the
            if num_output >= seq.params.max_new_tokens:                   # loop runs for every sequence, every step)
                kept.append(seq)                     # a step ahead sampled its last token: it ends when that lands
                continue
            num_tokens = len(seq.prompt_ids) + num_output
            num_new = min(num_tokens - seq.num_computed_tokens, budget)
            if not num_new and seq.beams is not None:   # a beam that has offered its next tokens waits for the
                kept.append(seq)                        # others
                continue
            if seq.num_computed_tokens + num_new > len(seq.block_table) * block_size:   # a block more (rarely)
                while not self.blocks.can_allocate(seq, num_new):
                    victim = pending.pop() if pending else seq
                    self._preempt(victim)
                    preempted = True
                    if victim.beams is not None:     # its beams not scheduled yet step back with it
                        for other in [other for other in pending if other.beams is victim.beams]:
                            pending.remove(other)
                            self._preempt(other)
                    if victim is seq:
                        break
                if seq.status is not Status.RUNNING:
                    break
                self.blocks.allocate(seq, num_new)
            items.append(ScheduledSeq(seq, num_new, seq.num_computed_tokens + num_new == num_tokens))
            kept.append(seq)
            budget -= num_new
        self.running = kept + list(pending)

        waiting_for_slot: list[Sequence] = []
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            others = seq.params.beam_width - 1 if seq.beams is not None and not seq.output_ids else 0
            if len(self.running) + 1 + others > self.max_num_seqs:
                break                                # a search's first sequence holds a seat for each of its beams
            num_reused = self.blocks.match_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.blocks.can_allocate(seq, num_new, keep_watermark=True, num_more=others):
                if num_reused:
                    self.blocks.free(seq)            # back to evictable, matched again next time
                if not self.running and not items and self._reclaim_waiting_blocks(seq):
                    continue                         # the head again, with what waiting forks held
                break
            self.waiting.popleft()
            if self.adapters is not None:
                if not self.adapters.can_acquire(seq.lora_task_id):
                    if num_reused:
                        self.blocks.free(seq)
                    waiting_for_slot.append(seq)     # later requests on resident adapters (or none) may still run
                    continue
                self.adapters.acquire(seq.lora_task_id)
            seq.status = Status.RUNNING
            self.blocks.count_reuse(seq, num_reused)
            self.blocks.allocate(seq, num_new)
            items.append(ScheduledSeq(seq, num_new))
            self.running.append(seq)
            budget -= num_new
        self.waiting.extendleft(reversed(waiting_for_slot))     # back at the head, in order: first to get a slot
        if not items and self.waiting and self.running and not preempted:
            self._unblock_beams()
        if items and len(items) == len(self.running) and all(item.num_new_tokens == 1 and item.samples
                                                             for item in items):
            self._start_decoding(items)
        return Batch(items, self.num_preemptions)

    def join(self, seq: Sequence) -> None:
        """A beam that starts running at once, on blocks it shares with the beam it continues (its seat was held)."""
        if self.adapters is not None:
            self.adapters.acquire(seq.lora_task_id)
        seq.status = Status.RUNNING
        self.running.append(seq)
        self.decoding = None

    def _unblock_beams(self) -> None:
        """Nothing ran: the running sequences are beams waiting for another beam of theirs that waits for blocks
        they hold. They step back and are computed again once their search's beams fit together."""
        if all(seq.beams is not None and seq.num_uncomputed_tokens == 0 for seq in self.running):
            for seq in reversed(list(self.running)):
                self._preempt(seq)

    def _start_decoding(self, items: list[ScheduledSeq]) -> None:
        """Steady decoding from this batch on: each step, every sequence one token more. A sequence needs a block more
        where its computed tokens reach a multiple of the block size, so a step looks at the one phase that does."""
        block_size = self.blocks.block_size
        self.decoding, self.num_decoded, self.phases = items, 0, [[] for _ in range(block_size)]
        self.steps_to_length = min(item.seq.params.max_new_tokens - len(item.seq.output_ids)
                                   - item.seq.num_pending_tokens for item in items)
        for item in items:
            self.phases[item.seq.num_computed_tokens % block_size].append(item.seq)

    def _schedule_decoding(self) -> Batch | None:
        """The last step's batch again, where it was every running sequence decoding one token and nothing has
        changed since but their tokens: each decodes its next (with a block more where it needs one). None where a
        sequence needs more than that (its last token sampled, or a block that is not free): the general path."""
        self.num_decoded += 1
        if self.num_decoded >= self.steps_to_length:
            return None
        block_size, grown = self.blocks.block_size, []
        for seq in self.phases[-self.num_decoded % block_size]:        # computed a multiple of the block size
            if seq.num_computed_tokens >= len(seq.block_table) * block_size:
                if not self.blocks.can_allocate(seq, 1):
                    return None
                self.blocks.allocate(seq, 1)
                grown.append(seq)
        return Batch(self.decoding, self.num_preemptions, all_decode=True, grown=grown)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out for good (done, aborted or failed) and give back what it holds."""
        self.decoding = None
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
            self.blocks.free(seq)                # a fork waits with the blocks it shares
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        self.decoding = None
        if seq.beams is not None:
            seq.beams.withdraw(seq)              # it samples again once computed again
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _reclaim_waiting_blocks(self, head: Sequence) -> bool:
        """Nothing runs and the head of the queue does not fit: free the blocks that other waiting sequences hold
        (forks of n > 1 requests wait with their first's prompt blocks), which they compute again once admitted.
        Without it those blocks would wait for the head, and the head for them. True if any were freed."""
        holders = [seq for seq in self.waiting if seq is not head and seq.block_table]
        for seq in holders:
            self.blocks.free(seq)
        return bool(holders)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        if self.adapters is not None:
            self.adapters.release(seq.lora_task_id)
