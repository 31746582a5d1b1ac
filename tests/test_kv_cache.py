"""The page pool alone: reference counts, named full pages, longest-prefix lookup, eviction of unreferenced
pages only and least recently freed first, and forgetting everything after a failure."""

import pytest

from serving.kv_cache import PageAllocator, page_hash


def chain(*pages):
    out, h = [], None
    for tokens in pages:
        h = page_hash(h, list(tokens))
        out.append(h)
    return out


def test_hash_chain_names_the_whole_prefix():
    a = chain([1, 2], [3, 4])
    b = chain([9, 9], [3, 4])
    assert a[0] != b[0] and a[1] != b[1]  # same second page, different prefix: different names
    assert chain([1, 2], [3, 4]) == a
    assert page_hash(None, [1, 2]) != page_hash(None, [1, 2, 0])


def test_lookup_shares_pages_and_counts_references():
    pool = PageAllocator(8)
    names = chain([1, 2], [3, 4], [5, 6])
    pages = pool.allocate(3)
    for p, h in zip(pages, names, strict=True):
        pool.register(p, h)
    assert pool.lookup(names[:2]) == pages[:2]  # a second request shares the first two
    assert pool.lookup(chain([1, 2], [7, 7])) == pages[:1]  # the longest run from the first page
    assert pool.lookup(chain([8, 8], [3, 4])) == []
    pool.free(pages)
    assert pool.num_used == 2  # still referenced by the two lookups
    pool.free(pages[:2])
    pool.free(pages[:1])
    assert pool.num_used == 0 and pool.num_free == 7 and pool.num_cached == 3
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(pages[:1])


def test_unnamed_pages_go_first_then_least_recently_freed():
    pool = PageAllocator(5)  # 4 usable pages
    a, b = pool.allocate(2), pool.allocate(2)
    pool.register(a[0], b"a0")
    pool.register(a[1], b"a1")
    pool.register(b[0], b"b0")
    pool.free(b)  # b[1] (unnamed) becomes plain free, b[0] a cached free page
    pool.free(a)  # a[1] then a[0] cached: the end of a prefix is evicted before its start
    assert pool.allocate(1) == [b[1]]  # unnamed first
    assert pool.allocate(1) == [b[0]]  # then the least recently freed name
    assert pool.lookup([b"b0"]) == []  # evicted: its name is gone
    assert pool.allocate(1) == [a[1]]
    assert pool.lookup([b"a0"]) == [a[0]]  # referenced again: no longer evictable
    assert pool.num_free == 0
    with pytest.raises(MemoryError):
        pool.allocate(1)


def test_a_name_stays_with_its_first_page_and_reset_forgets_all():
    pool = PageAllocator(6)
    p, q = pool.allocate(2)
    pool.register(p, b"x")
    pool.register(q, b"x")  # computed twice (both admitted before either was named): the first keeps it
    assert pool.lookup([b"x"]) == [p]
    pool.free([p, p, q])
    pool.reset_prefix_cache()
    assert pool.lookup([b"x"]) == [] and pool.num_cached == 0 and pool.num_free == 5


def test_disabled_prefix_caching_never_hits():
    pool = PageAllocator(4, enable_prefix_caching=False)
    (p,) = pool.allocate(1)
    pool.register(p, b"x")
    assert pool.lookup([b"x"]) == [] and pool.num_cached == 0
