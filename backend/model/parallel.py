"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on CUDA): rank 0 is the engine's own process (the
scheduler, the KV block manager, the adapter host tier and the sampler live there); ranks 1..N-1 are worker
processes it starts (backend/model/tp_worker.py) that only follow steps.

Every command to the workers is one broadcast of a fixed-size int32 message (a step's packed inputs: token ids,
positions, cache slots, attention tables and LoRA slots; or an adapter load, a KV block copy, the KV cache's size
(and an INT8 one's scales), a calibration's reduction, stop). An adapter's shares follow its load message point to
point, each worker receiving only its own. Inside the forward each rank runs its heads and MLP columns, and the
row-parallel projections (o, down) end in one all-reduce.
Decode steps replay each rank's CUDA graph of the step's bucket (the all-reduces recorded in them), captured on
every rank in the same order at start.
A collective that fails (a worker gone) or outlasts `timeout_s` (one hung) raises TensorParallelError: the engine
cannot go on, and its loop declares it broken.
"""
import os
import socket
import subprocess
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from backend.core.request import FatalEngineError
from backend.processes import python_executable

ROOT = Path(__file__).resolve().parents[2]
STEP, INIT, LOAD, COPY_KV, STOP, GRAPHS, KV_AMAX = range(7)
NAMES = ("input_ids", "positions", "slot_mapping", "query_starts", "seq_lens", "block_tables", "logits_indices",
         "context_indices", "token_slots", "layout", "pairs", "num_blocks", "slot", "bucket", "capture", "kv_scales",
         "num_tokens", "fp8")
HEADER = 2 + 4 * len(NAMES)                  # command, entries; then (name, ndim, dim0, dim1) per entry


class TensorParallelError(FatalEngineError):
    """A collective failed or timed out: a worker died or hangs. Fatal for the engine."""


def message_capacity(max_tokens: int, max_seqs: int, max_blocks: int, num_layers: int) -> int:
    """Ints in a message: a step's tensors at their largest, or an adapter layout (7 ints for each of up to 13 modules
    a layer: 8 dense, 5 of a mixture), or KV pairs, or an INT8 cache's scales (2 a layer)."""
    step = 5 * max_tokens + 3 * max_seqs + 1 + max_seqs * max_blocks
    return HEADER + max(step, 7 * 13 * num_layers, 2 * max_seqs + 2, 2 * num_layers + 1)


def pack(command: int, tensors: dict[str, torch.Tensor], capacity: int) -> torch.Tensor:
    """One int32 message: the command, each tensor's name and shape (at most 2-D), then the data back to back."""
    message = torch.zeros(capacity, dtype=torch.int32)
    message[0], message[1] = command, len(tensors)
    offset = HEADER
    for i, (name, t) in enumerate(tensors.items()):
        shape = list(t.shape) + [1] * (2 - t.dim())
        message[2 + 4 * i:6 + 4 * i] = torch.tensor([NAMES.index(name), t.dim(), *shape], dtype=torch.int32)
        n = t.numel()
        if offset + n > capacity:
            raise ValueError(f"tensor parallel message of more than {capacity} ints")
        message[offset:offset + n] = t.reshape(-1).to(torch.int32)
        offset += n
    return message


def unpack(message: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    command, count = int(message[0]), int(message[1])
    tensors, offset = {}, HEADER
    for i in range(count):
        code, ndim, d0, d1 = message[2 + 4 * i:6 + 4 * i].tolist()
        shape = [d0, d1][:ndim]
        n = d0 * d1 if ndim == 2 else (d0 if ndim == 1 else 1)
        tensors[NAMES[code]] = message[offset:offset + n].clone().view(shape)
        offset += n
    return command, tensors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelGroup:
    """Rank 0's side: starts the workers, joins the group with them, and sends them every command."""

    def __init__(self, size: int, worker_args: dict, device: torch.device, capacity: int, timeout_s: float = 60):
        self.size, self.rank, self.device, self.capacity = size, 0, device, capacity
        port = free_port()
        env = os.environ | {"PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
        self.workers = [subprocess.Popen(
            [python_executable(), "-m", "backend.model.tp_worker", "--rank", str(rank), "--size", str(size),
             "--port", str(port), "--capacity", str(capacity), "--timeout-s", str(timeout_s),
             *(f"--{k}={v}" for k, v in worker_args.items())], cwd=ROOT, env=env) for rank in range(1, size)]
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(device)
        try:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", world_size=size, rank=0,
                                    timeout=timedelta(seconds=timeout_s))
        except BaseException:
            for w in self.workers:
                w.kill()
                w.wait()
            if not dist.is_initialized():      # torch counted the group it failed to make: a later group in this
                dist.distributed_c10d._world.group_count = 0    # process would wait on another name than its workers
            raise
        self.message_device = device if backend == "nccl" else torch.device("cpu")

    def all_reduce(self, t: torch.Tensor) -> None:
        self._checked(dist.all_reduce, t)

    def send(self, command: int, tensors: dict[str, torch.Tensor]) -> None:
        self._checked(dist.broadcast, pack(command, tensors, self.capacity).to(self.message_device), src=0)

    def step(self, tensors: dict[str, torch.Tensor], token_slots: list[int],
             bucket: tuple[int, int] | None = None) -> None:
        """The workers run this step beside rank 0: eagerly, or through their graph of `bucket` (DecodeGraphs)."""
        num_tokens = tensors["input_ids"].numel()
        extra = {"token_slots": torch.tensor(token_slots or [-1] * num_tokens, dtype=torch.int32)}
        if bucket is not None:
            extra["bucket"] = torch.tensor(bucket, dtype=torch.int32)
        self.send(STEP, tensors | extra)

    def start_graphs(self, capture: bool) -> None:
        """The workers build their decode graphs now, as rank 0 does (captures run collectives: in step)."""
        self.send(GRAPHS, {"capture": torch.tensor([int(capture)], dtype=torch.int32)})

    def kv_amax(self, num_tokens: int, amax: torch.Tensor) -> None:
        """amax [num_layers, 2] (rank 0's largest |K|, |V| over a calibration prefill of num_tokens) becomes, in
        place, the largest over every rank's KV heads (each worker reduces its own: tp_worker)."""
        self.send(KV_AMAX, {"num_tokens": torch.tensor([num_tokens], dtype=torch.int32)})
        reduced = amax.to(self.message_device)
        self._checked(dist.all_reduce, reduced, op=dist.ReduceOp.MAX)
        amax.copy_(reduced.cpu())

    def copy_kv(self, pairs: list[tuple[int, int]]) -> None:
        self.send(COPY_KV, {"pairs": torch.tensor(pairs, dtype=torch.int32).view(-1, 2)})

    def load_adapter(self, slot: int, shares: list) -> None:
        """Worker r (1..) gets shares[r] (a packed LoraAdapter, backend/lora/shard.py) into `slot`: the shapes in a
        broadcast, the buffer point to point."""
        layout = torch.tensor([[layer, module, *a_shape, *b_shape, (layer, module) in shares[1].magnitudes]
                               for (layer, module), (a_shape, b_shape) in shares[1].shapes.items()], dtype=torch.int32)
        self.send(LOAD, {"slot": torch.tensor([slot], dtype=torch.int32), "layout": layout})
        for rank in range(1, self.size):
            flat = shares[rank].buffer.view(torch.uint8)
            self._checked(dist.send, flat.to(self.message_device), dst=rank)

    def _checked(self, collective, *args, **kwargs) -> None:
        dead = [w.pid for w in self.workers if w.poll() is not None]
        if dead:
            raise TensorParallelError(f"tensor parallel worker process(es) {dead} exited")
        try:
            collective(*args, **kwargs)
        except (RuntimeError, ValueError) as err:
            raise TensorParallelError(f"tensor parallel collective failed (a worker died or hangs): {err}") from err

    def close(self) -> None:
        """Stop the workers (a STOP message, then SIGKILL for any that linger) and leave the group."""
        try:
            if all(w.poll() is None for w in self.workers):
                self.send(STOP, {})
        except TensorParallelError:
            pass
        for w in self.workers:
            try:
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
