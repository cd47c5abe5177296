"""StepInputs built with array operations equal the step's inputs written out token by token, the persistent batch's
rows follow sequences that join, leave and change places, and its block tables every way a table changes (appends,
forks, frees, preemption)."""
import random

import pytest
import torch

from backend.core.request import SamplingParams, Sequence
from backend.core.scheduler import Batch, ScheduledSeq
from backend.device import StepStaging, unpacked
from backend.model.context import PENDING, StepInputs
from backend.model.batch import PADDING, BlockTables, PersistentBatch
from tests.helpers import kv_bytes_for_blocks, random_prompts

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


def assert_inputs_equal_reference(inputs: StepInputs, batch: Batch) -> None:
    expected = reference(batch, BLOCK_SIZE)
    for name, values in expected.items():
        assert inputs.tensors[name].dtype == torch.int32, name
        assert inputs.tensors[name].tolist() == values, name
    assert inputs.query_starts == expected["query_starts"]
    assert inputs.seq_lens == expected["seq_lens"]
    assert inputs.max_query_len == max(item.num_new_tokens for item in batch.items)


@pytest.mark.parametrize("seed", range(20))
def test_step_inputs_equal_the_token_by_token_definition(seed):
    rng = random.Random(seed)
    batch = Batch([random_item(rng, i) for i in range(rng.randint(1, 12))])
    assert_inputs_equal_reference(StepInputs(batch, BLOCK_SIZE, PersistentBatch()), batch)


def decoding_item(request_id: int, num_blocks: int) -> ScheduledSeq:
    """A sequence decoding its next token, its table num_blocks long."""
    seq = Sequence(request_id, list(range(3, 3 + 4 * num_blocks - 2)), SamplingParams())
    seq.output_ids = [5]
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.block_table = list(range(10 * request_id, 10 * request_id + num_blocks))
    return ScheduledSeq(seq, 1)


def test_the_persistent_buffer_lays_out_a_decoding_steps_inputs_with_padding_rows_past_the_batch():
    """What a decoding step sends (PersistentBatch.tensors): [4, C] rows, padding rows (token 0, position 0, slot -1,
    length 0) past the batch, as a decode graph's buffers want them, after a batch shrinks and after the buffer
    grows; the rows are the sequences' next tokens, though every sequence is new to the batch each time."""
    persistent = PersistentBatch(capacity=5)
    for first, num_blocks in ((0, [1, 2, 1, 3, 2, 1]), (10, [2, 1]), (20, [40, 1, 2])):   # more rows than C; fewer;
        items = [decoding_item(first + i, n) for i, n in enumerate(num_blocks)]              # a wider table
        batch = Batch(list(items))
        persistent.update(batch, None)
        inputs = StepInputs(batch, BLOCK_SIZE, persistent)
        persistent.record(inputs)
        assert inputs.rows is not None                                  # (built as a decoding step)
        assert_inputs_equal_reference(inputs, batch)
        n, state = len(items), persistent.state
        assert persistent.capacity % 4 == 0 and persistent.capacity >= n
        assert (state[:, n:] == PADDING[:, None]).all()
        tensors, rows, sent = persistent.tensors(n)
        assert rows.shape == (4, persistent.capacity) and sent.data_ptr() == rows.data_ptr()
        for i, name in enumerate(("positions", "slot_mapping", "seq_lens"), start=1):
            assert tensors[name].tolist() == inputs.tensors[name].tolist() == rows[i, :n].tolist(), name
        assert tensors["block_tables"].tolist() == inputs.tensors["block_tables"].tolist()
        assert tensors["query_starts"].tolist() == list(range(n + 1))


@pytest.mark.parametrize("seed", range(10))
def test_rows_follow_sequences_that_join_leave_and_change(seed):
    """Step after step, sequences leave, join (with adapters: each adapter one segment, the rows that stay in their
    order), decode, run prompt chunks, grow their tables and get new ones: each step's inputs equal the definition,
    however the persistent batch built them, and a row that stays keeps its place among the others."""
    rng = random.Random(seed)
    slot_of = {None: -1, 1: 0, 2: 1, 3: 2}.__getitem__
    pool = []
    for i in range(16):
        item = random_item(rng, i)
        item.seq.lora_task_id = rng.choice([None, 1, 2, 3])
        pool.append(item.seq)
    persistent, running = PersistentBatch(capacity=4), []
    num_decoding = num_stayed = 0
    for _ in range(30):
        running = [seq for seq in running if rng.random() < 0.8] + rng.sample(
            [seq for seq in pool if seq not in running], rng.randint(0, 3))
        running = running or [pool[0]]
        items = []
        for seq in running:
            if rng.random() < 0.1:                                         # a new table (preempted, forked)
                seq.block_table = rng.sample(range(1000), len(seq.block_table))
            decode = rng.random() < 0.7 or seq.num_computed_tokens >= seq.num_tokens
            if decode:
                if seq.num_computed_tokens < len(seq.prompt_ids):
                    seq.num_computed_tokens = len(seq.prompt_ids)
                seq.output_ids.append(rng.randrange(512))
                seq.num_computed_tokens = seq.num_tokens - 1
                num_new = 1
            else:
                num_new = rng.randint(1, seq.num_tokens - seq.num_computed_tokens)
            while len(seq.block_table) * BLOCK_SIZE < seq.num_computed_tokens + num_new:
                seq.block_table.append(rng.randrange(1000))
            items.append(ScheduledSeq(seq, num_new))
        before = list(persistent.seqs)
        batch = Batch(items)
        rows = persistent.update(batch, slot_of)
        stayed = [seq for row, seq in enumerate(persistent.seqs) if row not in persistent.added]
        inputs = StepInputs(batch, BLOCK_SIZE, persistent)
        persistent.record(inputs)
        assert_inputs_equal_reference(inputs, batch)
        assert [item.seq for item in batch.items] == persistent.seqs
        assert rows.slots == sorted(rows.slots) == [slot_of(seq.lora_task_id) for seq in persistent.seqs]
        assert stayed == [seq for seq in before if seq in stayed]
        num_stayed += len(stayed)
        num_decoding += inputs.rows is not None
        for item in batch.items:
            item.seq.num_computed_tokens += item.num_new_tokens
    assert num_decoding > 3 and num_stayed > 30


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


def test_block_tables_move_with_their_rows():
    """Rows that change places take their written tables with them: nothing of theirs is written again."""
    tables = BlockTables()
    seqs = [Sequence(i, [1], SamplingParams()) for i in range(4)]
    for i, seq in enumerate(seqs):
        seq.block_table = list(range(10 * i, 10 * i + i + 1))
    tables.rows(seqs)
    tables.move([3, -1, 0, 2])                                   # row 1 leaves, a new row joins second
    joined = Sequence(9, [1], SamplingParams())
    joined.block_table = [99, 98]
    order = [seqs[3], joined, seqs[0], seqs[2]]
    assert tables.write(order) == [1]
    assert tables.rows(order).tolist() == [[30, 31, 32, 33], [99, 98, 0, 0], [0, 0, 0, 0], [20, 21, 22, 0]]


@pytest.mark.parametrize("overlap,num_blocks", [(False, None), (True, None), (False, 14), (True, 14)])
def test_decoding_steps_equal_the_general_path(tiny_model_dir, tiny_adapters, monkeypatch, overlap, num_blocks):
    """A step where every row decodes the token it sampled is launched from the persistent batch's state: its inputs
    equal those built from scratch, steady or not (rows that joined or left), over a workload whose batch changes
    (adapters, stops, forks, an abort, block crossings; with num_blocks, a cache so small that sequences are
    preempted, and KV reuse gives them their blocks back), and its tokens equal a run that always builds every
    step from scratch; its step context, kept with the batch, carries the step's lengths and nothing of the step
    before."""
    from backend import LLMEngine
    from backend.model.checkpoint import ModelConfig
    cache_bytes = 1 << 20 if num_blocks is None else kv_bytes_for_blocks(num_blocks, 4,
                                                                          ModelConfig.from_dir(tiny_model_dir))
    decoding_rows, landings, contexts, changed = [], {}, [], []
    decode = StepInputs._decode

    def checked(self, batch, block_size, persistent):
        changed.append(not persistent.steady)
        decode(self, batch, block_size, persistent)
        seqs = [item.seq for item in batch.items]                   # (in launch order)
        assert persistent.seqs == seqs
        general = StepInputs(Batch([ScheduledSeq(seq, 1) for seq in seqs]), block_size)
        sent = self.sent | {"s_other": torch.zeros(3, dtype=torch.int32)}     # as a device gets them: packed
        host, offsets = StepStaging(torch.device("cpu")).pack(sent)
        uploaded = self.received(unpacked(host, sent, offsets))
        lone = self.sent["rows"]                                    # as CUDA lands it: one buffer while its size
        landing = landings.setdefault(lone.shape[0], torch.empty_like(lone))       # repeats, its views kept
        landed = self.received({"rows": landing.copy_(lone)})
        known = general.tensors["input_ids"] != PENDING             # (a pending id comes from the device)
        for name, t in general.tensors.items():
            for got in (uploaded, landed):
                ours, theirs = (got[name][known], t[known]) if name == "input_ids" else (got[name], t)
                assert torch.equal(ours, theirs) and got[name].data_ptr() % 16 == 0, name
            assert torch.equal(self.tensors[name][known] if name == "input_ids" else self.tensors[name], theirs)
        assert (self.query_starts, self.seq_lens, self.pending) == (general.query_starts, general.seq_lens,
                                                                    general.pending)
        ctx, fresh = self.context(self.tensors), general.context(general.tensors)     # (the views the runner's has)
        assert (ctx.attn.seq_lens_list, ctx.attn.max_seq_len, ctx.attn.query_starts_list, ctx.attn.torch_plan,
                ctx.lora, ctx.between_layers) == (fresh.attn.seq_lens_list, fresh.attn.max_seq_len,
                                                  fresh.attn.query_starts_list, None, None, None)
        contexts.append(ctx)
        decoding_rows.append(len(seqs))

    def run() -> dict:
        engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_block_size=4,
                           kv_cache_memory_bytes=cache_bytes, max_loras=2, overlap_steps="true" if overlap else "false",
                           enable_kv_cache_reuse=num_blocks is not None)
        for task_id, path in enumerate(tiny_adapters[:2], start=1):
            engine.add_lora_dir(task_id, path)
        prompts = random_prompts([5, 9, 13, 6, 17, 3], 512, seed=3)
        ids = [engine.add_request(prompt, lora=[None, 1, 2][i % 3], max_new_tokens=[12, 20, 7, 16, 25, 9][i],
                                  num_return_sequences=2 if i == 3 else 1,
                                  stop_words=[[prompt[0]]] if i == 4 else [])
               for i, prompt in enumerate(prompts)]
        tokens, num_steps = {}, 0
        while engine.has_unfinished:
            for out in engine.step():
                assert not out.error, out.error
                tokens.setdefault((out.request_id, out.sequence_index), []).extend(out.new_token_ids)
            num_steps += 1
            if num_steps == 8:
                engine.abort(ids[1])
        assert (engine.scheduler.num_preemptions > 0) == (num_blocks is not None)
        return tokens

    monkeypatch.setattr(StepInputs, "_decode", checked)
    kept = run()
    assert len(decoding_rows) > 10 and len(set(decoding_rows)) > 2        # decoding steps of several batches
    assert 0 < sum(changed) < len(changed)                               # steady ones and ones whose rows changed
    assert sum(a is b for a, b in zip(contexts, contexts[1:])) > 5       # a context kept from step to step
    update = PersistentBatch.update

    def from_scratch(self, batch, slot_of):
        self.drop()
        rows = update(self, batch, slot_of)
        self.steady = self.decodes = False
        return rows
    monkeypatch.setattr(PersistentBatch, "update", from_scratch)
    assert kept == run()


@pytest.mark.parametrize("preempted", [False, True])
def test_a_sequence_given_another_table_since_the_last_step_is_added_anew(preempted):
    """A sequence preempted since the last step, and admitted again with its blocks from the cache, may decode one
    token at the position it had: its table is another, so what its row held no longer holds; the row is removed
    and the sequence added anew. Without a preemption the row stays and moves on."""
    seq = Sequence(0, [1, 2, 3], SamplingParams())
    seq.block_table = [4]
    persistent = PersistentBatch()
    first = Batch([ScheduledSeq(seq, 3)])
    persistent.update(first, None)
    persistent.record(StepInputs(first, BLOCK_SIZE, persistent))
    seq.num_computed_tokens, seq.output_ids = 3, [9]
    if preempted:
        seq.block_table = [7]
    second = Batch([ScheduledSeq(seq, 1)], num_preemptions=int(preempted))
    persistent.update(second, None)
    assert persistent.added == ([0] if preempted else [])
    inputs = StepInputs(second, BLOCK_SIZE, persistent)
    assert inputs.rows is not None
    assert_inputs_equal_reference(inputs, second)
    assert inputs.tensors["slot_mapping"].tolist() == [(7 if preempted else 4) * BLOCK_SIZE + 3]
