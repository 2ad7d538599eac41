"""``PagePool``: a freed mapping's pages moved onto the next one gathered, without faults, never above the most
in use, all handed back by ``release``; ``host_mapping``'s mappings faulted in by huge pages where the kernel
gives them, and moved by the pool as well."""

import mmap
import resource
import sys
from pathlib import Path

import pytest
import torch

from lightning_parallel.distributed.page_pool import PagePool, host_mapping

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mremap is Linux's")

NBYTES = 8 * 2**20


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MAPPINGS = {
    "plain": lambda: mmap.mmap(-1, NBYTES, flags=mmap.MAP_PRIVATE),
    "host_mapping": lambda: host_mapping(NBYTES),
}


def _mapping(kind: str = "plain") -> tuple[mmap.mmap, torch.Tensor]:
    mapped = MAPPINGS[kind]()
    return mapped, torch.frombuffer(mapped, dtype=torch.float32)


def _faults_writing(t: torch.Tensor, value: float) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.fill_(value)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.parametrize("kind", list(MAPPINGS))
def test_the_pages_of_a_freed_mapping_fill_the_next_one_without_faults_and_keep_its_address(kind: str):
    pool = PagePool()
    (_, ta), (_, tb) = _mapping(kind), _mapping(kind)
    pool.take(ta.data_ptr(), NBYTES)
    pool.take(tb.data_ptr(), NBYTES)
    ta.fill_(1.0)
    view = ta[:4]
    assert pool.give(ta.data_ptr(), NBYTES) and pool.kept == NBYTES
    assert pool.take(ta.data_ptr(), NBYTES)  # the kept pages back at a's address
    assert _faults_writing(ta, 2.0) < NBYTES // mmap.PAGESIZE // 100
    assert view.tolist() == [2.0] * 4  # views made before keep their address
    assert pool.give(tb.data_ptr(), NBYTES) and pool.kept == NBYTES  # b's pages kept, a's in use
    refaulted = _faults_writing(tb, 3.0)  # b's range is left empty: faulted in again, by 4 KiB or 2 MiB pages
    assert refaulted >= (NBYTES // mmap.PAGESIZE // 2 if kind == "plain" else 1)
    pool.release()
    assert pool.kept == 0 and pool.most == pool.in_use == NBYTES  # a's is still in use


def test_without_the_pool_a_freed_mapping_faults_every_page_in_again():
    a, ta = _mapping()
    ta.fill_(1.0)
    a.madvise(mmap.MADV_DONTNEED)
    assert _faults_writing(ta, 2.0) >= NBYTES // mmap.PAGESIZE // 2


@pytest.mark.skipif(
    not THP.is_file() or "[never]" in THP.read_text(), reason="the kernel gives no transparent huge pages"
)
def test_a_host_mapping_faults_its_pages_in_by_huge_pages():
    """8 MiB written again after its pages were handed back: 4 faults of 2 MiB (a few more at unaligned
    ends), where the plain mapping above takes 2,048 of 4 KiB."""
    mapped, t = _mapping("host_mapping")
    t.fill_(1.0)
    mapped.madvise(mmap.MADV_DONTNEED)
    assert _faults_writing(t, 2.0) < NBYTES // mmap.PAGESIZE // 10
