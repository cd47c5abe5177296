"""The OpenAI request bodies we accept (pydantic, so a bad field is named in a 400), and their core inputs.

Parameters the engine lacks are refused by name rather than ignored: a client that asks for tools or top
alternatives gets an error, not a silently different answer. Unknown extra fields are ignored, as OpenAI's own
clients send some that change nothing here (`user`, `metadata`, `store`, ...).
"""
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 64                                    # the core's num_return_sequences limit
MAX_STOP = 16                                 # stop strings per request
MAX_STOP_CHARS = 256


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchema(BaseModel):
    name: str = "response"
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class SamplingRequest(BaseModel):
    """What completions and chat completions share."""
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)                  # vLLM's extension: -1 or 0 for no limit
    min_p: float | None = Field(None, ge=0.0, le=1.0)       # only 0: the engine has no min-p
    seed: int | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)   # a list once validated
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)   # vLLM's extension
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False                                # vLLM's extension: outputs of exactly max_tokens
    min_tokens: int = Field(0, ge=0)                        # vLLM's extension
    response_format: ResponseFormat | None = None
    best_of: int | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each stop string must hold 1-{MAX_STOP_CHARS} characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        for key, bias in (value or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {bias}")
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value):
        if value is not None and not -(1 << 63) <= value < (1 << 64):
            raise ValueError("must fit in 64 bits")
        return value


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list | None = None
    tool_choice: str | dict | None = None
    add_generation_prompt: bool = True                      # vLLM's extension


class LoadAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
