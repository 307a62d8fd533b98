"""PageManager: reference counts, prefix hashes, and least-recently-used eviction of pages no job holds."""
from __future__ import annotations

import pytest

from exl_backends.engine.pages import PageManager, page_hashes
from exl_backends.model.cache import PagePool


def test_page_hashes_chain_over_the_prefix():
    a = page_hashes(list(range(12)), 4, 3, [])
    b = page_hashes([99] + list(range(1, 12)), 4, 3, [])
    assert len(set(a) | set(b)) == 6                     # a change in page 0 changes every later hash
    assert page_hashes(list(range(12)), 4, 3, a[:1]) == a
    assert page_hashes(list(range(12)), 4, 2, []) == a[:2]


def test_registered_pages_outlive_their_job_until_needed():
    pages = PageManager(PagePool(4), page_size=4)
    hashes = page_hashes(list(range(8)), 4, 2, [])
    job = pages.allocate(3)
    for page, h in zip(job, hashes):
        pages.register(page, h)
    pages.release(job)                      # two registered pages stay cached, the third is free again
    assert pages.pool.n_free == 2 and pages.n_available == 4
    assert pages.match(hashes + [b"other"]) == job[:2]
    other = pages.match(hashes[:1])
    pages.hold(other)                       # a second job reuses page 0 ...
    assert pages.n_available == 3 and pages.n_unowned(job[:2]) == 1
    fresh = pages.allocate(3)               # ... and a third needs every other page: page 1 is evicted
    assert job[1] in fresh and pages.match(hashes) == job[:1]
    with pytest.raises(MemoryError):
        pages.allocate(1)
    pages.release(other)
    pages.release(fresh)
    assert pages.n_available == 4


def test_a_prefix_computed_twice_is_registered_once():
    pages = PageManager(PagePool(4), page_size=4)
    h = page_hashes(list(range(4)), 4, 1, [])[0]
    first, second = pages.allocate(1), pages.allocate(1)
    pages.register(first[0], h)
    pages.register(second[0], h)
    pages.release(first)
    pages.release(second)
    assert pages.match([h]) == first and pages.pool.n_free == 3


def test_followers_give_the_longest_matching_head_and_go_with_their_page():
    pages = PageManager(PagePool(4), page_size=4)
    hashes = page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, 2, [])
    job = pages.allocate(3)
    pages.register(job[0], hashes[0], b"", (1, 2, 3, 4))
    pages.register(job[1], hashes[1], hashes[0], (5, 6, 7, 8))
    pages.register_partial(job[2], hashes[1], (9, 10))
    other = pages.allocate(1)
    pages.register_partial(other[0], hashes[1], (9, 11, 12))
    assert pages.follower(hashes[0], [5, 6, 0]) == (job[1], 2)              # parting inside a full page
    assert pages.follower(hashes[1], [9, 10, 13]) == (job[2], 2)
    assert pages.follower(hashes[1], [9, 11, 12, 14]) == (other[0], 3)
    assert pages.follower(hashes[1], [8]) == (None, 0) and pages.follower(b"x", [9]) == (None, 0)
    pages.release(job + other)                  # partial pages stay cached like full ones, then go oldest first
    assert pages.pool.n_free == 0 and pages.n_available == 4
    assert pages.allocate(1) == [job[0]]
    assert pages.match(hashes) == [] and pages.follower(b"", [1]) == (None, 0)
    assert pages.allocate(2) == [job[1], job[2]]
    assert pages.follower(hashes[1], [9, 10]) == (other[0], 1)
