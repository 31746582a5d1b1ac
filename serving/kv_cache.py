"""Page bookkeeping for the paged KV cache, with prefix caching. The pages themselves (K, V and index-K of every
layer, which always move together) live on the device in `m3jax.batch.KVPages`; this only tracks which page
belongs to whom and which full pages hold which tokens.

Prefix caching (vLLM's scheme, page = MSA block = `page_size` tokens):
- A full page is named by a hash chain: the SHA-256 of (the previous page's hash, this page's token ids), so a
  page's name covers every token before it and two requests share a page only when their whole prefixes match.
  (A cryptographic hash: crafted collisions must not let one client read another's cached tokens.)
- Pages are reference-counted. A request that starts with a known prefix takes those pages (no copy) and starts
  computing after them. A page nobody references keeps its contents and its name until it is needed for new
  work: unnamed free pages are handed out first, then named ones in least-recently-freed order (LRU eviction of
  unreferenced pages only).
- K, V and index-K of a page are written together, so MSA's index over a cached prefix is exactly the one it would
  have computed: a cached page is a page, whatever the layer kind.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

from m3jax.batch import SINK_PAGE

PageHash = bytes


def page_hash(previous: PageHash | None, token_ids: Sequence[int] | np.ndarray) -> PageHash:
    """The name of a full page: its tokens (as int64) chained to the name of the page before it."""
    h = hashlib.sha256(previous or b"")
    h.update(np.asarray(token_ids, np.int64).tobytes())
    return h.digest()


class PageAllocator:
    def __init__(self, num_pages: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"the page pool needs at least 2 pages (page {SINK_PAGE} is the padding sink)")
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching
        # Free pages that hold nothing worth keeping, LIFO (recently freed reused first: deterministic).
        self._free = [p for p in range(num_pages - 1, -1, -1) if p != SINK_PAGE]
        # Free pages that still hold a named prefix, least recently freed first: evicted in that order.
        self._cached_free: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._refs: dict[int, int] = {}
        self._by_hash: dict[PageHash, int] = {}
        self._hash_of: dict[int, PageHash] = {}

    @property
    def num_free(self) -> int:
        """Pages that can be handed out now (evicting cached prefixes if need be)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_used(self) -> int:
        """Pages referenced by at least one request."""
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Named pages (referenced or not)."""
        return len(self._by_hash)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"asked for {n} pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._cached_free.popitem(last=False)
                del self._by_hash[self._hash_of.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page. The last page of a request is released first, so of the pages that
        become free the ones furthest into a prefix are evicted first."""
        for p in reversed(pages):
            if p not in self._refs:
                raise ValueError(f"page {p} freed but not allocated")
            self._refs[p] -= 1
            if self._refs[p]:
                continue
            del self._refs[p]
            if p in self._hash_of:
                self._cached_free[p] = None
            else:
                self._free.append(p)

    # ---- prefix caching ----------------------------------------------------------------------------------------
    def lookup(self, hashes: list[PageHash]) -> list[int]:
        """The longest run of cached pages naming `hashes` from the first on, each now referenced once more."""
        if not self.enable_prefix_caching:
            return []
        pages = []
        for h in hashes:
            page = self._by_hash.get(h)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if page in self._cached_free:
                del self._cached_free[page]
            self._refs[page] = self._refs.get(page, 0) + 1
        return pages

    def register(self, page: int, h: PageHash) -> None:
        """Name a full, referenced page. A name already given to another page stays with that page."""
        if not self.enable_prefix_caching or h in self._by_hash or page in self._hash_of:
            return
        self._by_hash[h] = page
        self._hash_of[page] = h

    def reset_prefix_cache(self) -> None:
        """Forget every name (the pages' contents are gone: a failed step rebuilt the pool)."""
        for page in list(self._cached_free):
            self._free.append(page)
        self._cached_free.clear()
        self._by_hash.clear()
        self._hash_of.clear()
