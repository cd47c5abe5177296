"""Request intake: a request checked against the engine's limits before any work that grows with its size (each error
names its field), its adapter cached, its grammar compiled, and its sequences made, for the engine to queue."""
from dataclasses import fields
from typing import Callable

from backend.config import EngineConfig
from backend.core.beams import BeamSearch
from backend.core.kv_cache import BlockManager
from backend.core.request import RequestError, RequestLimits, SamplingParams, Sequence, validate_prompt
from backend.lora.cache import LoraCache
from backend.lora.request import LoraRequest
from backend.model.checkpoint import ModelConfig

SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
MAX_CONTEXT_LOGITS_BYTES = 256 << 20          # one request's prompt logits, held until its first token
MAX_BATCH_ROWS = 256                          # rows of one client request (Triton's max_batch_size is lower)


class RequestIntake:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, blocks: BlockManager, lora_cache: LoraCache):
        self.model_config = model_config
        self.blocks = blocks
        self.lora_cache = lora_cache
        max_input_len = model_config.max_position_embeddings - 1
        self.limits = RequestLimits(max_input_len, config.max_words, config.max_word_len,
                                    max_input_values=max(MAX_BATCH_ROWS * max_input_len,
                                                         config.lora.host_memory_bytes // 2),
                                    max_top_log_probs=config.max_top_log_probs,
                                    max_log_probs=config.max_log_probs_per_request,
                                    max_beam_width=min(config.max_beam_width, config.max_num_seqs))
        self.guided, self.guided_off = None, "set the model parameter guided_decoding_backend to xgrammar"
        if config.guided_decoding_backend == "xgrammar":
            tokenizer_dir = config.tokenizer_dir or config.model_dir
            try:
                from backend.guided.decoding import GuidedDecoding
                self.guided = GuidedDecoding(tokenizer_dir, model_config.vocab_size,
                                             config.guided_decoding_compile_timeout_s,
                                             config.guided_decoding_compile_memory_bytes)
            except ModuleNotFoundError as err:
                self.guided_off = f"install {err.name} (guided_decoding_backend xgrammar needs it)"
            except (OSError, ValueError) as err:      # a token-ids-only deployment: no tokenizer, no grammars
                self.guided_off = f"no tokenizer in {tokenizer_dir} ({type(err).__name__})"

    def check(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as ints, once it and the sampling parameters fit the model, the limits and the KV cache."""
        cfg = self.model_config
        if len(prompt_ids) > self.limits.max_input_len:
            raise RequestError("input_ids", f"{len(prompt_ids)} tokens exceed the model's max input length "
                                            f"{self.limits.max_input_len}")
        params.validate(cfg.vocab_size, self.limits)
        prompt_ids = [int(t) for t in prompt_ids]
        validate_prompt(prompt_ids, params.max_new_tokens, cfg.vocab_size, cfg.max_position_embeddings)
        if params.return_context_logits and len(prompt_ids) * cfg.vocab_size * 4 > MAX_CONTEXT_LOGITS_BYTES:
            raise RequestError("return_context_logits",
                               f"{len(prompt_ids)} prompt tokens x vocabulary {cfg.vocab_size} logits exceed "
                               f"{MAX_CONTEXT_LOGITS_BYTES >> 20} MiB")
        num_log_probs = params.num_log_probs(len(prompt_ids))
        if num_log_probs > self.limits.max_log_probs:
            field_name = "num_top_log_probs" if params.top_log_probs else (
                "return_prompt_log_probs" if params.return_prompt_log_probs else "return_log_probs")
            raise RequestError(field_name, f"{num_log_probs} log probs ((k + 1) x tokens x "
                                           f"sequences) exceed the model's max_log_probs_per_request "
                                           f"{self.limits.max_log_probs}")
        size, width = self.blocks.block_size, params.beam_width
        needed = -(-(len(prompt_ids) + params.max_new_tokens) // size)
        if width > 1:                                  # the prompt's full blocks once, the rest by beam
            needed = len(prompt_ids) // size + width * (needed - len(prompt_ids) // size)
        if needed > self.blocks.num_blocks:
            raise RequestError("request_output_len", f"prompt + output need {needed} KV blocks"
                                                     f"{f' ({width} beams)' if width > 1 else ''}, "
                                                     f"the cache holds {self.blocks.num_blocks}")
        return prompt_ids

    def sequences(self, request_id, prompt_ids: list[int], params: SamplingParams,
                  lora: LoraRequest | None) -> list[Sequence]:
        """A checked request's sequences (one per num_return_sequences), its adapter cached and referenced by each,
        its grammar compiled."""
        lora_task_id = None if lora is None else lora.task_id
        if lora is not None and lora.sent:
            self.lora_cache.insert(lora.task_id, lora.adapter or self.lora_cache.parse(lora.weights, lora.config))
        if params.guide_type is not None:
            params.grammar = params.grammar or self.compile_guide(params)
        for _ in range(params.num_sequences):
            self.lora_cache.ref(lora_task_id)                # raises for an adapter the cache lacks
        if lora is not None and lora.name:
            self.lora_cache.names[lora.task_id] = lora.name
        adapter_key = self.lora_cache.key(lora_task_id)
        members = [Sequence(request_id, prompt_ids, params, lora_task_id, sequence_index=i, adapter_key=adapter_key)
                   for i in range(params.num_sequences)]
        if params.beam_width > 1:
            search = BeamSearch(members)
            for seq in members:
                seq.beams = search
        if params.grammar is not None:
            for seq in members:
                seq.matcher = self.guided.matcher(params.grammar)
        return members

    def close(self) -> None:
        """Stop the grammar compile workers, if guided decoding started them."""
        if self.guided is not None:
            self.guided.workers.close()

    def compile_guide(self, params: SamplingParams, cancelled: Callable[[], bool] = lambda: False):
        """The request's grammar, compiled (thread-safe: servers call it off the engine loop)."""
        if self.guided is None:
            raise RequestError("guided_decoding_guide_type", f"guided decoding is off: {self.guided_off}")
        return self.guided.compile(params.guide_type, params.guide, cancelled)
