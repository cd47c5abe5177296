"""One step ahead (overlap_steps): the next step is launched before the last one's tokens reach the host, its
sequences' input ids taken from the last step's sampled ids on the device. The tokens are those of the synchronous
engine in every case; a sequence found finished a step late (a stop word, its end id, a cancellation) drops the
token computed meanwhile and sends nothing after its final output."""
import pytest
import torch

from backend import LLMEngine
from backend.core.outputs import request_of
from backend.core.request import Status
from backend.model.checkpoint import ModelConfig
from backend.model.context import StepInputs
from tests.helpers import CUDA_MARKS, INTERPRETER_MARK, kv_bytes_for_blocks, random_prompts

LENGTHS = [5, 17, 9, 30, 3, 12]
MAX_NEW = [12, 5, 20, 8, 15, 10]                      # sequences leave at different steps; some join late


def make_engine(model_dir, overlap: bool, **kwargs) -> LLMEngine:
    kwargs = {"dtype": "float32", "device": "cpu", "max_num_seqs": 4, "max_num_batched_tokens": 24,
              "kv_cache_memory_bytes": 1 << 20, "overlap_steps": "true" if overlap else "false"} | kwargs
    return LLMEngine(model_dir, **kwargs)


def drive(engine: LLMEngine, requests: list[dict], abort_after: dict | None = None) -> dict:
    """Add every request, step until all are done; each request's tokens and finish reason as sent. Asserts that
    nothing is sent for a request after its final output. abort_after: {request index: after its n-th token}."""
    ids = [engine.add_request(**request) for request in requests]
    sent = {request_id: [] for request_id in ids}
    reasons = {}
    while engine.has_unfinished:
        for out in engine.step():
            assert not out.error, out.error
            assert out.request_id not in reasons, "an output after the request's final one"
            sent[out.request_id] += out.new_token_ids
            if out.request_finished:
                reasons[out.request_id] = out.finish_reason
        for index, after in (abort_after or {}).items():
            if len(sent[ids[index]]) >= after and ids[index] not in reasons:
                engine.abort(ids[index])
                reasons[ids[index]] = "abort"
    return {i: (sent[request_id], reasons[request_id]) for i, request_id in enumerate(ids)}


def both(model_dir, requests: list[dict], **kwargs) -> tuple[dict, dict]:
    return tuple(drive(make_engine(model_dir, overlap, **kwargs), requests) for overlap in (False, True))


def plain(prompts: list[list[int]], **sampling) -> list[dict]:
    return [dict(prompt_ids=prompt, max_new_tokens=n, **sampling) for prompt, n in zip(prompts, MAX_NEW)]


@pytest.fixture()
def prompts():
    return random_prompts(LENGTHS, 512, seed=3)


@pytest.fixture()
def ahead(monkeypatch) -> list[int]:
    """The number of input ids each step took from the step before on the device."""
    counts, take = [], StepInputs.take_pending
    def counted(self, *args):
        counts.append(len(self.pending))
        return take(self, *args)
    monkeypatch.setattr(StepInputs, "take_pending", counted)
    return counts


def test_greedy_steps_run_ahead_and_give_the_same_tokens(tiny_model_dir, prompts, ahead):
    """Every request ends by length, known when its last token is sampled: not one step more runs."""
    engines = [make_engine(tiny_model_dir, overlap) for overlap in (False, True)]
    sync, overlapped = (drive(engine, plain(prompts, end_id=None)) for engine in engines)
    assert overlapped == sync
    assert len(ahead) >= 20 and max(ahead) == 4, "most steps launched before the last one's tokens landed"
    assert engines[1].num_steps == engines[0].num_steps


def test_a_request_to_the_last_position_computes_no_token_past_it(tiny_model_dir):
    """prompt + max_new_tokens = max_position_embeddings (512): a step past the last token would need position
    512."""
    prompt = random_prompts([500], 512, seed=4)[0]
    sync, overlapped = both(tiny_model_dir, [dict(prompt_ids=prompt, max_new_tokens=12)], max_num_batched_tokens=512)
    assert overlapped == sync and len(sync[0][0]) == 12


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.9, top_k=40, top_p=0.9, seed=7),
    dict(temperature=1.0, seed=11, min_tokens=6, end_id=5),
    dict(temperature=0.7, seed=3, return_log_probs=True, return_generation_logits=True),
], ids=["seeded", "min-tokens", "log-probs"])
def test_seeded_sampling_gives_the_same_tokens(tiny_model_dir, prompts, sampling):
    sync, overlapped = both(tiny_model_dir, plain(prompts, **sampling))
    assert overlapped == sync


def test_log_probs_and_logits_follow_their_tokens(tiny_model_dir, prompts):
    """Each output's log probs and logits are its own token's, with a step in flight."""
    outs = {}
    for overlap in (False, True):
        engine = make_engine(tiny_model_dir, overlap)
        for prompt in prompts[:3]:
            engine.add_request(prompt, max_new_tokens=6, return_log_probs=True, return_generation_logits=True)
        got = []
        while engine.has_unfinished:
            got += [(out.request_id, out.new_token_ids, out.log_probs, out.generation_logits.argmax().item())
                    for out in engine.step() if out.new_token_ids]
        outs[overlap] = sorted(got, key=lambda o: o[0])
        assert all(tokens == [top] for _, tokens, _, top in got), "greedy: the token is its logits' argmax"
    assert outs[True] == outs[False]


@pytest.mark.parametrize("sampling", [
    dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
    dict(bad_words=[[7, 9], [11]]),
    dict(temperature=0.8, seed=5, top_p=0.9, top_p_decay=0.8, top_p_reset_id=17),
], ids=["penalties", "bad-words", "top-p-decay"])
def test_rows_that_read_their_last_token_wait_for_it(tiny_model_dir, prompts, sampling, ahead):
    """Sampling inputs built from the last token: that step waits for it (and others in the batch with it)."""
    requests = plain(prompts, **sampling)
    sync, overlapped = both(tiny_model_dir, requests)
    assert overlapped == sync and ahead == []


def test_mixed_adapters_chunked_prompts_and_preemption(tiny_model_dir, tiny_adapters, prompts, ahead):
    """Adapters of four ranks and the base in one batch, prompts in chunks, and a cache of 12 blocks: sequences are
    preempted with a token in flight and computed again."""
    requests = [dict(prompt_ids=prompt, max_new_tokens=n, lora=[None, 1, 2, 3, 4, 1][i])
                for i, (prompt, n) in enumerate(zip(prompts, MAX_NEW))]
    results = []
    for overlap in (False, True):
        engine = make_engine(tiny_model_dir, overlap, kv_block_size=4, max_lora_rank=64,
                             kv_cache_memory_bytes=kv_bytes_for_blocks(12, 4, ModelConfig.from_dir(tiny_model_dir)))
        for task_id, path in enumerate(tiny_adapters, start=1):
            engine.add_lora_dir(task_id, path)
        results.append(drive(engine, requests))
        assert engine.scheduler.num_preemptions > 0
    assert results[1] == results[0] and ahead


def test_kv_reuse_names_only_blocks_whose_tokens_the_host_has(tiny_model_dir, prompts):
    """A shared prefix is reused in both modes, and the reused blocks give the same tokens."""
    prefix = random_prompts([40], 512, seed=9)[0]
    requests = [dict(prompt_ids=prefix + prompt, max_new_tokens=n) for prompt, n in zip(prompts, MAX_NEW)]
    hits = []
    results = []
    for overlap in (False, True):
        engine = make_engine(tiny_model_dir, overlap, enable_kv_cache_reuse=True, max_num_seqs=2,
                             max_num_batched_tokens=64, kv_cache_memory_bytes=4 << 20)
        results.append(drive(engine, requests))
        hits.append(engine.blocks.num_hits)
    assert results[1] == results[0] and hits[1] == hits[0] > 0


def test_a_second_turn_reuses_the_blocks_the_first_turn_generated(tiny_model_dir, prompts):
    """The blocks filled while decoding are named once the host has their tokens (a step ahead, one later): a
    follow-up prompt holding the first answer finds them."""
    hits = []
    for overlap in (False, True):
        engine = make_engine(tiny_model_dir, overlap, enable_kv_cache_reuse=True, kv_block_size=4,
                             max_num_batched_tokens=64, kv_cache_memory_bytes=4 << 20)
        (answer, _), = drive(engine, [dict(prompt_ids=prompts[0], max_new_tokens=30)]).values()
        follow_up = prompts[0] + answer + prompts[1]
        assert drive(engine, [dict(prompt_ids=follow_up, max_new_tokens=4)])[0] == \
            drive(make_engine(tiny_model_dir, False), [dict(prompt_ids=follow_up, max_new_tokens=4)])[0]
        hits.append(engine.blocks.num_hits)
    assert hits[1] == hits[0] == (len(prompts[0]) + 30 - 1) // 4


def test_num_return_sequences_fork_from_the_first(tiny_model_dir, prompts):
    requests = [dict(prompt_ids=prompt, max_new_tokens=8, num_return_sequences=2, temperature=1.0, seed=i)
                for i, prompt in enumerate(prompts[:3])]
    engines = [make_engine(tiny_model_dir, overlap) for overlap in (False, True)]
    outputs = []
    for engine in engines:
        got = {}
        for i, request in enumerate(requests):
            engine.add_request(request_id=i, **request)
        while engine.has_unfinished:
            for out in engine.step():
                got.setdefault((out.request_id, out.sequence_index), []).extend(out.new_token_ids)
        outputs.append(got)
    assert outputs[1] == outputs[0] and len(outputs[0]) == 6


@pytest.mark.parametrize("stop", ["stop_words", "end_id"])
def test_a_stop_found_a_step_late_sends_no_extra_token(tiny_model_dir, prompts, stop):
    """The stopping token's step is collected after the next one was launched: that one's token for the stopped
    sequence is computed, and dropped."""
    free = drive(make_engine(tiny_model_dir, False), plain(prompts, ignore_end_id=True))
    stops = [tokens[3] for tokens, _ in free.values()]
    requests = [dict(prompt_ids=prompt, max_new_tokens=n) | (dict(stop_words=[[t]]) if stop == "stop_words" else
                                                              dict(end_id=t))
                for prompt, n, t in zip(prompts, MAX_NEW, stops)]
    engine = make_engine(tiny_model_dir, True)
    dropped = []
    collect = engine._collect
    def watched(launched, entries):
        first = len(entries)
        collect(launched, entries)
        sent = {request_of(entry) for entry in entries[first:]}
        dropped.extend(seq.request_id for seq in launched.rows_of if seq.status is Status.FINISHED
                       and seq.request_id not in sent)
    engine._collect = watched
    sync = drive(make_engine(tiny_model_dir, False), requests)
    overlapped = drive(engine, requests)
    assert overlapped == sync
    assert all(reason == "stop" and tokens[-1] == t and t not in tokens[:-1]
               for (tokens, reason), t in zip(overlapped.values(), stops))
    assert dropped, "some stopped sequence had a token computed a step late, and it was not sent"


def test_cancellation_mid_stream_with_a_step_in_flight(tiny_model_dir, prompts):
    """Aborted requests end where they were aborted; the others' tokens do not change."""
    requests = plain(prompts)
    sync = drive(make_engine(tiny_model_dir, False), requests)
    engine = make_engine(tiny_model_dir, True)
    overlapped = drive(engine, requests, abort_after={0: 2, 2: 5})
    for i in (0, 2):
        tokens, reason = overlapped.pop(i)
        assert reason == "abort" and tokens == sync.pop(i)[0][:len(tokens)]
    assert overlapped == sync
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not engine.has_unfinished


def test_a_failed_step_fails_its_requests_and_the_step_in_flight_lands(tiny_model_dir, prompts):
    requests = plain(prompts[:3])
    sync = drive(make_engine(tiny_model_dir, False), requests)
    engine = make_engine(tiny_model_dir, True, inject_fault_steps=(4,))
    ids = [engine.add_request(**request) for request in requests]
    errors, sent = set(), {request_id: [] for request_id in ids}
    while engine.has_unfinished:
        for out in engine.step():
            if out.error:
                errors.add(out.request_id)
            sent[out.request_id] += out.new_token_ids
    assert errors == set(ids), "step 4 held every request"
    assert all(sent[request_id] == sync[i][0][:len(sent[request_id])] and sent[request_id]
               for i, request_id in enumerate(ids)), "the tokens before the failure were sent, and right"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_overlap_is_off_by_default_on_cpu_and_under_tensor_parallel(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("LORA_LLM_OVERLAP_STEPS", raising=False)
    assert not make_engine(tiny_model_dir, False, overlap_steps="auto").overlap
    assert make_engine(tiny_model_dir, False, overlap_steps="true").overlap
    with pytest.raises(ValueError, match="overlap_steps"):
        make_engine(tiny_model_dir, False, overlap_steps="yes")


@INTERPRETER_MARK
def test_decode_graphs_take_the_pending_ids(tiny_model_dir, tiny_adapters, prompts, ahead):
    """The graphs' fixed buffers (run eagerly through the Triton interpreter) get the ids from the device."""
    results = []
    for overlap in (False, True):
        engine = make_engine(tiny_model_dir, overlap, kernel_backend="triton", max_num_seqs=4)
        engine.add_lora_dir(1, tiny_adapters[0])
        engine.runner.start_graphs(engine.lora_cache, capture=False)
        results.append(drive(engine, [dict(prompt_ids=p, max_new_tokens=6, lora=[None, 1][i % 2])
                                      for i, p in enumerate(prompts[:4])]))
    assert results[1] == results[0] and ahead


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_steady_decode_steps_never_wait_for_the_device(tiny_model_dir, prompts, device):
    """On CUDA (Triton kernels, graphs) a decode step is launched with no host sync: the one wait is for the
    step before's tokens, after the next is queued (an event's synchronize, which the sync debug mode allows).
    The tokens are the steps-in-turn engine's."""
    results = []
    for overlap in (False, True):
        engine = make_engine(tiny_model_dir, overlap, device=device, max_num_seqs=8, max_num_batched_tokens=256,
                             kv_cache_memory_bytes=16 << 20)
        assert engine.overlap == overlap, engine.runner.kernel_fallbacks       # the start-up check passed
        ids = [engine.add_request(prompt, max_new_tokens=24, ignore_end_id=True,
                                  **(dict(temperature=0.8, seed=i) if i % 2 else {}))
               for i, prompt in enumerate(prompts)]
        sent = {request_id: [] for request_id in ids}
        for _ in range(3):                                       # the prompts, the first decodes
            for out in engine.step():
                sent[out.request_id] += out.new_token_ids
        torch.cuda.set_sync_debug_mode("error" if overlap else "default")
        try:
            for _ in range(12):
                for out in engine.step():
                    sent[out.request_id] += out.new_token_ids
        finally:
            torch.cuda.set_sync_debug_mode("default")
        while engine.has_unfinished:
            for out in engine.step():
                sent[out.request_id] += out.new_token_ids
        results.append(list(sent.values()))                      # by order: the start-up check takes ids too
    assert results[1] == results[0] and all(len(tokens) == 24 for tokens in results[0])


def test_the_start_up_check_passes_and_leaves_the_engine_as_it_was(tiny_model_dir):
    engine = make_engine(tiny_model_dir, True, kernel_self_check="true")
    assert engine.overlap and "overlap_steps" not in engine.runner.kernel_fallbacks
    assert (engine.num_steps, engine.num_generated_tokens, engine.has_unfinished) == (0, 0, False)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_the_start_up_check_fits_its_probes_to_a_small_cache(tiny_model_dir):
    """Eight blocks of four tokens: the probes shrink to fit beside each other, and the engine starts."""
    engine = make_engine(tiny_model_dir, True, kernel_self_check="true", kv_block_size=4,
                         kv_cache_memory_bytes=kv_bytes_for_blocks(8, 4, ModelConfig.from_dir(tiny_model_dir)))
    assert engine.overlap and engine.blocks.num_free_blocks == engine.blocks.num_blocks == 8


@pytest.mark.parametrize("defect", ["rows swapped", "not filled"])
def test_the_start_up_check_turns_a_broken_overlap_off(tiny_model_dir, monkeypatch, defect):
    """Pending ids put in the wrong rows, or not put at all (the engine then fails the probe's step): either way
    the engine starts with its steps in turn, and says why."""
    fill = StepInputs.fill_pending
    def broken(self, t):
        if defect == "rows swapped" and len(self.pending) > 1:
            t["pending_from"] = t["pending_from"].flip(0)
        if defect == "rows swapped":
            fill(self, t)
    monkeypatch.setattr(StepInputs, "fill_pending", broken)
    engine = make_engine(tiny_model_dir, True, kernel_self_check="true")
    assert not engine.overlap and "probe" in engine.runner.kernel_fallbacks["overlap_steps"]
    monkeypatch.setattr(StepInputs, "fill_pending", fill)
    sync = drive(make_engine(tiny_model_dir, False), plain(random_prompts(LENGTHS, 512, seed=3)))
    assert drive(engine, plain(random_prompts(LENGTHS, 512, seed=3))) == sync
    assert engine.num_steps > 0 and engine.blocks.num_free_blocks == engine.blocks.num_blocks
