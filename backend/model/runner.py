"""Owns the model's weights and KV cache tensors, and runs one forward per scheduled batch."""
import torch

from backend.config import EngineConfig
from backend.kv_cache import num_kv_blocks
from backend.lora.batch import LoraBatch, LoraSegments
from backend.lora.cache import LoraCache
from backend.model.config import ModelConfig
from backend.model.context import build_context
from backend.model.llama import LlamaModel
from backend.model.loader import load_weights
from backend.scheduler import Batch
from kernels.dispatch import load_ops


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.config = config
        self.model_config = cfg = model_config
        self.dtype = getattr(torch, config.dtype)
        self.ops = load_ops(config.kernel_backend)
        self.model = LlamaModel(cfg, load_weights(config.model_dir, cfg, self.dtype), self.ops)
        self.block_size = config.kv_block_size
        self.num_blocks = num_kv_blocks(config.kv_cache_memory_bytes, self.block_size, cfg.num_layers,
                                        cfg.num_kv_heads, cfg.head_dim, self.dtype.itemsize)
        shape = (cfg.num_kv_heads, self.num_blocks, self.block_size, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
                          for _ in range(cfg.num_layers)]

    def run(self, batch: Batch, lora_cache: LoraCache | None = None) -> torch.Tensor:
        """Logits [num_sampled, vocab] fp32, one row per sequence whose chunk reaches its last token (in the
        order of batch.items, which this sorts by adapter slot so that each adapter is one segment)."""
        if lora_cache is not None:
            batch.items.sort(key=lambda item: lora_cache.slot(item.seq.lora_task_id))
        ctx = build_context(batch, self.block_size)
        if lora_cache is not None and any(item.seq.lora_task_id is not None for item in batch.items):
            token_slots = [lora_cache.slot(item.seq.lora_task_id)
                           for item in batch.items for _ in range(item.num_new_tokens)]
            ctx.lora = LoraBatch(lora_cache.slots, LoraSegments.from_token_slots(token_slots), self.ops)
        return self.model.forward(ctx, self.kv_caches)
