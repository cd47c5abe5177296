"""OpenAI's error responses, and the core model's errors mapped onto them."""
import re

from client.grpc_client import NOT_FOUND

# tritonserver's own words for a core model that cannot take requests (its stub dead, unloaded, not yet loaded)
UNAVAILABLE = re.compile(r"^Stub process '.*' is not healthy|^Request for unknown model|is not ready$|"
                         r"^Failed to process the request\(s\) for model instance")

# the core's input names (TensorRT-LLM's) -> the OpenAI parameter a client set
CORE_FIELDS = {"input_ids": "prompt", "input_lengths": "prompt", "request_output_len": "max_tokens",
               "temperature": "temperature", "runtime_top_p": "top_p", "runtime_top_k": "top_k", "seed": "seed",
               "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
               "repetition_penalty": "repetition_penalty", "embedding_bias": "logit_bias",
               "num_return_sequences": "n", "min_tokens": "min_tokens", "stop_words_list": "stop",
               "end_id": "model", "guided_decoding_guide_type": "response_format",
               "guided_decoding_guide": "response_format", "lora_task_id": "model", "lora_weights": "model",
               "lora_config": "model"}


class OpenAIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def bad_request(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param)


def from_core(message: str) -> OpenAIError:
    """The core's error text (`field: message`, or the server's own) as the OpenAI error a client expects."""
    if "queue full" in message or "retry later" in message:
        return OpenAIError(429, message, "RateLimitError", code="rate_limit_exceeded")
    if message.startswith("engine unavailable") or UNAVAILABLE.search(message):
        return OpenAIError(503, message, "ServiceUnavailableError", code="service_unavailable")
    if NOT_FOUND in message:
        return OpenAIError(503, message, "ServiceUnavailableError", code="adapter_unavailable")
    field, _, rest = message.partition(": ")
    if field in CORE_FIELDS and rest:
        return OpenAIError(400, f"{CORE_FIELDS[field]}: {rest}", param=CORE_FIELDS[field])
    if message.startswith("engine failure"):
        return OpenAIError(500, message, "InternalServerError", code="engine_failure")
    return OpenAIError(400, message)
