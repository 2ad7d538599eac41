"""Resident host pages that ZeRO-3's freed units hand to the next gathered one, without page faults.

On the CPU a unit's flat buffer of ``MAPPED_BYTES`` or more is a private anonymous mapping of its own
(``zero3._flat_buffer``), at a fixed address: autograd saves views of it from the forward (a transposed
weight), which its backward reads after the unit was freed and gathered again, so the gather must land at the
same address. Released with ``madvise(MADV_DONTNEED)``, every gather then writes into pages the kernel zeroes
and maps one fault per 4 KiB page (92-122k faults a step at dp=2, CharGPT 4 x 768, against ZeRO-1's 17-30k).

A ``PagePool`` instead moves a freed unit's pages out of its range (``mremap`` with ``MREMAP_DONTUNMAP``: the
range stays mapped, empty, at its address) and moves them onto the range of the next unit of that size to be
gathered (``mremap`` with ``MREMAP_FIXED``): the page-table entries move, no page is zeroed or faulted, and
every view keeps its address. FSDP2 and the CUDA caching allocator keep freed blocks for the next
allocation the same way.

It never holds more than was in use: a unit's pages are kept only while the pages in use and kept together
stay within the most that units used at once since the last ``release`` (the units in flight: gathered,
prefetched, kept until the backward), else they are handed back to the system. ``release`` (a step's end)
hands back every kept page, so between steps nothing more is resident than without the pool. Where the
kernel lacks ``MREMAP_DONTUNMAP`` (Linux < 5.7) the pool hands every page back, as ``madvise`` did.

``host_mapping`` makes those mappings, and asks the kernel for transparent huge pages in them
(``MADV_HUGEPAGE``): a fresh 28 MiB range then faults in 14 pages of 2 MiB, not 7,168 of 4 KiB (8 against 25
ms to fill one on the 2-core VM, loaded). Where the system's THP setting is ``never`` the advice changes
nothing.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Optional

__all__ = ["PagePool", "host_mapping"]

_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4
_FAILED = ctypes.c_void_p(-1).value
_PAGE = mmap.PAGESIZE


def host_mapping(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes``, advised to the kernel for transparent huge pages: what a
    buffer whose pages are handed back when freed (``madvise(MADV_DONTNEED)``, ``munmap``) and faulted in
    again at its next use lies in. Private: a shared anonymous mapping's pages stay allocated after
    ``madvise`` (shared memory), only unmapped from the process."""
    mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    try:
        mapped.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # not Linux, or a kernel without transparent huge pages
        pass
    return mapped


def _libc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.mremap.restype = ctypes.c_void_p
        libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


class PagePool:
    """Pages of freed mappings kept resident for the next mapping of their size to be filled (see the module
    docstring). ``take`` before a mapping is written, ``give`` when its contents are no longer needed,
``release`` at a step's end."""

    def __init__(self) -> None:
        self._libc = _libc()
        self._kept: dict[int, list[int]] = {}  # length -> addresses of kept pages of that length
        self.in_use = 0  # bytes of the mappings taken and not given back
        self.kept = 0  # bytes of pages kept
        self.most = 0  # the most ``in_use`` since the last ``release``: what the pool may hold with it

    def take(self, address: int, nbytes: int) -> bool:
        """The mapping at ``address`` (``nbytes``, no pages) about to be written: kept pages of its length moved
        onto it if there are any (True), else it faults its pages in as it is written (False)."""
        length = -(-nbytes // _PAGE) * _PAGE
        self.in_use += length
        self.most = max(self.most, self.in_use)
        kept = self._kept.get(length)
        if not kept:
            return False
        source = kept.pop()
        self.kept -= length
        moved = self._libc.mremap(source, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, address)
        if moved != address:
            raise OSError(ctypes.get_errno(), f"mremap of kept pages onto 0x{address:x} failed")
        return True

    def give(self, address: int, nbytes: int) -> bool:
        """The mapping at ``address`` (``nbytes``, taken) no longer needed: True if its pages are kept (the
        mapping left empty at its address); False if the pool may not hold them, and the caller hands them
        back (``madvise``)."""
        length = -(-nbytes // _PAGE) * _PAGE
        self.in_use = max(0, self.in_use - length)
        if self._libc is None or self.in_use + self.kept + length > self.most:
            return False
        moved = self._libc.mremap(address, length, length, _MREMAP_MAYMOVE | _MREMAP_DONTUNMAP, None)
        if moved in (None, _FAILED):
            return False
        self._kept.setdefault(length, []).append(moved)
        self.kept += length
        return True

    def release(self) -> None:
        """Every kept page handed back to the system (a step's end); the bound starts again from what is in
        use now."""
        for length, addresses in self._kept.items():
            for address in addresses:
                self._libc.munmap(address, length)
        self._kept, self.kept, self.most = {}, 0, self.in_use
