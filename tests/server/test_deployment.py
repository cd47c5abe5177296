"""TensorRT-LLM's deployment choices: decoupled mode off (unary ModelInfer, HTTP generate) and the core model
under the name `tensorrt_llm`, on SmolLM2 with the text models, against the in-process engine."""
import json
import re
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from backend import LLMEngine
from backend.model.checkpoint import ModelConfig
from tests.helpers import ROOT
from tests.server.conftest import engine_pid, run_frontend, run_server
from tests.server.streams import Stream, make_inputs, run, trtllm_inputs

sys.path.append(str(ROOT / "scripts"))   # after the root: scripts/bench.py is not the bench package
from render_repository import render  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"
MAX_NEW = 8


@pytest.fixture(scope="module")
def unary_server(tmp_path_factory, smollm2_dir):
    repository = render(tmp_path_factory.mktemp("repo") / "model_repository", decoupled=False,
                        core_name="tensorrt_llm")
    env = {"LORA_LLM_MODEL_DIR": str(smollm2_dir), "LORA_LLM_KV_CACHE_MEMORY_BYTES": str(64 << 20)}
    yield from run_server(tmp_path_factory, "unary-server", env, model_repository=repository)


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """The in-process engine's greedy completion of PROMPT, and its text."""
    from backend.text import load_tokenizer
    tokenizer = load_tokenizer(str(smollm2_dir))
    ids = tokenizer(PROMPT)["input_ids"]
    engine = LLMEngine(smollm2_dir, kv_cache_memory_bytes=64 << 20)
    tokens = engine.generate([ids], max_new_tokens=MAX_NEW, end_id=tokenizer.eos_token_id)[0]
    return ids, tokens, tokenizer.decode(tokens, skip_special_tokens=True)


def test_unary_infer_on_the_core_model_named_tensorrt_llm(unary_server, reference):
    ids, tokens, _ = reference
    client = grpcclient.InferenceServerClient(unary_server.grpc_url)
    inputs = make_inputs(input_ids=np.array([ids], np.int32), input_lengths=np.array([[len(ids)]], np.int32),
                         request_output_len=np.array([[MAX_NEW]], np.int32),
                         end_id=np.array([[2]], np.int32), exclude_input_in_output=np.array([[True]]))
    result = client.infer("tensorrt_llm", inputs)
    assert result.as_numpy("output_ids").reshape(-1).tolist() == tokens
    assert result.as_numpy("sequence_length").tolist() == [[len(tokens)]]
    with pytest.raises(Exception, match="streaming: streaming is only supported in decoupled mode"):
        client.infer("tensorrt_llm", inputs + make_inputs(streaming=np.array([[True]])))
    assert "lora_llm" not in json.dumps(client.get_model_repository_index(as_json=True))


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_http_generate_on_the_text_models(unary_server, reference, model):
    _, _, text = reference
    body = json.dumps({"text_input": PROMPT, "max_tokens": MAX_NEW, "exclude_input_in_output": True}).encode()
    url = f"http://127.0.0.1:{unary_server.http_port}/v2/models/{model}/generate"
    with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=120) as response:
        answer = json.loads(response.read())
    assert answer["text_output"] == text


def test_the_text_models_refuse_streaming_when_not_decoupled(unary_server):
    client = grpcclient.InferenceServerClient(unary_server.grpc_url)
    inputs = make_inputs(text_input=np.array([[PROMPT]], object), max_tokens=np.array([[4]], np.int32),
                         stream=np.array([[True]]))
    with pytest.raises(Exception, match="stream: streaming is only supported in decoupled mode"):
        client.infer("ensemble", inputs)


def test_the_decoupled_bls_answers_as_tensorrt_llm_end_to_end_client_reads_it(smollm2_server):
    """text_output [1] per response (the client reads output[0].decode()), sequence_index per sample."""
    inputs = {"text_input": np.array([[PROMPT]], object), "max_tokens": np.array([[MAX_NEW]], np.int32),
              "stream": np.array([[False]]), "num_return_sequences": np.array([[2]], np.int32),
              "top_k": np.array([[20]], np.int32), "temperature": np.array([[1.0]], np.float32),
              "random_seed": np.array([[3]], np.uint64), "exclude_input_in_output": np.array([[True]])}
    from tests.server.streams import Stream
    stream = Stream(smollm2_server.grpc_url).send(inputs, model="tensorrt_llm_bls")
    texts = {}
    for result in stream.results():
        output = result.as_numpy("text_output")
        if output is not None:
            assert output.shape == (1,)
            texts[int(result.as_numpy("sequence_index")[0][0])] = output[0].decode("utf-8")
    stream.close()
    assert sorted(texts) == [0, 1] and all(texts.values())


def test_embedding_bias_words_steer_the_text(smollm2_server):
    base = run(smollm2_server.grpc_url, {"text_input": np.array([[PROMPT]], object),
                                         "max_tokens": np.array([[MAX_NEW]], np.int32),
                                         "exclude_input_in_output": np.array([[True]])},
               model="ensemble", output="text_output")
    biased = run(smollm2_server.grpc_url, {"text_input": np.array([[PROMPT]], object),
                                           "max_tokens": np.array([[MAX_NEW]], np.int32),
                                           "exclude_input_in_output": np.array([[True]]),
                                           "embedding_bias_words": np.array([[" banana"]], object),
                                           "embedding_bias_weights": np.array([[30.0]], np.float32)},
                 model="ensemble", output="text_output")
    base_text, biased_text = (r.chunks[0][0].decode() for r in (base, biased))
    assert "banana" not in base_text and biased_text.count("banana") >= MAX_NEW // 2


@pytest.mark.parametrize("guide_type, guide, check", [
    ("json_schema", json.dumps({"type": "object", "properties": {"colour": {"type": "string", "maxLength": 10}},
                                "required": ["colour"], "additionalProperties": False}),
     lambda text: set(json.loads(text)) == {"colour"}),
    ("regex", "(red|green|blue), (red|green|blue)", lambda text: text.count(", ") == 1 and len(text) <= 12),
])
def test_guided_decoding_through_the_text_model(smollm2_server, guide_type, guide, check):
    result = run(smollm2_server.grpc_url, {"text_input": np.array([[PROMPT]], object),
                                           "max_tokens": np.array([[40]], np.int32),
                                           "exclude_input_in_output": np.array([[True]]),
                                           "guided_decoding_guide_type": np.array([[guide_type]], object),
                                           "guided_decoding_guide": np.array([[guide]], object)},
                 model="ensemble", output="text_output")
    assert result.error is None and check(result.chunks[0][0].decode())


def test_a_guide_that_does_not_compile_is_an_error_naming_the_input(smollm2_server):
    result = run(smollm2_server.grpc_url, {"text_input": np.array([[PROMPT]], object),
                                           "max_tokens": np.array([[8]], np.int32),
                                           "guided_decoding_guide_type": np.array([["json_schema"]], object),
                                           "guided_decoding_guide": np.array([["{oops"]], object)},
                 model="ensemble", output="text_output")
    assert result.error and "guided_decoding_guide: does not compile as json_schema" in result.error


def test_a_batch_of_prompts_through_the_text_model_answers_each_with_its_batch_index(smollm2_server):
    """end_to_end_grpc_client.py --batch-inputs: prompts stacked in one request."""
    prompts = [PROMPT, "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"]
    alone = [run(smollm2_server.grpc_url, {"text_input": np.array([[p]], object),
                                           "max_tokens": np.array([[MAX_NEW]], np.int32),
                                           "exclude_input_in_output": np.array([[True]]),
                                           "stop_words": np.array([["Paris"]], object)},
                 model="ensemble", output="text_output").chunks[0][0].decode() for p in prompts]
    from tests.server.streams import Stream
    stream = Stream(smollm2_server.grpc_url).send(
        {"text_input": np.array([[p] for p in prompts], object), "max_tokens": np.array([[MAX_NEW]] * 2, np.int32),
         "exclude_input_in_output": np.array([[True]] * 2), "stop_words": np.array([["Paris"]] * 2, object)},
        model="tensorrt_llm_bls")
    texts = {int(r.as_numpy("batch_index")[0][0]): r.as_numpy("text_output")[0].decode()
             for r in stream.results() if r.as_numpy("text_output") is not None}
    stream.close()
    assert texts == dict(enumerate(alone))


def test_unary_infer_of_a_batch_answers_every_row_in_one_response(unary_server, reference, smollm2_dir):
    ids, tokens, _ = reference
    short = ids[:-3]
    client = grpcclient.InferenceServerClient(unary_server.grpc_url)
    inputs = make_inputs(input_ids=np.array([ids, short + [0, 0, 0]], np.int32),
                         input_lengths=np.array([[len(ids)], [len(short)]], np.int32),
                         request_output_len=np.array([[MAX_NEW], [3]], np.int32),
                         end_id=np.array([[2], [2]], np.int32), exclude_input_in_output=np.array([[True], [True]]))
    result = client.infer("tensorrt_llm", inputs)
    engine = LLMEngine(smollm2_dir, kv_cache_memory_bytes=64 << 20)
    second = engine.generate([short], max_new_tokens=3, end_id=2)[0]
    output_ids, lengths = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
    assert output_ids.shape == (2, 1, len(tokens)) and lengths.tolist() == [[len(tokens)], [len(second)]]
    assert output_ids[0, 0].tolist() == tokens and output_ids[1, 0, :len(second)].tolist() == second
    assert (output_ids[1, 0, len(second):] == -1).all()


def test_a_cancelled_unary_text_request_stops_its_core_request(unary_server):
    """A client's gRPC cancel of a unary `ensemble` call reaches the core (as a `stop` from the ensemble)."""
    before = unary_server.metric("lora_llm_requests_total", status="cancelled")
    client = grpcclient.InferenceServerClient(unary_server.grpc_url)
    inputs = make_inputs(text_input=np.array([[PROMPT]], dtype=object), max_tokens=np.array([[400]], np.int32),
                         min_length=np.array([[400]], np.int32))
    call = client.async_infer("ensemble", inputs, callback=lambda result, error: None)
    deadline = time.monotonic() + 20
    while unary_server.metric("lora_llm_kv_blocks", state="used") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)                                     # the core request runs
    call.cancel()
    while unary_server.metric("lora_llm_requests_total", status="cancelled") == before and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert unary_server.metric("lora_llm_requests_total", status="cancelled") == before + 1
    assert unary_server.metric("lora_llm_kv_blocks", state="used") == 0
    client.close()


def test_the_kubernetes_probes_answer(tiny_server, tiny_chat_model_dir, tmp_path_factory):
    """deploy/kubernetes/server.yaml's probes, on a real server and the OpenAI API beside it."""
    import yaml
    docs = yaml.safe_load_all((ROOT / "deploy/kubernetes/server.yaml").read_text())
    [c] = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"]
    frontend = run_frontend(tmp_path_factory, tiny_server, tiny_chat_model_dir)
    ports = {"http": tiny_server.http_port, "openai": next(frontend).port}
    try:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            url = f"http://127.0.0.1:{ports[get['port']]}{get['path']}"
            assert urllib.request.urlopen(url, timeout=5).status == 200, probe
    finally:
        next(frontend, None)                                   # its teardown: the frontend stopped


def test_tritonserver_returns_freed_request_memory_and_the_engine_keeps_its_malloc(tiny_server):
    """scripts/server_process.py fixes glibc's mmap threshold for tritonserver (multi-MB adapter uploads go back to
    the system when freed) and its stub wrapper leaves the engine's process with glibc's own behaviour."""
    def environ(pid: int) -> dict[str, str]:
        pairs = (item.split("=", 1) for item in open(f"/proc/{pid}/environ").read().split("\0") if "=" in item)
        return dict(pairs)

    server_pid = tiny_server.process.pid
    stub_pids = [int(pid) for task in Path(f"/proc/{server_pid}/task").iterdir()
                 for pid in (task / "children").read_text().split()]
    assert stub_pids and all("triton_python_backend_stub" in open(f"/proc/{pid}/cmdline").read() for pid in stub_pids)
    assert environ(server_pid).get("MALLOC_MMAP_THRESHOLD_") == str(128 << 10)
    assert all("MALLOC_MMAP_THRESHOLD_" not in environ(pid) for pid in stub_pids)


def anon_rss_mb(pid: int) -> float:
    return int(re.search(r"RssAnon:\s+(\d+) kB", open(f"/proc/{pid}/status").read())[1]) / 1024


def test_tritonserver_memory_follows_the_requests_in_flight_not_the_largest_ever_seen(tiny_server):
    """Triton's gRPC frontend reuses its request objects, and a reused protobuf keeps the capacity of the largest
    message it held: with reuse, each recycled request object keeps a multi-MB adapter upload for good (tritonserver
    grew ~40 MB/min in the soak). server_process turns the reuse off (--grpc-infer-allocation-pool-size 0)."""
    def uploads(num_rounds: int, width: int) -> None:           # rounds of 8 concurrent uploads the model refuses
        upload = {"lora_task_id": np.array([[77]], np.uint64), "lora_weights": np.zeros((1, 4, width), np.float16),
                  "lora_config": np.array([[[1, 0, 4]] * 4], np.int32)}
        for _ in range(num_rounds):
            streams = [Stream(tiny_server.grpc_url).send(trtllm_inputs([5, 6], 4, True, **upload)) for _ in range(8)]
            for stream in streams:
                assert "lora_weights" in stream.collect().error
                stream.close()

    uploads(3, 1 << 14)                                         # threads, connections, buffers: warm
    before = anon_rss_mb(tiny_server.process.pid)
    uploads(3, 1 << 20)                                         # 8 MB each
    time.sleep(1)
    assert anon_rss_mb(tiny_server.process.pid) - before < 16   # 8 reused objects would keep 64 MB


def test_the_engines_process_gives_freed_adapter_memory_back_each_trim_period(tmp_path_factory, smollm2_dir):
    """Adapters of ~20 MB each (under glibc's largest mmap threshold, so they come from the heap once the threshold
    has risen) churning through a host tier of two: the evicted ones' pages stay resident in the engine process's heap
    until its trimmer runs (backend/heap.py, every LORA_LLM_HEAP_TRIM_PERIOD_S), then its RssAnon falls."""
    from soak import make_adapter
    cfg = ModelConfig.from_dir(smollm2_dir)
    adapters = [make_adapter(cfg, 64, seed) for seed in range(6)]
    size = adapters[0][0].nbytes                                          # fp16 rows: what the host tier keeps
    period = 6
    env = {"LORA_LLM_MODEL_DIR": str(smollm2_dir), "LORA_LLM_KV_CACHE_MEMORY_BYTES": str(64 << 20),
           "LORA_LLM_LORA_CACHE_HOST_MEMORY_BYTES": str(2 * size + (1 << 20)),
           "LORA_LLM_LORA_CACHE_MAX_ADAPTER_SIZE": str(size + (1 << 20)), "LORA_LLM_MAX_LORAS": "2",
           "LORA_LLM_HEAP_TRIM_PERIOD_S": str(period)}
    server = next(fixture := run_server(tmp_path_factory, "trim", env, models=["lora_llm"]))
    try:
        engine = engine_pid(server.http_port)
        for task, (weights, config) in enumerate(adapters, start=1):
            result = run(server.grpc_url, trtllm_inputs([5, 6, 7], 1, True, lora_task_id=np.array([[task]], np.uint64),
                                                        lora_weights=weights[None], lora_config=config[None]))
            assert result.error is None, result.error
        after_uploads = anon_rss_mb(engine)
        time.sleep(period + 2)
        assert anon_rss_mb(engine) < after_uploads - 15, (after_uploads, anon_rss_mb(engine))
    finally:
        next(fixture, None)


def stub_pids(server_pid: int) -> list[int]:
    return [int(pid) for task in Path(f"/proc/{server_pid}/task").iterdir()
            for pid in (task / "children").read_text().split()]
