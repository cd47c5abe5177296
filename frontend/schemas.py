"""The OpenAI request bodies we accept (pydantic, so a bad field is named in a 400), and their core inputs.

Parameters the engine lacks are refused by name rather than ignored: a client that asks for tools, suffixes
or a chat template of its own gets an error, not a silently different answer. So is any field we do not know. The
fields OpenAI's own clients send that change nothing here (`user`, `metadata`, ...) are accepted as what they are.
"""
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 64                                    # the core's num_return_sequences limit
MAX_STOP = 16                                 # stop strings per request
MAX_STOP_CHARS = 256
INT32_MAX = (1 << 31) - 1                     # the core's INT32 inputs: max_tokens, top_k, min_tokens
MAX_CHOICES = 256                             # guided_choice alternatives
MAX_MESSAGES = 1024                           # chat messages in one request
MAX_LOGIT_BIAS = 1024                         # logit_bias entries (OpenAI takes 300)
MAX_LOGPROBS = 20                             # top alternatives (OpenAI's and vLLM's max_logprobs; the core's default)
TOKEN_ID = re.compile(r"-?[0-9]{1,10}")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


class JsonSchema(Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(Strict):
    """vLLM's structured_outputs: one of a JSON schema, a regex, a grammar (EBNF) or a list of choices."""
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    json_object: bool | None = None


class SamplingRequest(Strict):
    """What completions and chat completions share."""
    model: str
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX)      # 0: completions with echo score the prompt
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)    # vLLM's extension: -1 or 0 for no limit
    min_p: float | None = Field(None, ge=0.0, le=1.0)       # vLLM's extension: sampled tokens only
    seed: int | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)   # a list once validated
    n: int = Field(1, ge=1, le=MAX_N)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)     # vLLM's extension
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)   # vLLM's extension
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False                                # vLLM's extension: outputs of exactly max_tokens
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)          # vLLM's extension
    response_format: ResponseFormat | None = None
    best_of: int | None = None
    guided_json: dict | str | None = None                   # vLLM's guided decoding (older names)
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    structured_outputs: StructuredOutputs | None = None
    use_beam_search: bool = False                           # vLLM's extension: n beams, the n best returned
    length_penalty: float = Field(1.0, allow_inf_nan=False)  # with beam search: score = cum log prob / len ** this
    early_stopping: bool = False                            # with beam search: stop once n beams have ended
    # sent by OpenAI's clients; nothing here depends on them
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: Literal[False] | None = None                     # stored completions are not kept
    service_tier: Literal["auto", "default"] | None = None

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
            if not TOKEN_ID.fullmatch(key):
                raise ValueError(f"keys must be token ids (ASCII digits, at most 10), got {key[:32]!r}")
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
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict] | None = Field(None, max_length=0)   # tools are not supported: only an empty list
    refusal: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None                 # only with tools, which are refused
    add_generation_prompt: bool = True                      # vLLM's extension
    continue_final_message: bool = False                    # vLLM's extension: the last message goes on


class LoadAdapterRequest(Strict):
    lora_name: str
    lora_path: str


class UnloadAdapterRequest(Strict):
    lora_name: str
    lora_int_id: int | None = None                          # vLLM's clients may send it; names are what we key by
