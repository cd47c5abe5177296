"""A request's sampling parameters, its running state, and the validation that guards the engine."""
import math
import random
import time
from dataclasses import dataclass, field
from enum import Enum, auto

import numpy as np

MAX_RETURN_SEQUENCES = 64


class RequestError(ValueError):
    """Bad input for one request: names the field and what is wrong with it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


class FatalEngineError(RuntimeError):
    """Not a request's fault and not one step's: the engine cannot go on (a tensor-parallel worker died or hangs)."""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on one request, checked before any work that grows with its size."""
    max_input_len: int                        # prompt tokens
    max_words: int = 1024                     # stop words, and bad words, per request
    max_word_len: int = 64                    # tokens per word
    max_input_values: int = 1 << 28           # values of any one input tensor, as declared (an adapter's weights)
    max_top_log_probs: int = 20               # top alternatives at each token
    max_log_probs: int = 1 << 22              # log probs (chosen and top) one request may ask for
    max_beam_width: int = 1                   # beams of one request (the model's max_beam_width)


def check_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise RequestError(name, f"must be a finite number, got {value}")


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0                  # 0 means greedy
    top_k: int = 0                            # 0 means no limit
    top_p: float = 1.0
    min_p: float = 0.0                        # sampled rows keep tokens of at least min_p x the top token's probability
    seed: int | None = None
    end_id: int | None = None
    ignore_end_id: bool = False               # benchmarks force full-length outputs
    min_tokens: int = 0
    stop_words: list[list[int]] = field(default_factory=list)
    bad_words: list[list[int]] = field(default_factory=list)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    return_log_probs: bool = False            # each generated token's log prob
    top_log_probs: int = 0                    # and the k most likely tokens' ids and log probs at each position
    return_prompt_log_probs: bool = False     # each prompt token's log prob given those before it (with its top ones)
    return_generation_logits: bool = False    # each sampled token's [vocab] logits, as the model gave them
    return_context_logits: bool = False       # the prompt's [prompt_len, vocab] logits, with the first token
    beam_width: int = 1                       # > 1: beam search (backend/core/beams.py), deterministic: temperature,
                                              # top-k/p, min-p and seed do not apply
    length_penalty: float = 1.0               # beams ranked by cum log prob / length ** length_penalty
    early_stopping: bool | str = True         # True, False or "never" (transformers' meanings)
    diversity_rate: float = 0.0               # beam_search_diversity_rate: only 0
    num_return_sequences: int = 1             # samples of the prompt sharing its KV blocks; with beams, the best n
    top_p_min: float = 1e-6                   # top-p decay (TensorRT-LLM): after each token top_p becomes
    top_p_decay: float = 1.0                  # max(top_p * decay, top_p_min), and the initial top_p again
    top_p_reset_id: int | None = None         # when the token is top_p_reset_id
    embedding_bias: object | None = None      # [vocab] float32 added to the logits (numpy or torch)
    guide_type: str | None = None             # guided decoding: json, json_schema, regex, ebnf_grammar
    guide: str = ""
    grammar: object | None = None             # the guide compiled (guided/decoding.py), before the engine sees it

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def reads_prompt_logits(self) -> bool:
        """Its prompt's rows need their logits (context logits, prompt log probs): computed, never reused."""
        return self.return_context_logits or self.return_prompt_log_probs

    @property
    def any_log_probs(self) -> bool:
        """Its generated tokens need log probs: their own, or the top alternatives."""
        return self.return_log_probs or self.top_log_probs > 0

    def num_log_probs(self, num_prompt_tokens: int) -> int:
        """The log probs (chosen and top) the request asks for at most, over every sequence."""
        per_token = self.top_log_probs + 1
        prompt = (num_prompt_tokens - 1) * per_token if self.return_prompt_log_probs else 0
        generated = self.max_new_tokens * per_token * self.num_return_sequences if self.any_log_probs else 0
        return prompt + generated

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs: its beams, or its samples."""
        return self.beam_width if self.beam_width > 1 else self.num_return_sequences

    @property
    def num_candidates(self) -> int:
        """Most likely next tokens each row's step returns: a beam's 2 x beam_width, else the top alternatives."""
        return max(self.top_log_probs, 2 * self.beam_width if self.beam_width > 1 else 0)

    @property
    def reads_last_token(self) -> bool:
        """The next step's inputs depend on the last token: beams (chosen on the host), penalties, bad words, top-p
        decay."""
        return (self.beam_width > 1 or self.repetition_penalty != 1.0
                or bool(self.presence_penalty or self.frequency_penalty) or bool(self.bad_words)
                or self.top_p_decay != 1.0 or self.top_p_reset_id is not None)

    def validate(self, vocab_size: int, limits: RequestLimits | None = None) -> None:
        for name, value in (("temperature", self.temperature), ("runtime_top_p", self.top_p),
                            ("runtime_top_p_min", self.top_p_min), ("runtime_min_p", self.min_p),
                            ("runtime_top_p_decay", self.top_p_decay),
                            ("repetition_penalty", self.repetition_penalty),
                            ("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)):
            check_finite(name, value)
        if self.max_new_tokens <= 0:
            raise RequestError("request_output_len", f"must be > 0, got {self.max_new_tokens}")
        if self.beam_width != 1:
            self._validate_beams(vocab_size, limits)
        if not 1 <= self.num_return_sequences <= MAX_RETURN_SEQUENCES:
            raise RequestError("num_return_sequences", f"must be in [1, {MAX_RETURN_SEQUENCES}], got "
                                                       f"{self.num_return_sequences}")
        if not 0.0 < self.top_p_decay <= 1.0:
            raise RequestError("runtime_top_p_decay", f"must be in (0, 1], got {self.top_p_decay}")
        if not 0.0 < self.top_p_min <= 1.0:
            raise RequestError("runtime_top_p_min", f"must be in (0, 1], got {self.top_p_min}")
        if self.top_p_reset_id is not None and not 0 <= self.top_p_reset_id < vocab_size:
            raise RequestError("runtime_top_p_reset_ids", f"{self.top_p_reset_id} is outside the vocabulary "
                                                          f"[0, {vocab_size})")
        if self.embedding_bias is not None:
            if tuple(self.embedding_bias.shape) != (vocab_size,):
                raise RequestError("embedding_bias", f"must hold one value per vocabulary entry ({vocab_size}), "
                                                     f"got shape {list(self.embedding_bias.shape)}")
            if not bool(np.isfinite(np.asarray(self.embedding_bias)).all()):
                raise RequestError("embedding_bias", "must hold finite numbers")
        if self.temperature < 0:
            raise RequestError("temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError("runtime_top_k", f"must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError("runtime_min_p", f"must be in [0, 1], got {self.min_p}")
        max_top = limits.max_top_log_probs if limits is not None else vocab_size
        if not 0 <= self.top_log_probs <= min(max_top, vocab_size):
            raise RequestError("num_top_log_probs", f"must be in [0, {min(max_top, vocab_size)}] (the model's "
                                                    f"max_top_log_probs), got {self.top_log_probs}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError("runtime_top_p", f"must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise RequestError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise RequestError("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.end_id is not None and not 0 <= self.end_id < vocab_size:
            raise RequestError("end_id", f"{self.end_id} is outside the vocabulary [0, {vocab_size})")
        for name, words in (("stop_words_list", self.stop_words), ("bad_words_list", self.bad_words)):
            if limits is not None and len(words) > limits.max_words:
                raise RequestError(name, f"{len(words)} words exceed max_words {limits.max_words}")
            if limits is not None and any(len(word) > limits.max_word_len for word in words):
                raise RequestError(name, f"a word of {max(map(len, words))} tokens exceeds max_word_len "
                                         f"{limits.max_word_len}")
            for word in words:
                if not word or any(not 0 <= t < vocab_size for t in word):
                    raise RequestError(name, f"word {word} is empty or has ids outside [0, {vocab_size})")

    def _validate_beams(self, vocab_size: int, limits: RequestLimits | None) -> None:
        max_width = limits.max_beam_width if limits is not None else MAX_RETURN_SEQUENCES
        if not 1 <= self.beam_width <= max_width:
            raise RequestError("beam_width", f"{self.beam_width} is outside [1, {max_width}] (the model's "
                                             f"max_beam_width {max_width})")
        if 2 * self.beam_width > vocab_size:
            raise RequestError("beam_width", f"2 x {self.beam_width} exceeds the vocabulary ({vocab_size})")
        if not 1 <= self.num_return_sequences <= self.beam_width:
            raise RequestError("num_return_sequences", f"must be in [1, beam_width {self.beam_width}] with beam "
                                                       f"search, got {self.num_return_sequences}")
        check_finite("len_penalty", self.length_penalty)
        if self.early_stopping not in (True, False, "never"):
            raise RequestError("early_stopping", f"must be true, false or \"never\", got {self.early_stopping!r}")
        if self.diversity_rate != 0.0:
            raise RequestError("beam_search_diversity_rate", f"diverse beam search is not supported; must be 0, got "
                                                             f"{self.diversity_rate}")
        for name, asked in (("num_top_log_probs", self.top_log_probs > 0),
                            ("return_generation_logits", self.return_generation_logits),
                            ("return_context_logits", self.return_context_logits),
                            ("return_prompt_log_probs", self.return_prompt_log_probs),
                            ("guided_decoding_guide_type", self.guide_type is not None)):
            if asked:
                raise RequestError(name, f"is not supported with beam search (beam_width {self.beam_width})")


def stops(params: SamplingParams, output_ids: list[int]) -> bool:
    """These output tokens end a sequence by its end token or a stop word (once min_tokens are out)."""
    p, out = params, output_ids
    if len(out) < p.min_tokens:
        return False
    if p.end_id is not None and not p.ignore_end_id and out[-1] == p.end_id:
        return True
    return bool(p.stop_words) and any(out[-len(word):] == word for word in p.stop_words)


def validate_prompt(prompt_ids: list[int], max_new_tokens: int, vocab_size: int, max_positions: int) -> None:
    if len(prompt_ids) == 0:
        raise RequestError("input_ids", "prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError("input_ids", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(prompt_ids) + max_new_tokens > max_positions:
        raise RequestError(
            "request_output_len",
            f"prompt ({len(prompt_ids)}) + output ({max_new_tokens}) tokens exceed "
            f"max_position_embeddings {max_positions}")


def seed_key(seed: int) -> int:
    """A 64-bit seed mixed down to 31 bits (splitmix64's finalizer), for the sampler's counter-based draws."""
    z = seed & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFF


@dataclass(slots=True)
class SeqMetrics:
    """A request's timeline (ns since the epoch, as TensorRT-LLM reports them; 0: not yet) and its KV blocks."""
    arrival_time_ns: int = field(default_factory=time.time_ns)
    first_scheduled_time_ns: int = 0
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0
    num_new_blocks: int = 0                   # taken from the free pool
    num_reused_blocks: int = 0                # found in the cache, shared with another sequence

    def token_at(self, now: int) -> None:
        """A token came at `now` (the first one's time kept)."""
        self.last_token_time_ns = now
        if not self.first_token_time_ns:
            self.first_token_time_ns = now

    def copy(self) -> "SeqMetrics":
        """A copy (a step's output carries one; dataclasses.replace costs 4x as much, at every token)."""
        return SeqMetrics(self.arrival_time_ns, self.first_scheduled_time_ns, self.first_token_time_ns,
                          self.last_token_time_ns, self.num_new_blocks, self.num_reused_blocks)

    def __reduce__(self):
        """Pickled as its fields in order, as StepOutput is."""
        return SeqMetrics, tuple(getattr(self, name) for name in self.__slots__)


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    """One request in flight: its tokens, how many of them the KV cache holds, and its blocks."""
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    lora_task_id: int | None = None
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_log_probs: list[float] = field(default_factory=list)
    num_computed_tokens: int = 0              # tokens whose K/V are in the cache
    num_pending_tokens: int = 0               # sampled by a step still on the device: counted, not yet known
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    finish_reason: str | None = None
    sequence_index: int = 0                   # which of the request's num_return_sequences this is
    seed_key: int = 0                         # 31 bits of the request's seed (a random one if none was given)
    top_p: float = 1.0                        # this step's top_p (decays with runtime_top_p_decay)
    adapter_key: bytes = b""                  # the adapter (task id and version) in the names of its KV blocks
    block_digests: list[bytes] = field(default_factory=list)    # names of its full blocks, when reuse is on
    matcher: object | None = None             # its grammar's state, under guided decoding
    beams: object | None = None               # its request's BeamSearch (backend/core/beams.py), under beam search
    context_logits: dict[int, object] = field(default_factory=dict)   # prompt chunk start -> [n, vocab] (host)
    prompt_scores: dict[int, object] = field(default_factory=dict)    # prompt chunk start -> its scored rows (host
                                                                      # values [n, 2 + k], ids [n, k])
    metrics: SeqMetrics = field(default_factory=SeqMetrics)

    def __post_init__(self):
        seed = random.getrandbits(64) if self.params.seed is None else self.params.seed
        self.seed_key = seed_key(seed + (self.sequence_index << 32))
        self.top_p = self.params.top_p

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated, the pending ones counted."""
        return len(self.output_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def awaits_last_token(self) -> bool:
        """Its max_new_tokens are sampled, the last still on the device: nothing more to compute."""
        return self.num_output_tokens >= self.params.max_new_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def accept(self, token: int, log_prob: float, now: int) -> None:
        """A new token: appended (its log prob where asked), its time, the next top_p and the grammar's state."""
        self.output_ids.append(token)
        p = self.params
        self.metrics.token_at(now)
        if p.return_log_probs:
            self.output_log_probs.append(log_prob)
        if p.top_p_decay != 1.0 or p.top_p_reset_id is not None:
            self.top_p = p.top_p if token == p.top_p_reset_id else max(self.top_p * p.top_p_decay, p.top_p_min)
        if self.matcher is not None:
            self.matcher.accept_token(token)

    def stop_reason(self) -> str | None:
        """Why the sequence ends with its last token: "stop" (a complete guide, the end token or a stop word, once
        min_tokens are out), "length" (max_new_tokens), or None: it goes on."""
        p, out = self.params, self.output_ids
        if self.matcher is not None and self.matcher.is_terminated():
            return "stop"
        if stops(p, out):
            return "stop"
        return "length" if len(out) >= p.max_new_tokens else None
