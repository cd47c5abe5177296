"""The device tier's slots: an adapter loaded over another leaves the slot as if it had been loaded alone."""
import pytest
import torch

from backend.lora.format import parse_lora
from backend.lora.slots import DeviceSlots
from backend.model.config import ModelConfig
from tests.backend.test_lora_cache import make_adapter

MAX_RANK = 16


@pytest.fixture(scope="module")
def model_cfg(tiny_model_dir):
    return ModelConfig.from_dir(tiny_model_dir)


def adapter(cfg: ModelConfig, rank: int, seed: int, modules: tuple[int, ...]):
    return parse_lora(*map(torch.from_numpy, make_adapter(cfg, rank, seed, modules)), cfg, torch.float32, MAX_RANK,
                      1 << 40)


def state(slots: DeviceSlots, slot: int) -> list[torch.Tensor]:
    return [t[slot] for layer in slots.a + slots.b for t in layer.values()] + [slots.ranks[..., slot]]


@pytest.mark.parametrize("rank_major_a", [True, False])
def test_a_slot_reloaded_with_a_smaller_adapter_equals_one_loaded_alone(model_cfg, rank_major_a):
    old = adapter(model_cfg, MAX_RANK, 0, (0, 4, 5, 6, 7))                 # fused qkv, every band at full rank
    new = adapter(model_cfg, 4, 1, (2, 6))                                  # fewer modules, a lower rank
    neighbour = adapter(model_cfg, 8, 2, (1, 4, 6))
    reused = DeviceSlots(model_cfg, 3, MAX_RANK, torch.float32, rank_major_a=rank_major_a)
    reused.load(0, neighbour)
    reused.load(1, old)
    reused.load(1, new)
    fresh = DeviceSlots(model_cfg, 3, MAX_RANK, torch.float32, rank_major_a=rank_major_a)
    fresh.load(0, neighbour)
    fresh.load(1, new)
    for slot in range(3):
        assert all(torch.equal(x, y) for x, y in zip(state(reused, slot), state(fresh, slot)))
    assert reused.ranks_list == fresh.ranks_list
    assert any(t.abs().sum() > 0 for t in state(reused, 1)[:-1])           # the new adapter is there
