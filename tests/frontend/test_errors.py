"""The core's errors, as the engine and the serving loop word them, answered with the status OpenAI clients expect."""
import pytest

from backend import LLMEngine, RequestError
from frontend.errors import from_core


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", max_queue_size=1,
                     kv_cache_memory_bytes=1 << 20)


def core_error(engine, **request) -> str:
    with pytest.raises(RequestError) as err:
        engine.add_request([5, 6, 7], **request)
    return str(err.value)


def test_a_full_queue_is_429(engine):
    engine.add_request([1, 2, 3], max_new_tokens=4)
    try:
        err = from_core(core_error(engine, max_new_tokens=4))
    finally:
        engine.abort(0)
    assert err.status == 429 and err.code == "rate_limit_exceeded"


@pytest.mark.parametrize("request_fields, param", [({"max_new_tokens": 0}, "max_tokens"),
                                                   ({"temperature": float("nan")}, "temperature"),
                                                   ({"min_tokens": -1}, "min_tokens")])
def test_field_errors_are_400_under_the_openai_name(engine, request_fields, param):
    err = from_core(core_error(engine, **request_fields))
    assert err.status == 400 and err.param == param and err.message.startswith(param + ": ")


def test_an_unavailable_engine_is_503_and_a_failed_step_500(engine):
    assert from_core("engine unavailable: engine failure: RuntimeError: boom (3 steps failed in a row)").status == 503
    assert from_core("engine failure: RuntimeError: injected fault at step 2").status == 500
    lost = from_core(core_error(engine, lora=424242))      # still "not found" after the weights were sent
    assert lost.status == 503 and lost.code == "adapter_unavailable"


@pytest.mark.parametrize("message", ["Stub process 'lora_llm_0_0' is not healthy.",
                                     "Request for unknown model: 'lora_llm' is not found",
                                     "Request for unknown model: 'lora_llm' version 1 is not ready",
                                     "engine unavailable: engine failure: RuntimeError: device lost"])
def test_tritonservers_words_for_an_unavailable_core_are_503_never_400(message):
    err = from_core(message)
    assert err.status == 503 and err.code == "service_unavailable"
