"""An OpenAI request's sampling as the core model's inputs (TensorRT-LLM's tensors), checked against the model."""
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from frontend.errors import bad_request
from frontend.responses import LogProbsAsked
from frontend.schemas import ChatCompletionRequest, CompletionRequest, SamplingRequest

MAX_STOP_TOKENS = 64                          # the core's max_word_len
GUIDE_FIELDS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice", "structured_outputs")


@dataclass(frozen=True)
class ModelInfo:
    """What the frontend knows of the served base model: its name, tokenizer and limits."""
    name: str
    tokenizer: object
    vocab_size: int
    max_context: int                          # prompt + output tokens (max_position_embeddings)
    end_ids: tuple[int, ...]                  # the model's end-of-sequence tokens
    max_token_chars: int = 64                 # the longest token's text: a prompt past max_context x this cannot fit

    @property
    def max_prompt_chars(self) -> int:
        return self.max_context * self.max_token_chars

    @classmethod
    def from_dir(cls, model_dir: str | Path, name: str | None = None) -> "ModelInfo":
        from backend.text import tokenizer_from_dir
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        generation = model_dir / "generation_config.json"
        eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
        eos = eos if eos is not None else config.get("eos_token_id")
        tokenizer = tokenizer_from_dir(model_dir)
        eos = eos if eos is not None else tokenizer.eos_token_id
        end_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        longest = max(map(len, tokenizer.get_vocab()))          # a token's text is at most as long as its string
        return cls(name or model_dir.name, tokenizer, config["vocab_size"], config["max_position_embeddings"],
                   end_ids, longest)


def check_supported(req: SamplingRequest) -> None:
    """Refuse, by name, what the engine cannot do rather than answer something else."""
    if req.best_of not in (None, 1, req.n):
        raise bad_request("best_of", f"must be 1 or n ({req.n}): choices are not ranked, got {req.best_of}")
    if req.response_format and req.response_format.type == "json_schema" and not req.response_format.json_schema:
        raise bad_request("response_format", "type json_schema needs json_schema.schema")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options", "is only allowed when stream is true")
    asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if asked is not None and req.min_tokens > asked:
        raise bad_request("min_tokens", f"{req.min_tokens} exceeds max_tokens {asked}")
    guides = [name for name in GUIDE_FIELDS if getattr(req, name) is not None]
    if req.response_format and req.response_format.type != "text":
        guides.insert(0, "response_format")
    if len(guides) > 1:
        raise bad_request(guides[1], f"one guide per request: {guides[0]} is already set")
    outputs = req.structured_outputs
    if outputs is not None and sum(v is not None and v is not False for v in outputs.model_dump().values()) != 1:
        raise bad_request("structured_outputs", "must set exactly one of json, regex, grammar, choice, json_object")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix", "is not supported (no fill-in-the-middle)")
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens", "0 (the prompt scored, nothing generated) needs echo true")
    if isinstance(req, ChatCompletionRequest):
        if req.continue_final_message and req.add_generation_prompt:
            raise bad_request("continue_final_message", "needs add_generation_prompt false")
        if req.tools or req.tool_choice not in (None, "none"):
            raise bad_request("tools", "tool calling is not supported")
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs", "needs logprobs true")
        if req.max_tokens == 0:
            raise bad_request("max_tokens", "must be >= 1 (0 only scores a prompt: completions with echo)")
    if req.use_beam_search:
        check_beams(req)
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs", "is not available when stream is true")


def check_beams(req: SamplingRequest) -> None:
    """Beam search (vLLM's use_beam_search): n beams, ranked by log prob; what it cannot combine with is refused."""
    if (req.top_p or 1.0) < 1.0 or (req.top_k or 0) > 0 or req.min_p or req.seed is not None:
        raise bad_request("use_beam_search", "beams are ranked by log prob, not sampled: top_p, top_k, min_p and "
                                             "seed must be unset")
    if req.logprobs not in (None, False) or getattr(req, "top_logprobs", None) or req.prompt_logprobs is not None or \
            getattr(req, "echo", False):
        raise bad_request("use_beam_search", "log probs and echo are not available with beam search")
    if guide(req) is not None:
        raise bad_request("use_beam_search", "guided decoding is not available with beam search")


def log_probs_asked(req: SamplingRequest, chat: bool) -> LogProbsAsked:
    """The log probs a request asks for, in the core's terms."""
    if chat:
        return LogProbsAsked(req.logprobs, req.top_logprobs or 0, prompt_top=req.prompt_logprobs)
    return LogProbsAsked(req.logprobs is not None, req.logprobs or 0, req.echo, req.prompt_logprobs)


def max_tokens(req: SamplingRequest, num_prompt_tokens: int, info: ModelInfo, default: int | None) -> int:
    """The output budget: as asked (max_completion_tokens, max_tokens), else `default`, else what the context
    leaves; a request that cannot fit is refused naming max_tokens."""
    asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if req.max_tokens == 0:
        return 0                                  # echo only (check_supported): the prompt scored
    room = info.max_context - num_prompt_tokens
    if room < 1:
        raise bad_request("prompt" if isinstance(req, CompletionRequest) else "messages",
                          f"{num_prompt_tokens} tokens leave no room in the model's context of {info.max_context}")
    if asked is not None and asked > room:
        raise bad_request("max_tokens", f"prompt ({num_prompt_tokens}) + max_tokens ({asked}) exceed the model's "
                                        f"context of {info.max_context} tokens")
    return asked or min(default or room, room)


def core_arrays(req: SamplingRequest, prompt_ids: list[int], num_tokens: int, info: ModelInfo,
                asked: LogProbsAsked) -> dict[str, np.ndarray]:
    """The core model's inputs, shaped as TensorRT-LLM clients shape them ([1, L], [1, 1], [1, 2, L]). A prompt
    only scored (num_tokens 0) still samples one token, which the choice drops."""
    def scalar(value, dtype) -> np.ndarray:
        return np.array([[value]], dtype=dtype)

    arrays = {"input_ids": np.array([prompt_ids], np.int32), "input_lengths": scalar(len(prompt_ids), np.int32),
              "request_output_len": scalar(max(num_tokens, 1), np.int32), "streaming": scalar(True, np.bool_),
              "num_return_sequences": scalar(req.n, np.int32)}
    if req.use_beam_search:                          # the n best beams, all at the end (beams change until then)
        arrays |= {"beam_width": scalar(req.n, np.int32), "len_penalty": scalar(req.length_penalty, np.float32),
                   "early_stopping": scalar(req.early_stopping, np.bool_), "streaming": scalar(False, np.bool_),
                   "exclude_input_in_output": scalar(True, np.bool_)}
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature > 0 and not req.use_beam_search:  # the core samples when runtime_top_p > 0
        arrays |= {"temperature": scalar(temperature, np.float32),
                   "runtime_top_p": scalar(req.top_p or 1.0, np.float32)}
        if req.top_k and req.top_k > 0:
            arrays["runtime_top_k"] = scalar(req.top_k, np.int32)
        if req.min_p:
            arrays["runtime_min_p"] = scalar(req.min_p, np.float32)
    if req.seed is not None:
        arrays["seed"] = scalar(req.seed % (1 << 64), np.uint64)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            arrays[name] = scalar(getattr(req, name), np.float32)
    if req.repetition_penalty is not None:
        arrays["repetition_penalty"] = scalar(req.repetition_penalty, np.float32)
    if req.min_tokens:
        arrays["min_tokens"] = scalar(req.min_tokens, np.int32)
    end_ids = () if req.ignore_eos else info.end_ids
    arrays["end_id"] = scalar(end_ids[0] if end_ids else -1, np.int32)
    words = [[t] for t in end_ids[1:]] + stop_tokens(req.stop, info)
    if words:
        arrays["stop_words_list"] = words_list(words)[None]
    if req.logit_bias:
        arrays["embedding_bias"] = logit_bias(req.logit_bias, info.vocab_size)[None]
    if asked.chosen:
        arrays["return_log_probs"] = scalar(True, np.bool_)
    if asked.num_top or asked.prompt_top:
        arrays["num_top_log_probs"] = scalar(max(asked.num_top, asked.prompt_top or 0), np.int32)
    if asked.scores_prompt:
        arrays["return_prompt_log_probs"] = scalar(True, np.bool_)
    guided = guide(req)
    if guided is not None:
        arrays["guided_decoding_guide_type"] = np.array([[guided[0].encode()]], dtype=np.object_)
        arrays["guided_decoding_guide"] = np.array([[guided[1].encode()]], dtype=np.object_)
    return arrays


def guide(req: SamplingRequest) -> tuple[str, str] | None:
    """The request's guide as the core's (guided_decoding_guide_type, guided_decoding_guide): OpenAI's
    response_format, or vLLM's guided_* fields and structured_outputs, each mapped onto the same guided decoding."""
    if req.response_format is not None and req.response_format.type != "text":
        if req.response_format.type == "json_object":
            return "json", ""
        return "json_schema", json.dumps(req.response_format.json_schema.schema_)
    outputs = req.structured_outputs
    if outputs is not None:
        if outputs.json_object:
            return "json", ""
        return guide_of(outputs.json_, outputs.regex, outputs.grammar, outputs.choice)
    return guide_of(req.guided_json, req.guided_regex, req.guided_grammar, req.guided_choice)


def guide_of(schema: dict | str | None, regex: str | None, grammar: str | None,
             choice: list[str] | None) -> tuple[str, str] | None:
    if schema is not None:
        return "json_schema", schema if isinstance(schema, str) else json.dumps(schema)
    if regex is not None:
        return "regex", regex
    if grammar is not None:
        return "ebnf_grammar", grammar
    if choice is not None:                       # exactly one of the strings: a grammar of literal alternatives
        return "ebnf_grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)
    return None


def stop_tokens(stop: list[str], info: ModelInfo) -> list[list[int]]:
    """Each stop string's tokens, so that the core ends a sequence as soon as it writes one the usual way; the
    frontend still finds stop strings in the text, however they were tokenized."""
    words = [info.tokenizer(s, add_special_tokens=False)["input_ids"] for s in stop]
    return [w for w in words if 0 < len(w) <= MAX_STOP_TOKENS]


def words_list(words: list[list[int]]) -> np.ndarray:
    """TensorRT-LLM's [2, L] words list: every word's ids back to back, then each word's end offset; -1 padded."""
    ids = [t for w in words for t in w]
    out = np.full((2, len(ids)), -1, dtype=np.int32)
    out[0] = ids
    out[1, :len(words)] = np.cumsum([len(w) for w in words])
    return out


def logit_bias(bias: dict[str, float], vocab_size: int) -> np.ndarray:
    out = np.zeros(vocab_size, dtype=np.float32)
    for key, value in bias.items():
        token = int(key)
        if not 0 <= token < vocab_size:
            raise bad_request("logit_bias", f"token id {token} is outside the vocabulary [0, {vocab_size})")
        out[token] = value
    return out
