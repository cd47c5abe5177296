"""The inputs of TensorRT-LLM's `tensorrt_llm` model that belong to features this server lacks, and what each
accepts: its neutral value (the one that asks for nothing), refused otherwise with an error naming the input.

model_repository/lora_llm/config.pbtxt declares every input and output of that model (all optional but the
prompt and its length); tests/server/test_contract.py keeps the two lists together.
"""
import numpy as np

from backend.core.request import RequestError

EMPTY = ()                                # neutral: absent or no elements

# input -> (the feature it belongs to, the values that ask for nothing (EMPTY: none at all))
UNSUPPORTED: dict[str, tuple[str, tuple]] = {
    "draft_input_ids": ("speculative decoding with draft tokens", EMPTY),
    "draft_logits": ("speculative decoding with draft tokens", EMPTY),
    "prompt_embedding_table": ("prompt tables (p-tuning)", EMPTY),
    "prompt_table_extra_ids": ("prompt tables (p-tuning)", EMPTY),
    "decoder_input_ids": ("encoder-decoder models", EMPTY),
    "decoder_input_lengths": ("encoder-decoder models", EMPTY),
    "encoder_input_features": ("encoder-decoder models", EMPTY),
    "encoder_output_lengths": ("encoder-decoder models", EMPTY),
    "cross_attention_mask": ("encoder-decoder models", EMPTY),
    "skip_cross_attn_blocks": ("encoder-decoder models", EMPTY),
    "mrope_rotary_cos_sin": ("multimodal rotary embeddings (mrope)", EMPTY),
    "mrope_position_deltas": ("multimodal rotary embeddings (mrope)", EMPTY),
    "retention_token_range_starts": ("KV cache retention priorities", EMPTY),
    "retention_token_range_ends": ("KV cache retention priorities", EMPTY),
    "retention_token_range_priorities": ("KV cache retention priorities", EMPTY),
    "retention_token_range_durations_ms": ("KV cache retention priorities", EMPTY),
    "retention_decode_priority": ("KV cache retention priorities", (35,)),       # TensorRT-LLM's default
    "retention_decode_duration_ms": ("KV cache retention priorities", (-1,)),    # no duration
    "lookahead_window_size": ("lookahead decoding", EMPTY),
    "lookahead_ngram_size": ("lookahead decoding", EMPTY),
    "lookahead_verification_set_size": ("lookahead decoding", EMPTY),
    "context_phase_params": ("disaggregated serving", EMPTY),
}

# Read by TensorRT-LLM only for draft tokens or prompt tables: with no drafts or table it ignores them whatever their
# value, and so do we. (Beam search's len_penalty, early_stopping and beam_search_diversity_rate are read.)
IGNORED = ("draft_acceptance_threshold", "prompt_vocab_size", "pad_id")


# the same for the inputs only the text models (`ensemble`, `tensorrt_llm_bls`) declare
TEXT_UNSUPPORTED: dict[str, tuple[str, tuple]] = {
    "num_draft_tokens": ("speculative decoding with a draft model", (0,)),
    "use_draft_logits": ("speculative decoding with a draft model", (False,)),
    "decoder_text_input": ("encoder-decoder models", EMPTY),
}


def check_unsupported(row: dict[str, np.ndarray], table: dict[str, tuple[str, tuple]] = UNSUPPORTED) -> None:
    """Refuse, naming the input, any input of a feature we lack that asks for more than its neutral value."""
    for name, (feature, neutral) in table.items():
        if name not in row:
            continue
        value = np.asarray(row[name])
        if value.size == 0 or (neutral and all(v in neutral for v in value.reshape(-1).tolist())):
            continue
        accepted = "absent or empty" if neutral is EMPTY else " or ".join(map(str, neutral))
        raise RequestError(name, f"{feature} is not supported by this server; {name} must be {accepted}")
