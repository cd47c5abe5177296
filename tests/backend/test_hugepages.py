"""backend/hugepages.py: the CPU KV cache's tensors in one region on 2 MB pages, each its own, none overlapping."""
import pytest
import torch

from backend.hugepages import HUGE_PAGE, available, empty_kv_caches, empty_on_huge_pages


def anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tensors_are_laid_out_apart_each_as_asked(dtype):
    shapes = [(2, 300, 16, 64), (5,), (1, 4096, 16, 32)]
    tensors = empty_on_huge_pages(shapes, dtype)
    for value, (t, shape) in enumerate(zip(tensors, shapes)):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 64 == 0
        t.fill_(value)
    for value, t in enumerate(tensors):
        assert bool((t == value).all())
    if available():
        assert tensors[0].data_ptr() % HUGE_PAGE == 0


def test_the_kv_cache_lies_on_huge_pages_where_the_kernel_gives_them():
    if not available():
        pytest.skip("transparent huge pages are off on this machine")
    caches = empty_kv_caches(2, (1, 1024, 16, 64), torch.float32, torch.device("cpu"))     # 4 MB a tensor
    for k, v in caches:
        k.zero_()
        v.zero_()
    assert anon_huge_kb(caches[0][0].data_ptr()) >= HUGE_PAGE // 1024


def test_small_tensors_are_plain_ones():
    (t,) = empty_on_huge_pages([(1000,)], torch.float32)
    assert t.shape == (1000,) and t.storage_offset() == 0
