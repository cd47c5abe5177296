"""The two-tier adapter cache: LRU eviction, pinning, the not-found error, slot pressure, byte accounting."""
import numpy as np
import pytest

from backend import LLMEngine, RequestError
from backend.config import LoraCacheConfig
from backend.lora.cache import LoraCache
from backend.model.checkpoint import ModelConfig
from tests.helpers import random_prompts


def make_adapter(cfg: ModelConfig, rank: int, seed: int, modules=(1, 4, 6)) -> tuple[np.ndarray, np.ndarray]:
    """Random TRT-LLM tensors for every layer of the given modules."""
    from backend.lora.format import module_shape
    rng = np.random.default_rng(seed)
    rows, config = [], []
    for layer in range(cfg.num_layers):
        for module_id in modules:
            in_dim, out_dim = module_shape(cfg, module_id)
            rows.append(rng.normal(0, 0.3, rank * in_dim + out_dim * rank))
            config.append([module_id, layer, rank])
    width = max(len(r) for r in rows)
    weights = np.zeros((len(rows), width), dtype=np.float32)
    for i, row in enumerate(rows):
        weights[i, :len(row)] = row
    return weights, np.array(config, dtype=np.int32)


@pytest.fixture(scope="module")
def model_cfg(tiny_model_dir):
    return ModelConfig.from_dir(tiny_model_dir)


def adapter_bytes(cfg, rank) -> int:
    cache = LoraCache(LoraCacheConfig(max_loras=1), cfg, __import__("torch").float32)
    cache.add(0, *make_adapter(cfg, rank, 0))
    return cache.stats.host_bytes


def test_host_tier_evicts_the_least_recently_used_idle_adapter(model_cfg):
    import torch
    size = adapter_bytes(model_cfg, 4)
    cache = LoraCache(LoraCacheConfig(max_loras=2, host_memory_bytes=3 * size, max_adapter_bytes=3 * size), model_cfg,
                      torch.float32)
    for task in (1, 2, 3):
        cache.add(task, *make_adapter(model_cfg, 4, task))
    cache.ref(1)                                  # 1 is in use by a request: not evictable
    cache.add(2, *make_adapter(model_cfg, 4, 2))  # same weights again: accepted, and 2 becomes most recent
    cache.add(4, *make_adapter(model_cfg, 4, 4))
    assert list(cache.host) == [1, 2, 4] and cache.stats.host_evictions == 1      # 3 went
    cache.add(5, *make_adapter(model_cfg, 4, 5))
    assert list(cache.host) == [1, 4, 5]                                           # then 2
    assert cache.stats.host_bytes == 3 * size
    with pytest.raises(RequestError, match="already cached with different weights"):
        cache.add(5, *make_adapter(model_cfg, 4, 99))
    with pytest.raises(RequestError, match="exceeds lora_cache_max_adapter_size"):      # the host tier holds one
        cache.add(6, *make_adapter(model_cfg, 32, 6))


def test_device_tier_pins_adapters_in_use_and_evicts_lru(model_cfg):
    import torch
    cache = LoraCache(LoraCacheConfig(max_loras=2), model_cfg, torch.float32)
    for task in (1, 2, 3):
        cache.add(task, *make_adapter(model_cfg, 4, task))
    cache.acquire(1)
    cache.acquire(2)
    assert not cache.can_acquire(3) and cache.can_acquire(1) and cache.can_acquire(None)
    cache.acquire(1)                              # a second request on a resident adapter: a hit
    assert cache.stats.device_hits == 1 and cache.stats.device_misses == 2
    cache.release(2)
    assert cache.can_acquire(3)
    cache.acquire(3)                              # evicts 2 (idle), never 1 (pinned twice)
    assert set(cache.slot_of) == {1, 3} and cache.stats.device_evictions == 1
    cache.release(1)
    cache.release(1)
    cache.release(3)
    assert cache.pins == [0, 0]
    assert cache.stats.device_bytes == cache.host[1].num_bytes + cache.host[3].num_bytes


def test_unknown_task_id_gets_the_trtllm_error_text(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)
    with pytest.raises(RequestError) as err:
        engine.add_request([5, 6, 7], lora=1234)
    assert err.value.field == "lora_task_id"
    assert err.value.message == "LoRA task 1234 not found in cache. Please send LoRA weights with request"
    assert engine.lora_cache.stats.host_misses == 1


def test_more_adapters_than_device_slots_all_complete(tiny_model_dir, model_cfg):
    kw = dict(dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)
    tight = LLMEngine(tiny_model_dir, max_loras=2, **kw)
    roomy = LLMEngine(tiny_model_dir, max_loras=8, **kw)
    for task in range(1, 7):
        for engine in (tight, roomy):
            engine.add_lora(task, *make_adapter(model_cfg, 2 * task, task))
    tasks = [1, 2, 3, 4, 5, 6, None, 3, 1, 6, 2, 5]
    prompts = random_prompts([4 + i for i in range(len(tasks))], model_cfg.vocab_size, seed=2)
    outputs = tight.generate(prompts, max_new_tokens=6, lora_task_ids=tasks)
    assert outputs == roomy.generate(prompts, max_new_tokens=6, lora_task_ids=tasks)
    assert all(len(o) == 6 for o in outputs)
    assert tight.lora_cache.stats.device_evictions > 0
    assert tight.lora_cache.pins == [0, 0] and not tight.lora_cache.in_use
    assert tight.blocks.num_free_blocks == tight.blocks.num_blocks


def test_a_request_waiting_for_a_slot_does_not_hold_up_requests_on_resident_adapters(tiny_model_dir, model_cfg):
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20,
                       max_loras=1)
    for task in (1, 2):
        engine.add_lora(task, *make_adapter(model_cfg, 4, task))
    prompts = random_prompts([5, 6, 7, 8], model_cfg.vocab_size, seed=3)
    ids = [engine.add_request(p, lora=t, max_new_tokens=4) for p, t in zip(prompts, [1, 2, 1, None])]
    engine.step()
    assert [engine.seqs[i][0].num_computed_tokens > 0 for i in ids] == [True, False, True, True]
    assert engine.scheduler.waiting[0].request_id == ids[1]
    while engine.has_unfinished:
        engine.step()
    assert engine.lora_cache.pins == [0] and engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_byte_accounting_returns_to_what_is_resident(model_cfg):
    import torch
    size = adapter_bytes(model_cfg, 4)
    cache = LoraCache(LoraCacheConfig(max_loras=1, host_memory_bytes=size, max_adapter_bytes=size), model_cfg,
                      torch.float32)
    for task in range(1, 5):                      # each new adapter evicts the previous one from both tiers
        cache.add(task, *make_adapter(model_cfg, 4, task))
        cache.acquire(task)
        cache.release(task)
        assert cache.stats.host_bytes == size and cache.stats.device_bytes == size
    cache.add(9, *make_adapter(model_cfg, 4, 9))
    assert list(cache.host) == [9] and cache.stats.device_bytes == 0 and not cache.slot_of
    assert cache.stats.host_evictions == 4 and cache.stats.device_evictions == 4


def test_prefetch_fills_idle_slots_ahead_and_never_evicts_what_is_pinned_or_wanted(model_cfg):
    import torch
    cache = LoraCache(LoraCacheConfig(max_loras=2), model_cfg, torch.float32)
    for task in (1, 2, 3, 4):
        cache.add(task, *make_adapter(model_cfg, 4, task))
    cache.acquire(1)                              # pinned by a running request
    cache.prefetch([None, 2, 3])                  # one idle slot: 2 gets it, 3 finds none
    assert set(cache.slot_of) == {1, 2} and cache.pins[cache.slot(2)] == 0
    loaded = cache.slots.host_ranks[0, 0, 0, cache.slot(2)]
    assert loaded == 4                            # its weights are in the slot already
    misses = cache.stats.device_misses
    cache.acquire(2)                              # the request is admitted: a hit, nothing copied
    assert cache.stats.device_misses == misses and cache.stats.device_hits == 1
    cache.release(2)
    cache.prefetch([3, 2])                        # 2 is idle but wanted by a waiting request: kept
    assert set(cache.slot_of) == {1, 2}
    cache.prefetch([4])
    assert set(cache.slot_of) == {1, 4} and cache.stats.device_evictions == 1


def test_lora_dtype_auto_is_fp16_beside_fp32_only_where_the_kernels_read_it():
    import torch
    from kernels.lora.family import LoraFamily
    compiled, triton, reference = (LoraFamily.of(name, "cpu") for name in ("cpu", "triton", "torch"))
    assert compiled.adapter_dtype("auto", torch.float32) == torch.float16
    assert triton.adapter_dtype("auto", torch.float32) == torch.float16
    assert reference.adapter_dtype("auto", torch.float32) == torch.float32      # it would widen every step
    assert compiled.adapter_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert compiled.adapter_dtype("float32", torch.float32) == torch.float32
    with pytest.raises(ValueError, match="lora_dtype must be one of"):
        LoraCacheConfig(dtype="int8")


def test_a_parsed_adapter_owns_its_weights(model_cfg):
    """Never a view of the request's buffer (Triton may reuse it once the request is answered), even when the
    dtype sent is the dtype stored."""
    import torch
    from backend.lora.format import module_shape
    weights, config = make_adapter(model_cfg, 4, 0)
    sent = torch.from_numpy(weights.astype(np.float16))
    adapter = LoraCache(LoraCacheConfig(max_loras=1), model_cfg, torch.float16).parse(sent, config)
    before = {key: (a.clone(), b.clone()) for key, (a, b) in adapter.weights.items()}
    sent.fill_(7)
    assert adapter.same_as(type(adapter)(before))
    assert adapter.num_bytes == model_cfg.num_layers * sum(4 * sum(module_shape(model_cfg, m)) * 2 for m in (1, 4, 6))


def test_a_re_sent_adapter_is_known_by_its_values_not_its_padding_nor_row_order(model_cfg):
    import torch
    cache = LoraCache(LoraCacheConfig(max_loras=1), model_cfg, torch.float16)
    weights, config = make_adapter(model_cfg, 4, 7)
    cache.add(7, weights, config)
    other_padding = weights.copy()
    other_padding[0, -1] = 9.0                    # row 0 (attn_q) is narrower than the widest row (mlp_4h_to_h)
    assert cache.holds(7, weights, config) and cache.holds(7, np.pad(weights, [(0, 0), (0, 16)]), config)
    assert cache.holds(7, other_padding, config) and cache.holds(7, weights[::-1], config[::-1])
    assert cache.holds(7, weights.astype(np.float16), config)        # the values the cache keeps, sent as fp16
    changed = weights.copy()
    changed[-1, 5] += 0.5                         # inside the last row's A
    assert not cache.holds(7, changed, config) and not cache.holds(7, weights[:-1], config[:-1])
    assert not cache.holds(8, weights, config)
    with pytest.raises(RequestError, match="already cached with different weights"):
        cache.add(7, changed, config)


def test_values_beyond_the_kept_dtype_are_refused_like_nan(model_cfg):
    import torch
    weights, config = make_adapter(model_cfg, 4, 3)
    weights[1, 2] = 1e6                           # finite in fp32, inf in fp16
    LoraCache(LoraCacheConfig(max_loras=1), model_cfg, torch.float32).add(3, weights, config)
    with pytest.raises(RequestError, match="NaN or Inf values, or values beyond torch.float16's range"):
        LoraCache(LoraCacheConfig(max_loras=1), model_cfg, torch.float16).add(3, weights, config)
