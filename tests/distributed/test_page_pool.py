"""``PagePool``: a freed mapping's pages moved onto the next one gathered, without faults, never above the most
in use, all handed back by ``release``."""

import mmap
import resource
import sys

import pytest
import torch

from lightning_parallel.distributed.page_pool import PagePool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mremap is Linux's")

NBYTES = 8 * 2**20


def _mapping() -> tuple[mmap.mmap, torch.Tensor]:
    mapped = mmap.mmap(-1, NBYTES, flags=mmap.MAP_PRIVATE)
    return mapped, torch.frombuffer(mapped, dtype=torch.float32)


def _faults_writing(t: torch.Tensor, value: float) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.fill_(value)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_the_pages_of_a_freed_mapping_fill_the_next_one_without_faults_and_keep_its_address():
    pool = PagePool()
    (_, ta), (_, tb) = _mapping(), _mapping()
    pool.take(ta.data_ptr(), NBYTES)
    pool.take(tb.data_ptr(), NBYTES)
    ta.fill_(1.0)
    view = ta[:4]
    assert pool.give(ta.data_ptr(), NBYTES) and pool.kept == NBYTES
    assert pool.take(ta.data_ptr(), NBYTES)  # the kept pages back at a's address
    assert _faults_writing(ta, 2.0) < NBYTES // mmap.PAGESIZE // 100
    assert view.tolist() == [2.0] * 4  # views made before keep their address
    assert pool.give(tb.data_ptr(), NBYTES) and pool.kept == NBYTES  # b's pages kept, a's in use
    assert _faults_writing(tb, 3.0) >= NBYTES // mmap.PAGESIZE // 2  # b's range is left empty
    pool.release()
    assert pool.kept == 0 and pool.most == pool.in_use == NBYTES  # a's is still in use


def test_without_the_pool_a_freed_mapping_faults_every_page_in_again():
    a, ta = _mapping()
    ta.fill_(1.0)
    a.madvise(mmap.MADV_DONTNEED)
    assert _faults_writing(ta, 2.0) >= NBYTES // mmap.PAGESIZE // 2
