"""Where the engine runs, and how data crosses between host and device without stalling a step.

A step sends its inputs in one host -> device copy (`StepStaging.upload`) and takes its results back in one
device -> host copy (`StepStaging.download`), waited for only when the host needs them; adapter uploads go on a
side stream (`SideCopies`) and a step waits only for the slots it uses. On CPU all of it is a no-op.
"""
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch


def resolve_device(name: str) -> torch.device:
    """"auto" is the current CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {name!r}: CUDA is not available on this machine (use device 'cpu' or 'auto')")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise RuntimeError(f"device {name!r}: only {torch.cuda.device_count()} CUDA devices")
        device = torch.device("cuda", index)
    return device


DEVICE_FAULT_MARKERS = ("CUDA error", "illegal memory access", "device-side assert", "unspecified launch failure",
                        "CUBLAS_STATUS", "NCCL error")


def is_device_fault(exc: BaseException) -> bool:
    """A CUDA error is sticky: once one is raised every later launch in the process fails too, so the engine
    cannot go on (torch raises AcceleratorError, or a RuntimeError naming the CUDA error)."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in DEVICE_FAULT_MARKERS)


def cpu_has_native_bf16() -> bool:
    """avx512_bf16 or AMX, with ATen's kernels at AVX-512 (ATEN_CPU_CAPABILITY can hold them at AVX2): without
    them, bf16 arithmetic on CPU runs several times slower than fp32."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return ("avx512_bf16" in flags or "amx_bf16" in flags) and \
        torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto" is bfloat16 where it is fast (CUDA from sm_80 on, CPUs with native bf16), float16 on older GPUs (a
    bf16 tl.dot needs sm_80) and float32 on other CPUs (over bf16 weights: projection_dtype)."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return getattr(torch, name)


def projection_dtype(name: str, dtype: torch.dtype, kernel_backend: str) -> torch.dtype:
    """The projections' and the LM head's weights where not quantized, and the KV cache under kv_cache_dtype auto:
    in dtype, but in bf16 beside dtype auto's fp32 (a CPU without bf16 arithmetic) where the compiled CPU kernels
    serve: their GEMMs and attention widen bf16 as they load it, as llama.cpp's do on AVX2, so a decode step reads
    half the bytes (W3 on an AVX2 build: 36 -> 62 tok/s), a cache holds twice the tokens, and a model takes the
    precision it takes under auto everywhere else."""
    return torch.bfloat16 if name == "auto" and dtype == torch.float32 and kernel_backend == "cpu" else dtype


def on(device: torch.device):
    """Make `device` the current CUDA device (kernel launches and streams follow it) in this thread."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def empty_kv_caches(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) cache of `shape`, uninitialized: attention never reads a position no step wrote (a cache
    full of NaN changes no token), and zeroing it would cost every start and restart seconds on CPU."""
    return [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def pin(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Page-locked host copy of t when the device is a GPU (so uploads can be asynchronous), t itself on CPU."""
    if device.type != "cuda":
        return t
    with on(device):                          # pinning outside it makes a context on GPU 0 when serving on cuda:N
        return t.pin_memory()


ALIGN_INTS = 4                                # 16 bytes: Triton's pointer specialization


STAGING_RING = 3                              # host buffers a steady step's upload takes in turn: one being read by
                                              # the copy in flight, one written, one spare


@dataclass(slots=True)
class StagingBuffer:
    """One host buffer of the ring, and what reuses it cheaply."""
    host: torch.Tensor                        # [capacity] int32, pinned on CUDA
    done: "torch.cuda.Event | None"           # after the copy that read it last (None: no device copies)
    view: torch.Tensor                        # host cut to the last size staged ...
    view_np: np.ndarray                       # ... and as numpy


class StepStaging:
    """A step's host tensors packed into one pinned int32 buffer, one non-blocking copy to the device, and
    views of it by name; results come back through pinned buffers, waited for when the host needs them. A buffer
    is never written while a copy that reads it may still run: a steady step's (a lone int32 tensor, the kept
    batch's buffer) is the next of a ring of buffers, taken only once the event after its last copy has passed
    (else, as every other step's, a fresh one from torch's caching host allocator, which reuses a block only once
    the copies that read or wrote it are done). A steady step's copy lands in the same device buffer every step:
    the copy is queued behind the steps before it on the stream, so they have read what it overwrites."""

    def __init__(self, device: torch.device, pinned: bool | None = None):
        self.device = device
        self.pinned = device.type == "cuda" if pinned is None else pinned     # (False: the host-profile bench)
        self.ring: list[StagingBuffer] = []
        self.turn = 0
        self.staged: StagingBuffer | None = None                 # the ring buffer the last `pack` filled
        self.source: tuple[torch.Tensor, np.ndarray] | None = None    # the last lone tensor, and as numpy (a
                                                                      # steady step sends the same one each time)
        self.on_device: torch.Tensor | None = None             # where a steady step's buffer lands, every step
        self.landing: torch.Tensor | None = None               # and cut to the last size sent

    def upload(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host int32 / int64 / float32 / bool tensors -> the same on the device (int64 and bool as int32). Each
        view starts 16 bytes aligned, as Triton assumes of the pointers it specializes on: an unaligned view
        would compile another variant of every kernel it reaches, on the engine thread, mid-serving."""
        if self.device.type == "cpu":
            return tensors
        host, offsets = self.pack(tensors)
        if self.staged is None:
            return unpacked(host.to(self.device, non_blocking=True), tensors, offsets)
        landing = self._landing(host.shape[0])                 # (the steps before read it in stream order first)
        landing.copy_(host, non_blocking=True)
        self.staged.done.record(torch.cuda.current_stream(self.device))
        return dict.fromkeys(tensors, landing)

    def pack(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """The tensors as int32 in one host buffer (page-locked where `pinned`), each at an aligned offset ->
        (buffer [total], offsets). Written through numpy, whose slice and copy cost a tenth of torch's in host
        time. A lone int32 tensor (a steady step's kept buffer, laid out already) is one copy into
        the ring's next buffer."""
        self.staged = None
        if len(tensors) == 1:
            (t,) = tensors.values()
            if t.dtype == torch.int32 and t.dim() == 1:
                staged = self._ring_buffer(t.shape[0])
                if staged is not None:
                    if self.source is None or self.source[0] is not t:
                        self.source = (t, t.numpy())
                    np.copyto(staged.view_np, self.source[1])
                    return staged.view, [0]
        flat = [_as_int32(t) for t in tensors.values()]
        offsets, total = aligned_offsets([f.size for f in flat])
        host = torch.empty(total, dtype=torch.int32, pin_memory=self.pinned)
        out = host.numpy()
        for f, offset in zip(flat, offsets):
            out[offset:offset + f.size] = f
        return host, offsets

    def _ring_buffer(self, size: int) -> StagingBuffer | None:
        """The ring's next buffer, its view cut to `size` ints, if no copy may still read it (else None)."""
        index = self.turn % STAGING_RING
        if index < len(self.ring):
            done = self.ring[index].done
            if done is not None and not done.query():
                return None
        self.turn += 1
        if index == len(self.ring) or self.ring[index].host.shape[0] < size:
            host = torch.empty(2 * size, dtype=torch.int32, pin_memory=self.pinned)
            if index == len(self.ring):
                self.ring.append(StagingBuffer(host, torch.cuda.Event() if self.pinned else None, host, host.numpy()))
            else:
                self.ring[index] = StagingBuffer(host, self.ring[index].done, host, host.numpy())
        staged = self.staged = self.ring[index]
        if staged.view.shape[0] != size:
            staged.view, staged.view_np = staged.host[:size], staged.host.numpy()[:size]
        return staged

    def _landing(self, size: int) -> torch.Tensor:
        """The device buffer a steady step's copy lands in, cut to `size`: the same tensor while the size repeats,
        so that what is built on it (StepInputs.received's views) is built once."""
        if self.landing is None or self.landing.shape[0] != size:
            if self.on_device is None or self.on_device.shape[0] < size:
                self.on_device = torch.empty(2 * size, dtype=torch.int32, device=self.device)
            self.landing = self.on_device[:size]
        return self.landing

    def download(self, *tensors: torch.Tensor) -> "Download":
        """Start the step's one device -> host transfer (of one tensor or a few, each into a pinned buffer of its
        own), in stream order after the work that makes them; `Download.wait` gives the host values."""
        if self.device.type == "cpu":
            return Download(list(tensors), None)
        hosts = []
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            hosts.append(host)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return Download(hosts, done)


class Download:
    """A device -> host transfer under way: `wait` blocks until it has landed (the step's only host sync)."""

    def __init__(self, hosts: list[torch.Tensor], done: "torch.cuda.Event | None"):
        self.hosts, self.done = hosts, done

    def wait(self) -> list[torch.Tensor]:
        if self.done is not None:
            self.done.synchronize()
        return self.hosts


def unpacked(buffer: torch.Tensor, tensors: dict[str, torch.Tensor], offsets: list[int]) -> dict[str, torch.Tensor]:
    """Views of a packed buffer (StepStaging.pack of `tensors`, at `offsets`) by name, in the tensors' shapes."""
    views = {}
    for (name, t), offset in zip(tensors.items(), offsets):
        view = buffer[offset:offset + t.numel()].view(t.shape)
        views[name] = view.view(torch.float32) if t.dtype == torch.float32 else view
    return views


def aligned_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Where each of `sizes` int32 values starts in one buffer, each start a multiple of ALIGN_INTS; and the total."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGN_INTS) * ALIGN_INTS
    return offsets, total


def _as_int32(t: torch.Tensor) -> np.ndarray:
    """A host tensor's values as a flat int32 array (float32 bit for bit)."""
    a = t.numpy().reshape(-1)
    return a.view(np.int32) if a.dtype == np.float32 else a.astype(np.int32, copy=False)


class SideCopies:
    """Host -> device copies on a stream of their own, each tagged with a key (an adapter slot); the compute
    stream waits only for the keys a step uses."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.events: dict[int, torch.cuda.Event] = {}

    def copying(self):
        """Context for the copies. They need not wait for the step being launched: a slot being filled is idle (no
        sequence of that step reads it). A step still in flight from before may read it: see `after`."""
        return nullcontext() if self.stream is None else torch.cuda.stream(self.stream)

    def after(self, download: "Download") -> None:
        """Later copies wait until the step that `download` ends is done (a step in flight, launched before a
        sequence of it was preempted and its adapter's slot given up)."""
        if self.stream is not None and download.done is not None:
            self.stream.wait_event(download.done)

    def done(self, key: int) -> None:
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
            self.events[key] = event

    def wait(self, keys) -> None:
        if self.stream is not None:
            current = torch.cuda.current_stream(self.stream.device)
            for key in keys:
                event = self.events.pop(key, None)
                if event is not None:
                    current.wait_event(event)
