"""GPTQ and AWQ checkpoints (integers packed in int32, a scale and a zero point per group of input channels): the
engine's greedy tokens equal transformers' on the model the checkpoint encodes, dequantized here from the test's
own integers (before its own packer packed them); adapters equal PEFT on that model; what is not read is refused by
name. 4-bit weights in groups of 32 or more input channels stay packed (kernels.quant.Int4Weight), in act order too
(their channels sorted by group, x read in that order) where the parts of a fused projection share their order, as
GPTQ's do (one input, one Hessian); 8 bits, groups of 16, fused parts in orders of their own and act-order shares of
a row-parallel projection are served dequantized."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from backend import LLMEngine
from kernels.quant import Int4Weight
from tests.backend.model.test_fp8_checkpoints import engine_for
from tests.backend.model.test_quantized import (PATHS, assert_adapters_match_peft, assert_tokens_match_transformers,
                                                assert_two_ranks_keep_and_answer_one_ranks_tokens)
from tests.helpers import ALL_MODULES

AWQ_NIBBLES = (0, 2, 4, 6, 1, 3, 5, 7)          # AutoAWQ: nibble i of a word holds column 8m + AWQ_NIBBLES[i]
LAYOUTS = {                                      # name -> (quantization_config, group size, symmetric, act order:
                                                 # None, "per weight" or "per input" (a fused projection's parts
                                                 # share theirs, as GPTQ's Hessian makes them))
    "gptq act order": ({"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True, "sym": False,
                        "checkpoint_format": "gptq"}, 16, False, "per weight"),
    "gptq act order by input": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                                 "sym": False, "checkpoint_format": "gptq"}, 32, False, "per input"),
    "gptq act orders apart": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                               "sym": False, "checkpoint_format": "gptq"}, 32, False, "per weight"),
    "gptq_v2 8-bit": ({"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": False, "sym": True,
                       "checkpoint_format": "gptq_v2"}, 32, True, None),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm"}, 16, False,
            None),
    "gptq 4-bit": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False,
                    "checkpoint_format": "gptq"}, 32, False, None),
    "awq groups of 64": ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
                         64, False, None),
}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
KEPT = {"gptq 4-bit": PROJECTIONS, "awq groups of 64": PROJECTIONS,   # served packed: 4 bits, groups of 32s, the
        "gptq act order by input": PROJECTIONS,                      # parts of a fused projection in one order
        "gptq act orders apart": ("o_proj", "down_proj")}
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def pack(values: np.ndarray, bits: int, nibble_order=None) -> torch.Tensor:
    """[rows, cols] unsigned values -> [rows, cols * bits / 32] int32, value i of each word in bits [bits * i, ...)
    (column nibble_order[i] of its run of 8 where given)."""
    per_word = 32 // bits
    runs = values.reshape(values.shape[0], -1, per_word).astype(np.uint64)
    if nibble_order is not None:
        runs = runs[:, :, list(nibble_order)]
    words = sum(runs[:, :, i] << np.uint64(bits * i) for i in range(per_word))
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def quantized(w: torch.Tensor, groups: torch.Tensor, bits: int, symmetric: bool):
    """w [out, in] -> (q [in, out], zeros [num_groups, out], scales [num_groups, out] fp16): each group of input
    channels (groups[k]) on a scale and zero point per output channel."""
    maxq, num_groups = 2 ** bits - 1, int(groups.max()) + 1
    q = np.zeros((w.shape[1], w.shape[0]), np.int64)
    zeros = np.zeros((num_groups, w.shape[0]), np.int64)
    scales = torch.zeros(num_groups, w.shape[0], dtype=torch.float16)
    for g in range(num_groups):
        cols = (groups == g).nonzero().flatten()
        part = w[:, cols].double()
        lo, hi = part.min(1).values.clamp(max=0), part.max(1).values.clamp(min=0)
        if symmetric:
            scale, zero = (2 * torch.maximum(-lo, hi) / maxq), torch.full_like(lo, (maxq + 1) // 2)
        else:
            scale = (hi - lo) / maxq
            zero = (-lo / torch.where(scale > 0, scale, 1)).round()
        scale = torch.where(scale > 0, scale, 1).half()
        scales[g] = scale
        q[cols.numpy()] = (part / scale.double()[:, None] + zero[:, None]).round().clamp(0, maxq).T.long().numpy()
        zeros[g] = zero.long().numpy()
    return q, zeros, scales


def int_checkpoint(model_dir: Path, out: Path, fp32_out: Path, layout: str) -> tuple[Path, Path]:
    """The model written in a GPTQ or AWQ layout by the test's own packer, and the fp32 model it encodes (each
    weight scales[group] * (q - zero), from the same integers)."""
    config, group_size, symmetric, act_order = LAYOUTS[layout]
    bits, method = config["bits"], config["quant_method"]
    for path in (out, fp32_out):
        shutil.copytree(model_dir, path)
    hf = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(hf | {"quantization_config": config}))
    generator = torch.Generator().manual_seed(3)
    orders = {}                                                          # input -> its act order
    for path in out.glob("*.safetensors"):
        tensors, encoded = load_file(path), load_file(fp32_out / path.name)
        for key in [k for k in tensors if k.endswith(tuple(f"{m}.weight" for m in ALL_MODULES))]:
            w, base = tensors.pop(key).float(), key.removesuffix("weight")
            in_dim = w.shape[1]
            module = key.split(".")[-2]
            input_of = key if act_order == "per weight" else \
                f"{key.rsplit('.', 2)[0]}.{SHARED_INPUT.get(module, module)}"        # a fused projection's input
            if input_of not in orders:
                orders[input_of] = torch.randperm(in_dim, generator=generator) if act_order else torch.arange(in_dim)
            order = orders[input_of]
            groups = torch.empty(in_dim, dtype=torch.long)
            groups[order] = torch.arange(in_dim) // group_size              # act order: groups by a permutation
            q, zeros, scales = quantized(w, groups, bits, symmetric)
            offset = int(config.get("checkpoint_format") == "gptq")         # GPTQ's first format stores zero - 1,
            stored = (zeros - offset) & (2 ** bits - 1)                     # so a zero of 0 reads as 2 ** bits,
            zeros = stored + offset                                          # as its own kernels read it
            encoded[key] = (scales.float()[groups] * torch.from_numpy(q - zeros[groups.numpy()]).float()).T.contiguous()
            if method == "gptq":
                tensors |= {base + "qweight": pack(q.T, bits).T.contiguous(), base + "qzeros": pack(stored, bits),
                            base + "scales": scales, base + "g_idx": groups.int()}
            else:
                tensors |= {base + "qweight": pack(q, 4, AWQ_NIBBLES), base + "qzeros": pack(zeros, 4, AWQ_NIBBLES),
                            base + "scales": scales}
        save_file(tensors, path, metadata={"format": "pt"})
        save_file(encoded, fp32_out / path.name, metadata={"format": "pt"})
    return out, fp32_out


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("int")
    return {layout: int_checkpoint(Path(tiny_model_dir), root / f"q{i}", root / f"fp32-{i}", layout)
            for i, layout in enumerate(LAYOUTS)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kernel_backend", PATHS)
def test_a_gptq_or_awq_checkpoint_matches_transformers_on_the_model_it_encodes(tiny_model_dir, checkpoints, layout,
                                                                               kernel_backend):
    packed_dir, fp32_dir = checkpoints[layout]
    tells = LAYOUTS[layout][0]["bits"] == 4                              # (8-bit rounding changes no token here)
    engine = engine_for(packed_dir, kernel_backend)
    projections = {name: w for name, w in engine.runner.model.w.items() if name.endswith("_proj")}
    assert projections and all(isinstance(w, Int4Weight) == name.endswith(KEPT.get(layout, ()))
                               for name, w in projections.items())
    if LAYOUTS[layout][3]:
        assert all(w.input_order is not None for w in projections.values() if isinstance(w, Int4Weight))
    assert_tokens_match_transformers(engine, fp32_dir, engine_for(tiny_model_dir, kernel_backend) if tells else None)


@pytest.mark.parametrize("layout", ["gptq 4-bit", "awq groups of 64"])
def test_a_packed_checkpoint_shares_its_groups_between_ranks(checkpoints, layout):
    """At two ranks each row-parallel share holds whole groups of the checkpoint's own integers; the tokens are
    one rank's."""
    assert_two_ranks_keep_and_answer_one_ranks_tokens(checkpoints[layout][0], "layers.1.down_proj", Int4Weight)


def test_an_act_order_checkpoint_splits_between_ranks(checkpoints):
    """At two ranks an act-order checkpoint's column-parallel shares stay packed in their order (its row-parallel
    ones are served dequantized: a share of x's channels is no run of groups); the tokens are one rank's."""
    packed_dir = checkpoints["gptq act order by input"][0]
    assert_two_ranks_keep_and_answer_one_ranks_tokens(packed_dir, "layers.1.gate_up_proj", Int4Weight)


@pytest.mark.parametrize("kernel_backend", PATHS)
def test_adapters_over_a_gptq_checkpoint_match_peft_on_the_model_it_encodes(checkpoints, tiny_adapters,
                                                                            kernel_backend):
    packed_dir, fp32_dir = checkpoints["gptq act order by input"]           # packed, x read in its order
    assert_adapters_match_peft(engine_for(packed_dir, kernel_backend), fp32_dir, tiny_adapters)


@pytest.mark.parametrize("change,says", [
    ({"bits": 3}, "gptq bits 3 is not read"),
    ({"checkpoint_format": "marlin"}, "gptq checkpoint_format 'marlin' is not read"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"awq bits, version, zero_point \(4, 'gemv', True\)"),
])
def test_a_packed_layout_not_read_is_refused_by_name(checkpoints, tmp_path, change, says):
    packed_dir, _ = checkpoints["gptq act order"]
    shutil.copytree(packed_dir, tmp_path / "edited")
    hf = json.loads((tmp_path / "edited" / "config.json").read_text())
    hf["quantization_config"] |= change
    (tmp_path / "edited" / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=says):
        LLMEngine(tmp_path / "edited", dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)
