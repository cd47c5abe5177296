"""The device tier's slots: a loaded adapter lies where the LoRA ops read it, an adapter loaded over another leaves
the slot as if it had been loaded alone, and a packed adapter goes in with one copy per module."""
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backend.lora.format import LoraAdapter, module_columns, parse_lora
from backend.lora.shard import shard_adapter
from backend.lora.slots import BAND_OF_MODULE, DeviceSlots
from backend.model.checkpoint import ModelConfig
from kernels.lora.family import LoraFamily
from tests.backend.lora.test_lora_cache import make_adapter

MAX_RANK = 16


@pytest.fixture(scope="module")
def model_cfg(tiny_model_dir):
    return ModelConfig.from_dir(tiny_model_dir)


def adapter(cfg: ModelConfig, rank: int, seed: int, modules: tuple[int, ...]):
    return parse_lora(*map(torch.from_numpy, make_adapter(cfg, rank, seed, modules)), cfg, torch.float32, MAX_RANK,
                      1 << 40)


def state(slots: DeviceSlots, slot: int) -> list[torch.Tensor]:
    return [t[slot] for layer in slots.a + slots.b for t in layer.values()] + [slots.ranks[..., slot],
                                                                              slots.slot_bounds["qkv"][:, slot]]


FAMILIES = {"torch": LoraFamily.of("torch", "cpu"), "compiled": LoraFamily.of("cpu", "cpu"),
            "triton": LoraFamily.of("triton", "cuda")}         # A rank-major; neither; a fused qkv A stored once


@pytest.mark.parametrize("family", FAMILIES.values(), ids=FAMILIES)
def test_a_slot_reloaded_with_a_smaller_adapter_equals_one_loaded_alone(model_cfg, family):
    old = adapter(model_cfg, MAX_RANK, 0, (0, 4, 5, 6, 7))                 # fused qkv, every band at full rank
    new = adapter(model_cfg, 4, 1, (2, 6))                                  # fewer modules, a lower rank
    neighbour = adapter(model_cfg, 8, 2, (1, 4, 6))
    reused = DeviceSlots(model_cfg, 3, MAX_RANK, torch.float32, family=family)
    reused.load(0, neighbour)
    reused.load(1, old)
    reused.load(1, new)
    fresh = DeviceSlots(model_cfg, 3, MAX_RANK, torch.float32, family=family)
    fresh.load(0, neighbour)
    fresh.load(1, new)
    for slot in range(3):
        assert all(torch.equal(x, y) for x, y in zip(state(reused, slot), state(fresh, slot)))
    assert torch.equal(reused.host_ranks, fresh.host_ranks) and torch.equal(reused.fused, fresh.fused)
    assert any(t.abs().sum() > 0 for t in state(reused, 1)[:-1])           # the new adapter is there


def expected_slot(slots: DeviceSlots, adapter: LoraAdapter) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer and projection, (A [cap, in], B [out, cap]) of one slot placed by hand from the module docstring."""
    cfg, r = slots.cfg, slots.max_rank
    want = [{proj: (torch.zeros_like(slots.a[layer][proj][0]), torch.zeros_like(slots.b[layer][proj][0]))
             for proj in slots.a[layer]} for layer in range(cfg.num_layers)]
    for (layer, module_id), (a, b) in adapter.weights.items():
        parts = {1: b[:cfg.q_size], 2: b[cfg.q_size:cfg.q_size + cfg.kv_size], 3: b[cfg.q_size + cfg.kv_size:]} \
            if module_id == 0 and not slots.fused_a_once else {module_id: b}
        for module, b_part in parts.items():
            proj, band = BAND_OF_MODULE[module or 1]
            rank, (start, end) = a.shape[0], module_columns(cfg, module)   # module 0: every qkv column
            want[layer][proj][0][band * r:band * r + rank] = a
            want[layer][proj][1][start:end, band * r:band * r + rank] = b_part
    return want


def uneven(cfg: ModelConfig) -> LoraAdapter:
    """Separate tensors (not packed), ranks changing from layer to layer, a module missing in layer 0."""
    g = torch.Generator().manual_seed(3)
    weights = {}
    for layer in range(cfg.num_layers):
        for module_id, (in_dim, out_dim) in ((1, (cfg.hidden_size, cfg.q_size)), (6, (cfg.intermediate_size,
                                                                                        cfg.hidden_size))):
            if (layer, module_id) != (0, 6):
                rank = 2 + layer % 3
                weights[(layer, module_id)] = (torch.randn(rank, in_dim, generator=g),
                                               torch.randn(out_dim, rank, generator=g))
    return LoraAdapter(weights)


@pytest.mark.parametrize("family", FAMILIES.values(), ids=FAMILIES)
def test_each_adapter_lies_where_the_module_docstring_puts_it(model_cfg, family):
    adapters = [adapter(model_cfg, MAX_RANK, 0, (0, 4, 5, 6, 7)), adapter(model_cfg, 4, 1, (1, 2, 3, 4, 5, 6, 7)),
                uneven(model_cfg), shard_adapter(adapter(model_cfg, 8, 2, (0, 4, 6)), model_cfg, 2, 1)]
    for a in adapters:
        cfg = model_cfg.shard(2) if a is adapters[-1] else model_cfg
        slots = DeviceSlots(cfg, 2, MAX_RANK, torch.float32, family=family)
        slots.load(1, adapters[0] if a is not adapters[0] and cfg is model_cfg else a)   # something to replace
        slots.load(1, a)
        for layer, per_proj in enumerate(expected_slot(slots, a)):
            for proj, (want_a, want_b) in per_proj.items():
                assert torch.equal(slots.a[layer][proj][1], want_a), (layer, proj)
                assert torch.equal(slots.b[layer][proj][1], want_b), (layer, proj)
                assert not slots.a[layer][proj][0].any() and not slots.b[layer][proj][0].any()
        fused = family.fused_a_once and any(module == 0 for _, module in a.weights)
        qkv = slots.band_columns["qkv"]
        bounds = [0, qkv[-1][1], qkv[-1][1], qkv[-1][1]] if fused else [0, qkv[1][0], qkv[2][0], qkv[-1][1]]
        assert slots.slot_bounds["qkv"][:, 1].tolist() == [bounds] * cfg.num_layers
        assert not fused or slots.ranks[:, 0, 1:, 1].sum() == 0                 # the k and v bands unused


class CountCopies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.num_copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.num_copies += func is torch.ops.aten.copy_.default
        return func(*args, **(kwargs or {}))


def test_a_packed_adapter_goes_in_with_one_copy_per_module_whatever_the_number_of_layers(model_cfg):
    assert model_cfg.num_layers > 1
    every_module = adapter(model_cfg, 8, 0, (1, 2, 3, 4, 5, 6, 7))
    slots = DeviceSlots(model_cfg, 1, MAX_RANK, torch.float32)
    with CountCopies() as counted:
        slots.load(0, every_module)
    assert counted.num_copies == 2 * 7 + 3               # A and B per module, then its ranks, DoRA and fused flags


@pytest.mark.parametrize("moe_layers,shared_expert,mlp_rows", [((True, True), False, False),
                                                                ((False, True), False, True),
                                                                ((True, True), True, True)],
                         ids=["every layer a mixture", "a dense layer", "a shared expert"])
def test_a_mixture_with_no_dense_mlp_keeps_no_mlp_rows(model_cfg, moe_layers, shared_expert, mlp_rows):
    """Mixtral's and Qwen3-30B-A3B's slots hold no gate_up and down rank rows (modules 5-7 are refused there); a
    dense layer or a shared expert keeps them. Attention adapters load as before."""
    cfg = replace(model_cfg, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, moe_layers=moe_layers,
                  shared_expert=shared_expert)
    slots, dense = DeviceSlots(cfg, 2, MAX_RANK, torch.float32), DeviceSlots(model_cfg, 2, MAX_RANK, torch.float32)
    mlp_bytes = sum(dense.a_stacks[proj][:, 0].nbytes + dense.b_stacks[proj][:, 0].nbytes for proj in ("gate_up",
                                                                                                       "down"))
    assert slots.num_bytes_per_slot == (dense.num_bytes_per_slot - (0 if mlp_rows else mlp_bytes)
                                        + slots.experts.num_bytes_per_slot)
    assert slots.adapts == (("qkv", "o", "gate_up", "down") if mlp_rows else ("qkv", "o"))
    attention = adapter(model_cfg, 8, 3, (1, 2, 3, 4))
    slots.load(1, attention)
    dense.load(1, attention)
    for proj in ("qkv", "o"):
        assert torch.equal(slots.a_stacks[proj], dense.a_stacks[proj])
        assert torch.equal(slots.b_stacks[proj], dense.b_stacks[proj])
