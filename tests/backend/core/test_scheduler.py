"""Scheduler invariants: budgets hold every step, no block leaks, every request finishes exactly once."""
import random

import pytest

from backend import LLMEngine
from backend.config import EngineConfig
from backend.core.kv_cache import BlockManager
from backend.core.request import SamplingParams, Sequence, Status
from backend.core.scheduler import Scheduler
from tests.helpers import kv_bytes_for_blocks


def make_scheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_tokens=8) -> Scheduler:
    cfg = EngineConfig(model_dir="unused", max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                       kv_block_size=block_size)
    return Scheduler(cfg, BlockManager(num_blocks, block_size))


def test_prefill_is_chunked_under_the_token_budget():
    sched = make_scheduler(max_tokens=8)
    seq = Sequence(0, list(range(20)), SamplingParams())
    sched.add(seq)
    chunks = []
    while seq.num_computed_tokens < seq.num_tokens:
        [item] = sched.schedule().items
        chunks.append((item.num_new_tokens, item.samples))
        seq.num_computed_tokens += item.num_new_tokens
    assert chunks == [(8, False), (8, False), (4, True)]


def test_decodes_go_first_and_new_prefills_fill_the_rest():
    sched = make_scheduler(num_blocks=16, max_tokens=8)
    old = Sequence(0, [1, 2, 3], SamplingParams())
    sched.add(old)
    sched.schedule()
    old.num_computed_tokens = 3
    old.output_ids.append(9)
    new = Sequence(1, list(range(10)), SamplingParams())
    sched.add(new)
    items = sched.schedule().items
    assert [(i.seq.request_id, i.num_new_tokens) for i in items] == [(0, 1), (1, 7)]


def test_a_step_is_a_decode_step_only_without_prompt_tokens():
    sched = make_scheduler(num_blocks=16, max_tokens=8)
    one = Sequence(0, [4], SamplingParams())                     # a one-token prompt is still a prefill
    sched.add(one)
    batch = sched.schedule()
    assert [i.num_new_tokens for i in batch.items] == [1] and not batch.is_decode
    one.num_computed_tokens = 1
    one.output_ids.append(9)
    assert sched.schedule().is_decode
    one.num_computed_tokens = 2
    one.output_ids.append(5)
    sched.add(Sequence(1, list(range(3)), SamplingParams()))
    assert not sched.schedule().is_decode                        # a decode beside a prompt chunk


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_steady_decoding_repeats_the_batch_with_a_block_where_a_sequence_crosses(block_size, ahead):
    """While every running sequence decodes one token, the batch is handed out again (all_decode) and a sequence gets
    its next block at the step whose token starts it, never before; a sequence whose last token is sampled is not
    scheduled again, also where that token lands a step later (ahead: each step's tokens land after the next step
    is scheduled, as with overlap_steps)."""
    sched = make_scheduler(num_blocks=64, block_size=block_size, max_tokens=64)
    seqs = [Sequence(i, list(range(3 + 5 * i)), SamplingParams(max_new_tokens=[30, 9, 21][i])) for i in range(3)]
    for seq in seqs:
        sched.add(seq)

    def land(batch):
        for seq in [item.seq for item in batch.items if item.samples]:
            seq.num_pending_tokens -= 1
            seq.output_ids.append(7)
            if len(seq.output_ids) >= seq.params.max_new_tokens:
                sched.finish(seq, "length")

    batches, in_flight = [], None
    while sched.num_unfinished:
        batch = sched.schedule()
        for item in batch.items:                              # launched
            seq = item.seq
            assert len(seq.output_ids) + seq.num_pending_tokens < seq.params.max_new_tokens
            seq.num_computed_tokens += item.num_new_tokens
            seq.num_pending_tokens += item.samples
            assert seq.num_computed_tokens <= len(seq.block_table) * block_size
            assert len(seq.block_table) == -(-seq.num_computed_tokens // block_size)     # a block only when needed
        if in_flight is not None:
            land(in_flight)
        in_flight = batch if ahead else land(batch)
        batches.append(batch)
        assert len(batches) < 200
    steady = [len(batch.items) for batch in batches if batch.all_decode]
    assert [len(seq.output_ids) for seq in seqs] == [30, 9, 21]
    assert steady.count(3) >= 5 and steady.count(2) >= 5 and steady.count(1) >= 5, steady


def test_newest_running_sequence_is_preempted_when_blocks_run_out():
    sched = make_scheduler(num_blocks=4, block_size=4, max_tokens=64)
    a, b = Sequence(0, list(range(8)), SamplingParams()), Sequence(1, list(range(8)), SamplingParams())
    sched.add(a)
    sched.add(b)
    assert len(sched.schedule().items) == 2 and sched.blocks.num_free_blocks == 0
    for seq in (a, b):
        seq.num_computed_tokens = 8
        seq.output_ids.append(5)                           # each now needs a third block
    items = sched.schedule().items
    assert [i.seq.request_id for i in items] == [0]
    assert b.status is Status.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b] and sched.num_preemptions == 1


def test_a_waiting_fork_holding_blocks_does_not_stall_the_queue():
    """A fork (the second sample of an n=2 request) waits with its first's prompt blocks; when nothing runs and the
    head of the queue needs those blocks, the fork gives them up (and computes its prompt again later) instead of
    the two waiting on each other forever."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_tokens=64)
    first = Sequence(0, list(range(8)), SamplingParams())
    sched.add(first)
    sched.schedule()
    first.num_computed_tokens = 8
    fork = Sequence(0, list(range(8)), SamplingParams(), sequence_index=1)
    assert sched.blocks.fork(first, fork, 7) is not None            # shares a block, takes a fresh one
    sched.finish(first, "stop")
    head = Sequence(1, list(range(13)), SamplingParams())           # needs all 4 blocks
    sched.waiting.appendleft(head)
    sched.waiting.append(fork)
    assert sched.blocks.num_free_blocks == 2
    items = sched.schedule().items
    assert [i.seq.request_id for i in items] == [1] and fork.block_table == [] and fork.num_computed_tokens == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_with_aborts_leaks_nothing(tiny_model_dir, seed):
    rng = random.Random(seed)
    probe = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 16)
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_block_size=4,
                       kv_cache_memory_bytes=kv_bytes_for_blocks(20, 4, probe.model_config),
                       max_num_batched_tokens=rng.choice([8, 16, 32]), max_num_seqs=rng.choice([2, 5]))
    finished: dict[int, int] = {}
    expected_len: dict[int, int] = {}
    aborted: set[int] = set()
    for i in range(16):
        n = rng.randint(4, 12)
        engine.add_request([rng.randrange(3, 500) for _ in range(rng.randint(1, 30))], request_id=i,
                           max_new_tokens=n)
        expected_len[i] = n
    produced = {i: 0 for i in expected_len}
    steps = 0
    while engine.has_unfinished:
        if rng.random() < 0.1 and engine.seqs:
            victim = rng.choice(sorted(engine.seqs))
            assert engine.abort(victim)
            aborted.add(victim)
        outputs = engine.step()
        batch_seqs = len(outputs)
        assert batch_seqs <= engine.config.max_num_seqs
        for out in outputs:
            produced[out.request_id] += len(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = finished.get(out.request_id, 0) + 1
        steps += 1
        assert steps < 2000
    assert all(count == 1 for count in finished.values())
    assert set(finished) | aborted == set(expected_len) and not set(finished) & aborted
    assert all(produced[i] == expected_len[i] for i in finished)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert set(engine.blocks.ref_counts) == {0}
    assert not engine.abort(0), "aborting a finished request is a no-op"
