"""Every malformed adapter is refused with an error naming what is wrong; the next valid request succeeds."""
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from backend import LLMEngine, LoraRequest, RequestError
from backend.lora.peft import peft_to_trtllm
from tests.backend.lora.test_lora_cache import make_adapter


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20,
                     max_lora_rank=16, lora_cache_max_adapter_size=50_000)


def good(engine):
    return make_adapter(engine.model_config, 4, 0)


def case_tensor_rank(w, c):
    return w[None, None], c


def case_row_mismatch(w, c):
    return w[:-1], c


def case_config_width(w, c):
    return w, c[:, :2]


def case_unknown_module(w, c):
    c[0, 0] = 42
    return w, c


def case_cross_attention(w, c):
    c[0, 0] = 9
    return w, c


def case_layer_range(w, c):
    c[0, 1] = 2
    return w, c


def case_duplicate(w, c):
    c[1] = c[0]
    return w, c


def case_rank_zero(w, c):
    c[0, 2] = 0
    return w, c


def case_rank_too_big(w, c):
    c[0, 2] = 17
    return w, c


def case_short_row(w, c):
    return w[:, :100], c


def case_not_finite(w, c):
    w[2, 3] = np.nan
    return w, c


def case_too_large(w, c):
    c[:, 2] = 16                                   # rank 16 on q, o, down of 2 layers: 57344 bytes > 50000
    return np.zeros((len(c), 16 * 128 + 64 * 16), dtype=np.float32), c


def case_no_rows(w, c):
    return w[:0], c[:0]


def case_too_wide(w, c):
    return np.zeros((len(c), 1_000_000), dtype=np.float32), c   # wider than any module at max_lora_rank 16


def case_float_config(w, c):
    return w, c.astype(np.float32)


def case_qkv_mixed_with_q(w, c):
    c[0, 0], c[1, 0], c[1, 1] = 0, 1, c[0, 1]
    return w, c


CASES = [
    (case_tensor_rank, "lora_weights", "must be [N, D*Hi + Ho*D]"),
    (case_row_mismatch, "lora_config", "has 6 rows but lora_weights has 5"),
    (case_config_width, "lora_config", "must be [N, 3]"),
    (case_unknown_module, "lora_config", "unknown module id 42"),
    (case_cross_attention, "lora_config", "module 9 (cross_attn_q) is unsupported"),
    (case_layer_range, "lora_config", "layer 2 out of range [0, 2)"),
    (case_duplicate, "lora_config", "duplicate module 1 for layer 0"),
    (case_rank_zero, "lora_config", "rank 0 must be in [1, max_lora_rank 16]"),
    (case_rank_too_big, "lora_config", "rank 17 must be in [1, max_lora_rank 16]"),
    (case_short_row, "lora_weights", "row 0 has 100 values"),
    (case_not_finite, "lora_weights", "NaN or Inf"),
    (case_too_large, "lora_weights", "exceeds lora_cache_max_adapter_size 50000"),
    (case_float_config, "lora_config", "dtype must be INT32"),
    (case_no_rows, "lora_config", "has no rows"),
    (case_too_wide, "lora_weights", "rows of 1000000 values exceed the widest module's max_lora_rank 16"),
    (case_qkv_mixed_with_q, "lora_config", "both attn_qkv (0) and attn_q/k/v (1-3)"),
]


@pytest.mark.parametrize("case,field,text", CASES, ids=[c[0].__name__[5:] for c in CASES])
def test_bad_adapter_is_refused_then_a_valid_request_succeeds(engine, case, field, text):
    weights_ok, config_ok = good(engine)
    weights, config = case(weights_ok.copy(), config_ok.copy())
    task_id = 100 + CASES.index((case, field, text))
    with pytest.raises(RequestError) as err:
        engine.add_request([5, 6, 7], lora=LoraRequest.of(task_id, weights, config))
    assert err.value.field == field and text in err.value.message, err.value.message
    assert not engine.lora_cache.contains(task_id)
    engine.add_request([5, 6, 7], lora=LoraRequest.of(1, weights_ok, config_ok), max_new_tokens=3)
    produced = []
    while engine.has_unfinished:
        for out in engine.step():
            assert out.error is None
            produced += out.new_token_ids
    assert len(produced) == 3


def test_weights_without_config_or_task_id_are_refused_by_name():
    weights, config = np.zeros((1, 2, 8), np.float16), np.zeros((1, 2, 3), np.int32)
    for args, field in (((3, weights, None), "lora_config"), ((3, None, config), "lora_weights"),
                        ((None, weights, config), "lora_task_id")):
        with pytest.raises(RequestError, match="must be") as err:
            LoraRequest.of(*args)
        assert err.value.field == field


def test_a_task_id_given_as_a_numpy_integer_names_the_same_adapter(engine):
    weights, config = good(engine)
    engine.add_lora(41, weights, config)
    request_id = engine.add_request([5, 6, 7], lora=np.int64(41), max_new_tokens=2)
    assert [seq.lora_task_id for seq in engine.seqs.get(request_id)] == [41]
    while engine.has_unfinished:
        assert all(out.error is None for out in engine.step())


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "int8"])
def test_a_quantized_peft_adapter_is_refused_naming_its_tensor_and_the_dtypes_read(tiny_adapters, tmp_path, dtype):
    shutil.copytree(tiny_adapters[0], tmp_path / "quantized")
    path = tmp_path / "quantized" / "adapter_model.safetensors"
    tensors = load_file(path)
    key = sorted(tensors)[0]
    save_file(tensors | {key: tensors[key].to(getattr(torch, dtype))}, path)
    with pytest.raises(ValueError, match=f"adapter tensor {key} is {dtype}; adapters are read in float16, bfloat16 or "
                                         "float32"):
        peft_to_trtllm(tmp_path / "quantized")
