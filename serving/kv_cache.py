"""Page bookkeeping for the paged KV cache. The pages themselves (K, V and index-K of every layer, which always
move together) live on the device in `m3jax.batch.KVPages`; this only tracks which page belongs to whom."""

from __future__ import annotations

from m3jax.batch import SINK_PAGE


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"the page pool needs at least 2 pages (page {SINK_PAGE} is the padding sink)")
        self.num_pages = num_pages
        # LIFO free list: recently freed pages are reused first (warm in cache, and deterministic).
        self._free = [p for p in range(num_pages - 1, -1, -1) if p != SINK_PAGE]
        self._owned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_used(self) -> int:
        return len(self._owned)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._owned.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._owned:
                raise ValueError(f"page {p} freed but not allocated")
            self._owned.remove(p)
            self._free.append(p)
