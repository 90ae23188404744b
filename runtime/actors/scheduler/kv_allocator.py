"""The paged KV allocator: which token slots of the worker's KV pool are free. Lives on the host; slot
indices travel to the device once per step inside the StepPlan."""

from __future__ import annotations


class OutOfPages(Exception):
    pass


class PageAllocator:
    """Page p covers slots [p * page_size, (p + 1) * page_size). Page 0 is never handed out: its slots are
    where padded (CUDA-graph) rows write."""

    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self._free: list[int] = list(range(self.num_pages - 1, 0, -1))  # pop() hands out low pages first

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def total_pages(self) -> int:
        return self.num_pages - 1

    @property
    def used_pages(self) -> int:
        return self.total_pages - len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        out = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return out[::-1]

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def slots_of(self, page: int) -> range:
        return range(page * self.page_size, (page + 1) * self.page_size)
