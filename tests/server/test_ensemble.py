"""Text in, text out through the ensemble on SmolLM2, streamed with incremental detokenization, LoRA included."""
import time

import numpy as np
import pytest

from tests.server.streams import Stream, run

pytestmark = pytest.mark.slow


def text_request(text: str, max_tokens: int, stream: bool, **extra) -> dict:
    return {"text_input": np.array([[text]], dtype=object), "max_tokens": np.array([[max_tokens]], np.int32),
            "stream": np.array([[stream]])} | extra


def texts(result) -> list[str]:
    return [c.reshape(-1)[0].decode() for c in result.chunks]


def test_streaming_text_arrives_in_pieces_and_equals_the_whole(smollm2_server):
    streamed = run(smollm2_server.grpc_url, text_request("The capital of France is", 12, True), model="ensemble",
                   output="text_output")
    whole = run(smollm2_server.grpc_url, text_request("The capital of France is", 12, False), model="ensemble",
                output="text_output")
    assert streamed.error is None and whole.error is None
    assert len(streamed.chunks) > 3 and "Paris" in "".join(texts(streamed))
    assert texts(whole)[0] == "The capital of France is" + "".join(texts(streamed))


def test_multibyte_characters_are_never_split(smollm2_server):
    prompt = "Écris une phrase en français avec des accents: café, élève, à bientôt. Réponse:"
    result = run(smollm2_server.grpc_url, text_request(prompt, 24, True), model="ensemble", output="text_output")
    assert result.error is None
    assert all("\ufffd" not in piece for piece in texts(result))


def test_lora_inputs_reach_the_core_model(smollm2_server):
    prompt = "<|im_start|>user\nTell me about the sea.<|im_end|>\n<|im_start|>assistant\n"
    base = run(smollm2_server.grpc_url, text_request(prompt, 24, False, exclude_input_in_output=np.array([[True]])),
               model="ensemble", output="text_output")
    upper = run(smollm2_server.grpc_url, text_request(prompt, 24, False, exclude_input_in_output=np.array([[True]]),
                                                      lora_task_id=np.array([[1]], np.uint64)),
                model="ensemble", output="text_output")
    base_text, upper_text = texts(base)[0], texts(upper)[0]
    letters = [c for c in upper_text if c.isalpha()]
    assert base_text != upper_text and sum(c.isupper() for c in letters) >= 0.9 * len(letters)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_beam_search_returns_each_beams_text(smollm2_server, smollm2_dir, model):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = "The three primary colors are"
    beams = {"beam_width": np.array([[3]], np.int32), "exclude_input_in_output": np.array([[True]]),
             "end_id": np.array([[2]], np.int32)}
    core = run(smollm2_server.grpc_url, {"input_ids": np.array([tokenizer(prompt)["input_ids"]], np.int32),
                                         "input_lengths": np.array([[len(tokenizer(prompt)["input_ids"])]], np.int32),
                                         "request_output_len": np.array([[10]], np.int32)} | beams)
    [ids] = core.chunks                                           # [1, 3, n], padded with the end id
    want = [tokenizer.decode([t for t in ids[0, b] if t != 2], skip_special_tokens=True) for b in range(3)]
    for stream in (False, True):
        result = run(smollm2_server.grpc_url, text_request(prompt, 10, stream, **beams), model=model,
                     output="text_output")
        assert result.error is None
        assert [t.decode() for t in result.chunks[-1].reshape(-1)] == want     # (streamed: each round's beams whole)


def test_unknown_adapter_error_reaches_the_text_client(smollm2_server):
    result = run(smollm2_server.grpc_url, text_request("Hi", 4, True, lora_task_id=np.array([[4242]], np.uint64)),
                 model="ensemble", output="text_output")
    assert result.error and "LoRA task 4242 not found in cache" in result.error


def test_a_cancelled_text_stream_stops_its_core_request(smollm2_server):
    """The client's cancel reaches lora_llm (as a `stop` from the ensemble): the core request ends cancelled,
    long before its 400 tokens, and its KV blocks and adapter pin return."""
    def count(status: str) -> float:
        return smollm2_server.metric("lora_llm_requests_total", status=status)
    before = {status: count(status) for status in ("cancelled", "success")}
    stream = Stream(smollm2_server.grpc_url).send(
        text_request("Tell me a very long story.", 400, True, lora_task_id=np.array([[1]], np.uint64),
                     min_length=np.array([[400]], np.int32)),
        model="ensemble")
    stream.wait_first()
    stream.close(cancel=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and count("cancelled") == before["cancelled"]:
        time.sleep(0.1)
    assert count("cancelled") == before["cancelled"] + 1 and count("success") == before["success"]
    assert smollm2_server.metric("lora_llm_kv_blocks", state="used") == 0
    assert smollm2_server.metric("lora_llm_lora_cache", tier="device", stat="pins") == 0
    assert "Paris" in "".join(texts(run(smollm2_server.grpc_url, text_request("The capital of France is", 12, True),
                                        model="ensemble", output="text_output")))
