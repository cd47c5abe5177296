"""The lora_llm model on a real tritonserver: streaming, adapters, errors, cancellation, TRT-LLM shapes."""
import time

import numpy as np
import pytest

from backend.lora.peft import peft_to_trtllm
from tests.helpers import random_prompts
from tests.server.streams import Stream, run, running_stream, trtllm_inputs

MAX_NEW = 8


@pytest.fixture(scope="module")
def engine(new_tiny_engine):
    return new_tiny_engine()


@pytest.fixture(scope="module")
def adapters(tiny_adapters):
    """TRT-LLM tensors of the four tiny adapters, fp16 as clients send them, by task id 101..104."""
    out = {}
    for task_id, path in enumerate(tiny_adapters, start=101):
        weights, config = peft_to_trtllm(path, "float16")
        out[task_id] = (weights, config)
    return out


def expected(engine, prompts, task_ids=None, adapters=None) -> list[list[int]]:
    for task_id in set(task_ids or []) - {None}:
        engine.add_lora(task_id, *adapters[task_id])
    return engine.generate(prompts, max_new_tokens=MAX_NEW, lora_task_ids=task_ids)


@pytest.mark.parametrize("streaming", [True, False])
def test_outputs_equal_the_in_process_engine(tiny_server, engine, streaming):
    prompts = random_prompts([5, 19, 33], 512, seed=40)
    want = expected(engine, prompts)
    for prompt, tokens in zip(prompts, want):
        result = run(tiny_server.grpc_url, trtllm_inputs(prompt, MAX_NEW, streaming))
        assert result.error is None and result.num_final == 1
        if streaming:
            # a token a response, or a few together where the sends fell behind the steps (backend/serving/responder.py)
            assert all(c.shape[:2] == (1, 1) and c.shape[2] >= 1 for c in result.chunks)
            assert result.tokens == tokens
        else:
            [chunk] = result.chunks
            assert chunk.shape == (1, 1, len(prompt) + MAX_NEW)          # [batch, beam, prompt + completion]
            assert result.tokens == prompt + tokens


def test_exclude_input_in_output_returns_the_completion_only(tiny_server, engine):
    prompt = random_prompts([11], 512, seed=41)[0]
    result = run(tiny_server.grpc_url, trtllm_inputs(prompt, MAX_NEW, False,
                                                     exclude_input_in_output=np.array([[True]])))
    assert result.tokens == expected(engine, [prompt])[0]


def test_sixteen_concurrent_streams_over_four_adapters_and_base(tiny_server, engine, adapters):
    task_ids = [101, 102, 103, 104] + [101, 102, 103, 104, None] * 2 + [101, 102]
    prompts = random_prompts([4 + 3 * i for i in range(16)], 512, seed=42)
    want = expected(engine, prompts, task_ids, adapters)

    def request(i: int, with_weights: bool) -> dict:
        extra = {}
        if task_ids[i] is not None:
            extra["lora_task_id"] = np.array([[task_ids[i]]], np.uint64)
        if with_weights:
            weights, config = adapters[task_ids[i]]
            extra |= {"lora_weights": weights[None], "lora_config": config[None]}    # [1, N, R], [1, N, 3]
        return trtllm_inputs(prompts[i], MAX_NEW, True, **extra)

    streams = [Stream(tiny_server.grpc_url).send(request(i, with_weights=True)) for i in range(4)]
    for stream in streams:                                  # the adapters are in the cache once each has answered
        stream.wait_first()
    streams += [Stream(tiny_server.grpc_url).send(request(i, with_weights=False)) for i in range(4, 16)]
    results = [s.collect() for s in streams]
    for stream in streams:
        stream.close()
    for i, result in enumerate(results):
        assert result.error is None, result.error
        assert result.num_final == 1
        assert result.tokens == want[i], f"stream {i} (task {task_ids[i]})"


def test_unknown_task_id_gets_the_exact_error(tiny_server):
    result = run(tiny_server.grpc_url, trtllm_inputs([5, 6, 7], 4, True, lora_task_id=np.array([[987654]], np.uint64)))
    assert "LoRA task 987654 not found in cache. Please send LoRA weights with request" in result.error
    assert result.num_final == 1


BAD_INPUTS = {
    "wrong dtype": dict(input_ids=np.array([[5.0, 6.0]], np.float32)),
    "batch of two in one request": dict(input_ids=np.array([[5, 6], [7, 8]], np.int32)),
    "bad lora_config": dict(lora_task_id=np.array([[55]], np.uint64),
                            lora_weights=np.zeros((1, 2, 4096), np.float16),
                            lora_config=np.array([[[1, 0, 8], [42, 0, 8]]], np.int32)),
    "token outside the vocabulary": dict(input_ids=np.array([[5, 2**31 - 1]], np.int32)),
    "zero output length": dict(request_output_len=np.array([[0]], np.int32)),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_fails_alone_while_a_concurrent_stream_completes(tiny_server, engine, name):
    prompt = random_prompts([9], 512, seed=43)[0]
    good = Stream(tiny_server.grpc_url).send(trtllm_inputs(prompt, 24, True))
    bad_inputs = trtllm_inputs([5, 6, 7], 4, True)
    if "input_ids" in BAD_INPUTS[name]:
        bad_inputs.pop("input_lengths")
    bad = run(tiny_server.grpc_url, bad_inputs | BAD_INPUTS[name])
    assert bad.error and bad.num_final == 1
    result = good.collect()
    good.close()
    assert result.error is None and len(result.tokens) == 24


def wait_for(predicate, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_client_cancel_mid_stream_frees_the_kv_blocks(tiny_server):
    """A client's cancel mid-stream ends the request as cancelled and frees its KV blocks. A cancel reaches the
    engine within the stub's check period: where the request still finished first (seen once beside a full CI run),
    it is sent again, three times at most."""
    def count(status: str) -> float:
        return tiny_server.metric("lora_llm_requests_total", status=status)

    for _ in range(3):
        cancelled, succeeded = count("cancelled"), count("success")
        stream = running_stream(tiny_server.grpc_url, trtllm_inputs([5] * 40, 400, True),
                                lambda: tiny_server.metric("lora_llm_kv_blocks", state="used") > 0)
        stream.close(cancel=True)
        assert wait_for(lambda: tiny_server.metric("lora_llm_kv_blocks", state="used") == 0)
        assert wait_for(lambda: count("cancelled") == cancelled + 1 or count("success") == succeeded + 1)
        if count("cancelled") == cancelled + 1:
            break
    else:
        raise AssertionError("every request finished before its cancel reached the engine")
    assert run(tiny_server.grpc_url, trtllm_inputs([5, 6], 3, True)).tokens.__len__() == 3


def test_step_latency_is_exported_by_kind(tiny_server):
    before = {kind: tiny_server.metric("lora_llm_step_seconds_count", kind=kind) for kind in ("decode", "prefill")}
    assert len(run(tiny_server.grpc_url, trtllm_inputs([5] * 10, 6, True)).tokens) == 6
    after = {kind: tiny_server.metric("lora_llm_step_seconds_count", kind=kind) for kind in ("decode", "prefill")}
    assert after["prefill"] >= before["prefill"] + 1 and after["decode"] >= before["decode"] + 5
    assert tiny_server.metric("lora_llm_step_seconds_sum", kind="decode") > 0


def test_generated_tokens_and_gauges_follow_the_requests(tiny_server):
    """Tokens are counted once a step and gauges sent only when they change: the figures still add up."""
    before = {}
    stream = running_stream(tiny_server.grpc_url, trtllm_inputs([6] * 20, 400, True),
                            lambda: tiny_server.metric("lora_llm_sequences", state="running") == 1,
                            before=lambda: before.update(tokens=tiny_server.metric("lora_llm_generated_tokens_total")))
    stream.close(cancel=True)
    assert wait_for(lambda: tiny_server.metric("lora_llm_sequences", state="running") == 0)
    tokens = before["tokens"]
    streamed = tiny_server.metric("lora_llm_generated_tokens_total") - tokens
    assert 1 <= streamed <= 400                           # (the cancel may come after the last token)
    assert len(run(tiny_server.grpc_url, trtllm_inputs([5] * 10, 7, True)).tokens) == 7
    assert wait_for(lambda: tiny_server.metric("lora_llm_generated_tokens_total") == tokens + streamed + 7)


def test_stop_request_with_the_same_id_cancels_it(tiny_server):
    stream = Stream(tiny_server.grpc_url).send(trtllm_inputs([7] * 30, 400, True), request_id="victim-1")
    stream.wait_first()
    stop = run(tiny_server.grpc_url, trtllm_inputs([1], 1, True, stop=np.array([[True]])), request_id="victim-1")
    assert stop.error is None and stop.num_final == 1
    result = stream.collect()
    stream.close()
    assert result.error is None and result.num_final == 1 and len(result.tokens) < 400
    assert wait_for(lambda: tiny_server.metric("lora_llm_kv_blocks", state="used") == 0)


def test_stop_without_request_id_is_an_error(tiny_server):
    result = run(tiny_server.grpc_url, trtllm_inputs([1], 1, True, stop=np.array([[True]])))
    assert result.error and "A request id must be provided for request cancellation" in result.error


def test_the_client_library_sends_weights_once_and_retries_on_not_found(tiny_server, engine, adapters, tiny_adapters):
    from client import LoraLLMClient
    prompt = random_prompts([13], 512, seed=44)[0]
    want = expected(engine, [prompt], [101], adapters)[0]
    client = LoraLLMClient(tiny_server.grpc_url)
    try:
        for _ in range(2):                   # the second call sends only the id
            chunks = list(client.generate(prompt, MAX_NEW, True, lora_task_id=777, lora_dir=tiny_adapters[0]))
            assert [t for c in chunks for t in c] == want
        client.sent_task_ids.add(778)        # it believes the server has 778; the server says not found
        chunks = list(client.generate(prompt, MAX_NEW, True, lora_task_id=778, lora_dir=tiny_adapters[0]))
        assert [t for c in chunks for t in c] == want
    finally:
        client.close()


def test_stop_in_tensorrt_llm_client_form_is_honoured_before_any_validation(tiny_server):
    stream = Stream(tiny_server.grpc_url).send(trtllm_inputs([7] * 30, 400, True), request_id="victim-2")
    stream.wait_first()
    stop = {"input_ids": np.array([[0]], np.int32), "input_lengths": np.array([[0]], np.int32),
            "request_output_len": np.array([[0]], np.int32), "stop": np.array([[True]])}
    assert run(tiny_server.grpc_url, stop, request_id="victim-2").error is None
    result = stream.collect()
    stream.close()
    assert result.error is None and result.num_final == 1 and len(result.tokens) < 400


def test_end_id_minus_one_means_no_end_token(tiny_server, engine):
    prompt = random_prompts([8], 512, seed=48)[0]
    [free] = engine.generate([prompt], max_new_tokens=12)
    result = run(tiny_server.grpc_url, trtllm_inputs(prompt, 12, True, end_id=np.array([[-1]], np.int32)))
    assert result.error is None and result.tokens == free


def test_a_dora_adapter_in_tensorrt_llm_four_column_form_answers_as_in_process(tiny_server, new_tiny_engine,
                                                                             tiny_model_dir, tmp_path_factory):
    """The TensorRT-LLM client contract with today's converter output: a DoRA adapter's four-column tensors (fp16,
    magnitudes normalized against the base model) go with the first request, later ones send only the id; both
    answer as the in-process engine given the same tensors (which answers as PEFT: tests/backend/lora/test_dora.py)."""
    from backend.lora.dora import checkpoint_weights
    from tests.helpers import ALL_MODULES, make_peft_adapters
    [path] = make_peft_adapters(tiny_model_dir, tmp_path_factory.mktemp("dora"), seed=5,
                                specs=[dict(r=8, lora_alpha=16, use_dora=True, target_modules=ALL_MODULES)])
    weights, config = peft_to_trtllm(path, "float16", checkpoint_weights(tiny_model_dir))
    assert config.shape[1] == 4 and config[:, 3].all()
    engine = new_tiny_engine()
    engine.add_lora(303, weights, config)
    prompts = random_prompts([13, 7], 512, seed=47)
    want = engine.generate(prompts, max_new_tokens=MAX_NEW, lora_task_ids=[303, 303], end_id=None)
    assert want != engine.generate(prompts, max_new_tokens=MAX_NEW, end_id=None)      # the adapter matters
    sent = {"lora_weights": weights[None], "lora_config": config[None]}
    for prompt, tokens, carry in zip(prompts, want, (sent, {})):
        result = run(tiny_server.grpc_url, trtllm_inputs(prompt, MAX_NEW, True, end_id=np.array([[-1]], np.int32),
                                                         lora_task_id=np.array([[303]], np.uint64), **carry))
        assert result.error is None, result.error
        assert result.tokens == tokens


def in_process_beams(engine, prompt: list[int], **params) -> list:
    """The in-process engine's beam search: its best beams (Hypothesis), best first."""
    request_id = engine.add_request(prompt, **params)
    final = None
    while request_id in engine.seqs:
        final = next((out for out in engine.step() if out.request_id == request_id and out.request_finished), final)
    return final.beams


@pytest.mark.parametrize("streaming", [True, False])
def test_beam_search_returns_every_beam_in_tensorrt_llms_shapes(tiny_server, engine, streaming):
    prompt = random_prompts([13], 512, seed=44)[0]
    want = in_process_beams(engine, prompt, max_new_tokens=MAX_NEW, beam_width=3, num_return_sequences=3,
                            length_penalty=0.5, end_id=7)
    stream = Stream(tiny_server.grpc_url).send(trtllm_inputs(
        prompt, MAX_NEW, streaming, beam_width=np.array([[3]], np.int32), len_penalty=np.array([[0.5]], np.float32),
        end_id=np.array([[7]], np.int32), return_log_probs=np.array([[True]])))
    try:
        responses = [r for r in stream.results() if r.as_numpy("output_ids") is not None]
    finally:
        stream.close()
    if streaming:                      # each round's beams so far, all of the same length, then the best beams
        shapes = [r.as_numpy("output_ids").shape for r in responses]
        assert all(shape[:2] == (1, 3) for shape in shapes) and len(shapes) > 1
        assert [shape[2] for shape in shapes[:-1]] == list(range(1, len(shapes)))
    last = responses[-1]
    prefix = [] if streaming else prompt
    lengths = last.as_numpy("sequence_length")[0].tolist()
    ids = last.as_numpy("output_ids")[0]
    assert lengths == [len(prefix) + len(beam.output_ids) for beam in want]
    assert [ids[b, :n].tolist() for b, n in enumerate(lengths)] == [prefix + beam.output_ids for beam in want]
    assert all((ids[b, n:] == 7).all() for b, n in enumerate(lengths)), "padded with the end id"
    assert last.as_numpy("cum_log_probs")[0] == pytest.approx([beam.cum_log_prob for beam in want], abs=1e-4)
    log_probs = last.as_numpy("output_log_probs")[0]
    for b, (n, beam) in enumerate(zip(lengths, want)):
        assert log_probs[b, len(prefix):n].tolist() == pytest.approx(beam.log_probs, abs=1e-4)
