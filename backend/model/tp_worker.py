"""A tensor-parallel worker (rank 1..N-1): its share of the weights, of the KV cache (its KV heads) and of each
adapter in the device slots; it runs every step rank 0 broadcasts and joins each layer's all-reduce. It handles no
request, samples nothing and computes no logits (rank 0 does). Started by backend/model/parallel.py:

    python -m backend.model.tp_worker --rank R --size N --port P --capacity C --model_dir DIR --dtype ... ...
It dies with its parent (PR_SET_PDEATHSIG), and when a collective fails."""
import argparse
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from backend.device import StepStaging, empty_kv_caches
from backend.heap import freeze_heap
from backend.lora.format import LoraAdapter, packed_views
from backend.lora.slots import DeviceSlots
from backend.model.calibration import kv_amax
from backend.model.checkpoint import ModelConfig
from backend.model.context import StepInputs
from backend.model.graphs import DecodeGraphs
from backend.model.llama import LlamaModel
from backend.model.loader import load_weights
from backend.model.parallel import COPY_KV, GRAPHS, INIT, KV_AMAX, LOAD, STEP, STOP, unpack
from backend.model.self_check import apply_fallbacks
from backend.processes import die_with_parent
from kernels.dispatch import load_ops


NO_SAMPLING = SimpleNamespace(t={})           # a worker's graph steps upload no sampling tensors


def worker_device(rank0_device: str, rank: int) -> torch.device:
    """Rank r runs r devices after rank 0's (cuda:r from cuda:0, as CUDA_VISIBLE_DEVICES numbers them)."""
    device = torch.device(rank0_device)
    if device.type != "cuda":
        return device
    device = torch.device("cuda", (device.index or 0) + rank)
    torch.cuda.set_device(device)
    return device


class Worker:
    def __init__(self, args):
        self.args = args
        self.device = worker_device(args.device, args.rank)
        self.dtype = getattr(torch, args.dtype)
        full = ModelConfig.from_dir(args.model_dir)
        self.cfg = full.shard(args.size)
        self.ops = load_ops(args.kernel_backend, self.device, bool(args.lora_overlap), bool(args.lora_fold),
                            tuple(set(args.broken_ops.split(",")) - {"none"}))
        apply_fallbacks(self.ops, set(args.kernel_fallbacks.split(",")) - {"none"})
        weights = load_weights(args.model_dir, full, self.dtype, self.device, args.size, args.rank,
                               lm_head=False, weight_dtype=args.weight_dtype,            # rank 0's logits
                               projection_dtype=getattr(torch, args.projection_dtype), prepare=self.ops.prepare_weight)
        self.model = LlamaModel(self.cfg, weights, self.ops, all_reduce=dist.all_reduce)
        self.slots = DeviceSlots(self.cfg, args.max_loras, args.max_lora_rank, getattr(torch, args.lora_dtype),
                                 self.device, self.ops.lora)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: DecodeGraphs | None = None
        self.staging = StepStaging(self.device)
        self.message_device = self.device if self.device.type == "cuda" else torch.device("cpu")

    def run(self) -> None:
        message = torch.empty(self.args.capacity, dtype=torch.int32, device=self.message_device)
        while True:
            dist.broadcast(message, src=0)
            command, t = unpack(message.cpu())
            if command == STOP:
                return
            if command == INIT:
                self.allocate(int(t["num_blocks"]), t.get("kv_scales"), t.get("fp8"))
                freeze_heap()                                  # the start-up, out of the collector's passes
            elif command == KV_AMAX:
                amax = kv_amax(self.kv_caches, int(t["num_tokens"])).to(self.message_device)
                dist.all_reduce(amax, op=dist.ReduceOp.MAX)
            elif command == STEP:
                self.step(t)
            elif command == GRAPHS:
                self.graphs = DecodeGraphs(self.model, self.kv_caches, self.slots, self.args.max_num_seqs,
                                           self.args.block_size, self.device, bool(int(t["capture"])), logits=False)
                freeze_heap()
            elif command == LOAD:
                self.load(int(t["slot"]), t["layout"].tolist())
            elif command == COPY_KV:
                self.copy_kv(t["pairs"].to(self.device))

    def allocate(self, num_blocks: int, kv_scales: torch.Tensor | None = None, fp8: torch.Tensor | None = None
                 ) -> None:
        """The KV cache in projection_dtype, or (kv_scales: [num_layers, 2] fp32 bits as int32) in int8, or e4m3
        bits in uint8 where fp8 ([1]) is set, with those scales."""
        shape = (self.cfg.num_kv_heads, num_blocks, self.args.block_size, self.cfg.head_dim)
        self.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.model.kv_scales = None if kv_scales is None else [tuple(pair) for pair in
                                                               kv_scales.view(torch.float32).tolist()]
        if kv_scales is None:
            cache_dtype = getattr(torch, self.args.projection_dtype)      # (kv_cache_dtype auto: as the weights)
        else:
            cache_dtype = torch.uint8 if fp8 is not None and fp8.item() else torch.int8
        self.kv_caches = empty_kv_caches(self.cfg.num_layers, shape, cache_dtype, self.device)

    @torch.inference_mode()
    def step(self, t: dict[str, torch.Tensor]) -> None:
        token_slots = t.pop("token_slots").tolist()
        bucket = t.pop("bucket", None)
        inputs = StepInputs.from_tensors(t)
        if bucket is not None:                                 # rank 0 replays its graph: this rank replays its own
            self.graphs.run(tuple(bucket.tolist()), inputs, token_slots, self.staging, NO_SAMPLING, self)
            return
        segments = (self.ops.lora.segments(token_slots, self.dtype)
                    if any(s >= 0 for s in token_slots) else None)
        host_t = inputs.tensors | (segments.tensors if segments is not None else {})
        device_t = {name: x.to(self.device) for name, x in host_t.items()}
        ctx = inputs.context(device_t)
        if segments is not None:
            segments.use(device_t)
            ctx.lora = self.ops.lora_for(segments, self.slots)
        self.model.forward(ctx, self.kv_caches, logits=False)

    def wait_for_slots(self, slots: list[int]) -> None:
        """What DecodeGraphs.run asks of a LoRA cache: the step waits for these slots' uploads."""
        self.slots.copies.wait({slot for slot in slots if slot >= 0})

    def load(self, slot: int, layout: list[list[int]]) -> None:
        dtype = self.slots.a[0]["qkv"].dtype
        shapes = {(layer, module): ((a0, a1), (b0, b1)) for layer, module, a0, a1, b0, b1, _ in layout}
        dora = {(layer, module) for layer, module, *_, is_dora in layout if is_dora}
        numel = sum(a0 * a1 + b0 * b1 + b0 * is_dora for *_, a0, a1, b0, b1, is_dora in layout)
        data = torch.empty(numel * dtype.itemsize, dtype=torch.uint8, device=self.message_device)
        dist.recv(data, src=0)
        flat = data.cpu().view(dtype)
        views, magnitudes = packed_views(flat, shapes, dora)
        self.slots.load(slot, LoraAdapter(views, flat, magnitudes))

    def copy_kv(self, pairs: torch.Tensor) -> None:
        src, dst = pairs[:, 0].long(), pairs[:, 1].long()
        for k, v in self.kv_caches:
            k.index_copy_(1, dst, k.index_select(1, src))
            v.index_copy_(1, dst, v.index_select(1, src))


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, kind in (("rank", int), ("size", int), ("port", int), ("capacity", int), ("timeout-s", float),
                       ("model_dir", str), ("dtype", str), ("projection_dtype", str), ("lora_dtype", str),
                       ("kernel_backend", str), ("device", str), ("block_size", int), ("max_loras", int),
                       ("max_lora_rank", int),
                       ("threads", int), ("kernel_fallbacks", str), ("lora_overlap", int), ("lora_fold", int),
                       ("broken_ops", str),
                       ("max_num_seqs", int), ("weight_dtype", str)):
        parser.add_argument(f"--{name}", type=kind, required=True)
    args = parser.parse_args()
    die_with_parent()
    torch.set_num_threads(max(1, args.threads))
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    worker_device(args.device, args.rank)                 # NCCL binds the rank to the current device
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{args.port}", world_size=args.size,
                            rank=args.rank, timeout=timedelta(seconds=args.timeout_s))
    try:
        Worker(args).run()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
