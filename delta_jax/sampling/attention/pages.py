"""Pages on the host: the page size arithmetic, one data group's page allocator, and the page
tables and flat page lists the device programs read (NumPy only).

A sequence owns a *page table*, the list of pages that hold its positions ``0, page_size,
2 page_size, ...``; page 0 of every data group's share of the pool is its scratch page: padding
tokens write there and unused entries point there (:mod:`delta_jax.sampling.attention.paged`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["SCRATCH_PAGE", "PageAllocator", "page_lists", "page_tables", "pages_for", "pow2"]

SCRATCH_PAGE = 0


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` positions."""
    return -(-tokens // page_size)


def pow2(x: int) -> int:
    """The least power of two >= ``x`` (1 for ``x <= 1``)."""
    return 1 << max(0, (x - 1).bit_length())


class PageAllocator:
    """Free list of one data group's pages (host side, group-local indices); page 0 is the
    group's scratch page, never handed out.

    Attributes:
      num_pages: pages in the group's share of the pool, scratch included.
      high_water: the most pages ever in use at once since construction.
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))
        self.high_water = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def alloc(self, count: int) -> list[int] | None:
        """``count`` pages, or None (nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(count)]
        self.high_water = max(self.high_water, self.num_used)
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


def page_tables(tables: list[list[list[int]]], rows: int, width: int) -> np.ndarray:
    """Every group's per-row page tables (group ``g``'s in rows ``g * rows`` on) as one int32
    ``[groups * rows, width]`` array; unused entries hold the scratch page."""
    table = np.full((len(tables) * rows, width), SCRATCH_PAGE, np.int32)
    for g, group in enumerate(tables):
        for r, t in enumerate(group):
            table[g * rows + r, : len(t)] = t
    return table


def page_lists(tables: list[list[list[int]]], rows: int, size: int) -> np.ndarray:
    """Flat :class:`~delta_jax.sampling.attention.paged.PageList` entries ``[U, 3]`` (page, seq,
    index), one list of ``size`` entries per data group, concatenated (the list is split over the
    groups like the rows): group ``g``'s per-row page lists in
    group-local rows and pages, padded (row ``rows``: out of range) up to ``size``."""
    page = np.full((len(tables), size), SCRATCH_PAGE, np.int32)
    seq = np.full((len(tables), size), rows, np.int32)
    index = np.zeros((len(tables), size), np.int32)
    for g, group in enumerate(tables):
        at = 0
        for row, table in enumerate(group):
            page[g, at : at + len(table)] = table
            seq[g, at : at + len(table)] = row
            index[g, at : at + len(table)] = np.arange(len(table))
            at += len(table)
    return np.stack([page.reshape(-1), seq.reshape(-1), index.reshape(-1)], axis=1)
