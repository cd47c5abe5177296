"""Beam search equals transformers' generate(num_beams=...) with PEFT, in fp32: the same sequences in the same order,
cum log probs within 1e-4; beams share their prompt's KV blocks and give every block back."""
import pytest
import torch

from backend import LLMEngine
from tests.helpers import (CPU_BACKENDS, INTERPRETER_MARK, adapter_active, kv_bytes_for_blocks, peft_greedy_alone,
                           peft_model_with, random_prompts)

PATHS = CPU_BACKENDS + [pytest.param("triton", marks=INTERPRETER_MARK)]
MAX_NEW = 10
# (beam width, length penalty, early stopping): the three stopping rules, penalties favouring short and long beams
SEARCHES = [(2, 1.0, True), (4, 0.7, False), (3, -0.5, "never"), (4, 1.5, True)]


@pytest.fixture(scope="module")
def tiny_peft(tiny_model_dir, tiny_adapters):
    return peft_model_with(tiny_model_dir, tiny_adapters[:2])


def hf_beams(model, prompt: list[int], width: int, length_penalty: float, early_stopping, end_id: int,
             adapter: str | None) -> list[tuple[list[int], float]]:
    """transformers' beam search: each returned beam's generated tokens (up to its end) and cum log prob."""
    ids = torch.tensor([prompt])
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                  do_sample=False, max_new_tokens=MAX_NEW, length_penalty=length_penalty,
                  early_stopping=early_stopping, eos_token_id=end_id, pad_token_id=end_id,
                  return_dict_in_generate=True, output_scores=True)
    with adapter_active(model, adapter):
        out = model.generate(**kwargs)
    beams = []
    for sequence, score in zip(out.sequences, out.sequences_scores.tolist()):
        tokens = sequence[len(prompt):].tolist()
        length = tokens.index(end_id) + 1 if end_id in tokens else len(tokens)     # (padded with end_id after it)
        beams.append((tokens[:length], score * length ** length_penalty))
    return beams


def run(engine: LLMEngine, requests: list[dict]) -> list:
    """Add every request at once, step to the end: each request's final output (a request without beams: its
    tokens), checking that a beam search's outputs before it carry its live beams."""
    ids = [engine.add_request(r.pop("prompt"), **r) for r in requests]
    finals, tokens = {}, {i: [] for i in ids}
    while engine.has_unfinished:
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
            if out.beams is not None and not out.request_finished:
                assert len({len(b.output_ids) for b in out.beams}) == 1, "live beams have the same length"
            if out.request_finished:
                finals[out.request_id] = out if out.beams is not None else tokens[out.request_id]
    return [finals[i] for i in ids]


def searches(prompts: list[list[int]], model, adapters: list[str | None]) -> tuple[list[dict], list]:
    """One beam search per prompt (SEARCHES in turn), each ending on a token its greedy continuation makes early
    (so that beams end at different lengths), with its adapter; and transformers' answers."""
    requests, expected = [], []
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        width, length_penalty, early_stopping = SEARCHES[i % len(SEARCHES)]
        end_id = peft_greedy_alone(model, prompt, adapter, 4)[3]
        requests.append(dict(prompt=prompt, max_new_tokens=MAX_NEW, beam_width=width, num_return_sequences=width,
                             length_penalty=length_penalty, early_stopping=early_stopping, end_id=end_id,
                             lora=None if adapter is None else int(adapter[1:]) + 1))
        expected.append(hf_beams(model, prompt, width, length_penalty, early_stopping, end_id, adapter))
    return requests, expected


def assert_beams_equal(finals: list, expected: list) -> None:
    for out, beams in zip(finals, expected):
        assert [b.output_ids for b in out.beams] == [tokens for tokens, _ in beams]
        for beam, (_, cum) in zip(out.beams, beams):
            assert beam.cum_log_prob == pytest.approx(cum, abs=1e-4)
            assert sum(beam.log_probs) == pytest.approx(beam.cum_log_prob, abs=1e-5)


def make_engine(model_dir, adapters, kernel_backend: str, **kwargs) -> LLMEngine:
    engine = LLMEngine(model_dir, dtype="float32", kernel_backend=kernel_backend, kv_block_size=4,
                       lora_dtype="float32", max_num_seqs=16, **({"kv_cache_memory_bytes": 1 << 20} | kwargs))
    for task_id, path in enumerate(adapters, start=1):
        engine.add_lora_dir(task_id, path)
    return engine


@pytest.mark.parametrize("kernel_backend", PATHS)
def test_beams_with_and_without_adapters_in_one_batch_equal_transformers(tiny_model_dir, tiny_adapters, tiny_peft,
                                                                         kernel_backend):
    prompts = random_prompts([5, 19, 13, 30] if kernel_backend != "triton" else [5, 13], 512, seed=4)
    adapters = ["a0", None, "a1", None][:len(prompts)]
    requests, expected = searches(prompts, tiny_peft, adapters)
    engine = make_engine(tiny_model_dir, tiny_adapters[:2], kernel_backend)
    greedy = random_prompts([9], 512, seed=5)[0]
    *finals, plain = run(engine, requests + [dict(prompt=greedy, max_new_tokens=MAX_NEW, end_id=2)])
    assert_beams_equal(finals, expected)
    assert plain == peft_greedy_alone(tiny_peft, greedy, None, MAX_NEW)
    assert engine.blocks.num_used_blocks == 0


def test_beams_under_preemption_and_chunked_prompts_equal_transformers(tiny_model_dir, tiny_adapters, tiny_peft):
    """A KV pool small enough to preempt beams, a token budget that chunks the prompts: the same beams."""
    prompts = random_prompts([5, 19, 13, 30], 512, seed=4)
    requests, expected = searches(prompts, tiny_peft, [None, "a0", None, "a1"])
    probe = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)
    engine = make_engine(tiny_model_dir, tiny_adapters[:2], "torch", max_num_batched_tokens=16,
                         kv_cache_memory_bytes=kv_bytes_for_blocks(24, 4, probe.model_config))
    finals = run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    assert_beams_equal(finals, expected)
    assert engine.blocks.num_used_blocks == 0


def test_beams_at_two_ranks_equal_transformers(tiny_model_dir, tiny_adapters, tiny_peft):
    """Tensor parallel: each rank's KV blocks shared and copied alike."""
    prompts = random_prompts([7, 21], 512, seed=6)
    requests, expected = searches(prompts, tiny_peft, ["a1", None])
    engine = make_engine(tiny_model_dir, tiny_adapters[:2], "torch", tensor_parallel_size=2)
    try:
        finals = run(engine, requests)
    finally:
        engine.close()
    assert_beams_equal(finals, expected)


@INTERPRETER_MARK
def test_beams_through_the_decode_graphs_equal_transformers(tiny_model_dir, tiny_adapters, tiny_peft):
    prompts = random_prompts([7, 12], 512, seed=7)
    requests, expected = searches(prompts, tiny_peft, [None, "a0"])
    engine = make_engine(tiny_model_dir, tiny_adapters[:2], "triton")
    engine.runner.start_graphs(engine.lora_cache, capture=False)
    replays = []
    run_graph = engine.runner.graphs.run
    engine.runner.graphs.run = lambda bucket, *args: replays.append(bucket) or run_graph(bucket, *args)
    assert_beams_equal(run(engine, requests), expected)
    assert replays, "decode steps of beams went through the graphs"


def test_four_beams_hold_their_prompt_blocks_once_and_give_every_block_back(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_block_size=16,
                       kv_cache_memory_bytes=1 << 20)
    prompt = random_prompts([200], 512, seed=8)[0]               # 12 full blocks and 8 tokens of a 13th
    request_id = engine.add_request(prompt, max_new_tokens=6, beam_width=4, ignore_end_id=True)
    engine.step()                                                # the prompt (one chunk), its first round
    beams = engine.seqs[request_id]
    assert [len(seq.output_ids) for seq in beams] == [1] * 4
    assert all(seq.block_table[:12] == beams[0].block_table[:12] for seq in beams)
    assert engine.blocks.num_used_blocks == 12 + 4, "the prompt's full blocks once, a last block each"
    engine.step()
    assert engine.stats()["kv_used"] == 16
    engine.abort(request_id)
    assert engine.blocks.num_used_blocks == 0
    engine.generate([prompt], max_new_tokens=6, beam_width=4)
    assert engine.blocks.num_used_blocks == 0
