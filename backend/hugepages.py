"""Large CPU tensors on 2 MB pages: Linux's transparent huge pages, asked for with madvise before the first touch.

A decode step reads the KV cache of its sequences once, 4 kB page after 4 kB page: at 32 sequences of 4k tokens
(the host profile's tiny model) that is ~8k pages a step, more than the TLB holds, so every page costs a walk
(and in a VM two levels of it). On 2 MB pages the same cache is 16. Where the kernel's THP setting is "madvise"
(as on many distributions) nothing gets them unless asked; under "always" they come anyway, and under "never" (or
off Linux) this hands out plain tensors.
"""
import math
import mmap
from functools import cache

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64                                    # each tensor of an arena starts on a cache line
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@cache
def available() -> bool:
    """Transparent huge pages can be had: Linux, its setting not "never"."""
    try:
        with open(THP_SETTING) as f:
            return "[never]" not in f.read() and hasattr(mmap, "MADV_HUGEPAGE")
    except OSError:
        return False


def huge_page_region(num_bytes: int) -> torch.Tensor:
    """num_bytes of fresh memory (an anonymous mapping of its own: never touched, so the advice holds for every
    page) starting on a 2 MB boundary, advised huge, as a uint8 tensor that keeps the mapping alive."""
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # (not shmem)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE
    mapping.madvise(mmap.MADV_HUGEPAGE, start, num_bytes)
    return buffer[start:start + num_bytes]


def empty_on_huge_pages(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Uninitialized CPU tensors of these shapes, laid out one after another in one region that starts on a 2 MB
    boundary and is advised huge (one region: at most one page of slack for all of them); plain torch.empty where
    huge pages cannot be had."""
    sizes = [math.prod(shape) * dtype.itemsize for shape in shapes]
    if not available() or sum(sizes) < HUGE_PAGE:
        return [torch.empty(shape, dtype=dtype) for shape in shapes]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGN) * ALIGN
    region = huge_page_region(total)
    return [region[offset:offset + size].view(dtype).view(shape)
            for shape, size, offset in zip(shapes, sizes, offsets)]


def empty_kv_caches(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) cache of `shape`, uninitialized: on CPU in one region on 2 MB pages."""
    if device.type == "cpu":
        caches = empty_on_huge_pages([shape] * (2 * num_layers), dtype)
    else:
        caches = [torch.empty(shape, dtype=dtype, device=device) for _ in range(2 * num_layers)]
    return list(zip(caches[0::2], caches[1::2]))
