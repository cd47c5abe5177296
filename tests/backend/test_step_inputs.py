"""StepInputs built with array operations equal the step's inputs written out token by token, and the kept block
tables follow every way a table changes (appends, forks, frees, preemption)."""
import random

import pytest
import torch

from backend.model.context import BlockTables, StepInputs
from backend.request import SamplingParams, Sequence
from backend.scheduler import Batch, ScheduledSeq

BLOCK_SIZE = 4


def reference(batch: Batch, block_size: int) -> dict[str, list]:
    """The inputs as the definition reads: every token of every chunk, one at a time."""
    out = {name: [] for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "logits_indices",
                                 "context_indices")}
    query_starts = [0]
    for item in batch.items:
        seq, start = item.seq, item.seq.num_computed_tokens
        for position in range(start, start + item.num_new_tokens):
            out["input_ids"].append(seq.token_ids[position])
            out["positions"].append(position)
            out["slot_mapping"].append(seq.block_table[position // block_size] * block_size + position % block_size)
        query_starts.append(query_starts[-1] + item.num_new_tokens)
        out["seq_lens"].append(start + item.num_new_tokens)
        if item.samples:
            out["logits_indices"].append(query_starts[-1] - 1)
        prompt_end = min(start + item.num_new_tokens, len(seq.prompt_ids))
        if seq.params.return_context_logits and start < prompt_end and not seq.output_ids:
            out["context_indices"] += range(query_starts[-2], query_starts[-2] + prompt_end - start)
    out["query_starts"] = query_starts
    width = max(len(item.seq.block_table) for item in batch.items)
    out["block_tables"] = [item.seq.block_table + [0] * (width - len(item.seq.block_table)) for item in batch.items]
    return out


def random_item(rng: random.Random, request_id: int) -> ScheduledSeq:
    """A sequence part-way through its prompt or its output, and the chunk it runs this step."""
    prompt = [rng.randrange(512) for _ in range(rng.randint(1, 40))]
    seq = Sequence(request_id, prompt, SamplingParams(max_new_tokens=64,
                                                      return_context_logits=rng.random() < 0.3))
    seq.output_ids = [rng.randrange(512) for _ in range(rng.choice([0, 0, rng.randint(1, 20)]))]
    seq.num_computed_tokens = rng.randint(0, seq.num_tokens - 1)
    num_new = rng.randint(1, seq.num_tokens - seq.num_computed_tokens)
    num_blocks = -(-(seq.num_computed_tokens + num_new) // BLOCK_SIZE)
    seq.block_table = rng.sample(range(1000), num_blocks)
    return ScheduledSeq(seq, num_new)


@pytest.mark.parametrize("seed", range(20))
def test_step_inputs_equal_the_token_by_token_definition(seed):
    rng = random.Random(seed)
    batch = Batch([random_item(rng, i) for i in range(rng.randint(1, 12))])
    inputs = StepInputs(batch, BLOCK_SIZE, BlockTables())
    expected = reference(batch, BLOCK_SIZE)
    for name, values in expected.items():
        assert inputs.tensors[name].dtype == torch.int32, name
        assert inputs.tensors[name].tolist() == values, name
    assert inputs.query_starts == expected["query_starts"]
    assert inputs.seq_lens == expected["seq_lens"]
    assert inputs.max_query_len == max(item.num_new_tokens for item in batch.items)


def test_kept_tables_follow_appends_replacements_and_frees():
    tables = BlockTables()
    seq = Sequence(0, [1] * 8, SamplingParams())
    seq.block_table = [5, 9]
    assert tables.rows([seq]).tolist() == [[5, 9]]
    for block in range(40):                                      # past the first capacity
        seq.block_table.append(100 + block)
        assert tables.rows([seq]).tolist() == [[5, 9] + list(range(100, 101 + block))]
    seq.block_table = [7] + [3]                                  # a fork: a new list of other blocks
    assert tables.rows([seq]).tolist() == [[7, 3]]
    seq.block_table = []                                         # freed, then preempted and started again
    seq.block_table.append(11)
    assert tables.rows([seq]).tolist() == [[11]]
    other, third = Sequence(1, [1], SamplingParams()), Sequence(2, [1], SamplingParams())
    other.block_table, third.block_table = [2, 4, 6], [8]
    assert tables.rows([seq, other]).tolist() == [[11, 0, 0], [2, 4, 6]]
    other.block_table.append(12)
    assert tables.rows([other, seq, third]).tolist() == [[2, 4, 6, 12], [11, 0, 0, 0], [8, 0, 0, 0]]   # rows move
    del other.block_table[1:]                                    # (tables never shrink in place; rows still follow)
    assert tables.rows([third, other]).tolist() == [[8], [2]]
    for n in (1, 5, 3):                                          # more rows than the array had, then fewer
        batch = [Sequence(10 + i, [1], SamplingParams()) for i in range(n)]
        for i, member in enumerate(batch):
            member.block_table = list(range(i + 1))
        assert tables.rows(batch).tolist() == [list(range(i + 1)) + [0] * (n - i - 1) for i in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_kept_tables_over_steps_of_a_changing_batch(seed):
    """Sequences join, leave, change places, grow their tables and get new ones (forks, preemption), step after
    step: every step's rows are the tables as they are."""
    rng = random.Random(seed)
    pool = [Sequence(i, [1], SamplingParams()) for i in range(12)]
    for seq in pool:
        seq.block_table = rng.sample(range(1000), rng.randint(1, 6))
    tables = BlockTables()
    for _ in range(40):
        batch = rng.sample(pool, rng.randint(1, len(pool)))
        for seq in batch:
            change = rng.random()
            if change < 0.3:
                seq.block_table.append(rng.randrange(1000))
            elif change < 0.4:
                seq.block_table = rng.sample(range(1000), rng.randint(1, 8))
        width = max(len(seq.block_table) for seq in batch)
        assert tables.rows(batch).tolist() == [seq.block_table + [0] * (width - len(seq.block_table))
                                               for seq in batch]
