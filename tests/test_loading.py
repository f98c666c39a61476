"""train/loading.py's never-written parameter storage for ranks fed by FSDP2's broadcast, on its own."""

import pytest
import torch

from orchestrator.train import loading

pytestmark = pytest.mark.unit
MIB = 2**20


def test_untouched_views_are_distinct_aligned_zero_and_not_resident():
    memory = loading.HostMemory()
    shapes = {"embed": ((8192, 4096), torch.bfloat16), "norm": ((4096,), torch.float32),
              "proj": ((4096, 4096), torch.float32), "bias": ((3,), torch.float16)}  # fmt: skip
    views = loading.untouched(shapes)
    grown = memory.rss() - memory.baseline
    assert grown < 8 * MIB, f"{grown / MIB:.0f} MiB resident for ~128 MiB of views"  # never written: not resident

    assert {n: (tuple(v.shape), v.dtype) for n, v in views.items()} == shapes
    pointers = [v.data_ptr() for v in views.values()]
    assert len(set(pointers)) == len(pointers)  # accelerate maps optimizer parameters by data_ptr()
    assert all(p % loading.ALIGN == 0 for p in pointers)
    ends = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views.values())
    assert all(end <= start for (_, end), (start, _) in zip(ends, ends[1:], strict=False))  # no overlap
    assert all(not v.any() for v in views.values())  # read as zeros, like transformers' fill


def test_small_blocks_are_zeroed_where_the_heap_may_be_reused():
    garbage = torch.full((1024,), 7, dtype=torch.uint8)
    del garbage
    views = loading.untouched({"w": ((256,), torch.float32)})
    assert not views["w"].any()
