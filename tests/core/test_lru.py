"""``core.lru.ByteLRU``: the byte budget, least-recently-used eviction, refusals and counts."""

from clef_gguf.core.lru import ByteLRU


def test_evicts_the_least_recently_used_within_the_byte_budget():
    cache: ByteLRU[bytes] = ByteLRU(10, len)
    assert cache.put(b"a", b"1234") and cache.put(b"b", b"1234")
    assert cache.get(b"a") == b"1234"  # a is now the most recent
    assert cache.put(b"c", b"1234")  # 12 > 10: b goes, not a
    assert b"b" not in cache and b"a" in cache and b"c" in cache and cache.nbytes == 8
    assert (cache.hits, cache.misses) == (1, 0)
    assert cache.get(b"b") is None and cache.misses == 1


def test_refuses_what_cannot_fit_and_replaces_a_key():
    cache: ByteLRU[bytes] = ByteLRU(4, len)
    assert not cache.put(b"big", b"12345") and len(cache) == 0  # never empties the cache for it
    assert cache.put(b"k", b"12") and cache.put(b"k", b"1234") and cache.nbytes == 4 and len(cache) == 1
    off: ByteLRU[bytes] = ByteLRU(0, len)
    assert not off.put(b"k", b"1") and len(off) == 0  # a zero budget keeps nothing
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0
