"""Radix prefix cache: matching, splitting, locking, LRU eviction, slot accounting, and a fuzz test
that drives it the way the scheduler does against a brute-force dict-of-prefixes oracle."""

from __future__ import annotations

import random

import pytest
import torch

from executor.memory_pool import TokenSlotAllocator
from scheduler.radix_cache import NoPrefixCache, PrefixCache, RadixCache, create_prefix_cache


def _alloc(allocator: TokenSlotAllocator, n: int) -> torch.Tensor:
    out = allocator.alloc(n)
    assert out is not None
    return out


def _fresh(num_slots: int = 256) -> tuple[TokenSlotAllocator, RadixCache]:
    allocator = TokenSlotAllocator(num_slots)
    return allocator, RadixCache(allocator)


def _put(cache: RadixCache, allocator: TokenSlotAllocator, ids: list[int]) -> torch.Tensor:
    """Caches `ids` the way a finished request does; returns the slots now cached for them."""
    match = cache.match_prefix(ids)
    cache.lock(match.node)
    prefix_len = match.kv_indices.numel()
    kv = torch.cat([match.kv_indices, _alloc(allocator, len(ids) - prefix_len)])
    already = cache.insert(ids, kv)
    allocator.free(kv[prefix_len:already])
    cache.unlock(match.node)
    return cache.match_prefix(ids).kv_indices


def _free_slots(allocator: TokenSlotAllocator) -> list[int]:
    """The allocator's free list, read through its public API (the order changes, the set does not)."""
    slots = _alloc(allocator, allocator.available_size())
    allocator.free(slots)
    return slots.tolist()


def test_shared_prefixes_and_partial_matches() -> None:
    allocator, cache = _fresh()
    a, b = [5, 1, 2, 3, 4], [5, 1, 2, 9, 9, 7]
    kv_a = _alloc(allocator, len(a))
    assert cache.insert(a, kv_a) == 0
    kv_b = _alloc(allocator, len(b))
    assert cache.insert(b, kv_b) == 3  # [5, 1, 2] was already there: kv_b[:3] are duplicates
    allocator.free(kv_b[:3])
    assert cache.total_size() == len(a) + len(b) - 3 == cache.evictable_size()
    assert cache.protected_size() == 0

    assert cache.match_prefix(a).kv_indices.tolist() == kv_a.tolist()  # exact
    assert cache.match_prefix(a + [8, 8]).kv_indices.tolist() == kv_a.tolist()  # query longer than cached
    assert cache.match_prefix(b).kv_indices.tolist() == kv_a[:3].tolist() + kv_b[3:].tolist()
    assert cache.match_prefix([5, 1, 2, 9, 3]).kv_indices.tolist() == kv_a[:3].tolist() + kv_b[3:4].tolist()
    assert cache.match_prefix([5, 1, 7]).kv_indices.tolist() == kv_a[:2].tolist()
    miss = cache.match_prefix([6, 1, 2])
    assert miss.kv_indices.numel() == 0 and miss.kv_indices.dtype == torch.int64
    assert cache.match_prefix([]).kv_indices.numel() == 0
    assert cache.match_prefix(torch.tensor(a)).kv_indices.tolist() == kv_a.tolist()  # tensor ids work too
    cache.check_integrity()


def test_split_in_the_middle_of_an_edge() -> None:
    allocator, cache = _fresh()
    ids = [3, 1, 4, 1, 5, 9]
    kv = _alloc(allocator, len(ids))
    cache.insert(ids, kv)
    match = cache.match_prefix(ids[:4])  # stops inside the single edge: it is split there
    assert match.kv_indices.tolist() == kv[:4].tolist()
    cache.lock(match.node)
    assert (cache.protected_size(), cache.evictable_size()) == (4, 2)  # the handle covers exactly 4
    cache.check_integrity()

    assert cache.evict(100) == 2  # only the unlocked tail can go
    assert cache.match_prefix(ids).kv_indices.tolist() == kv[:4].tolist()
    assert set(kv[4:].tolist()) <= set(_free_slots(allocator))

    # a diverging insert splits the (locked) edge again; the old handle still unlocks all 4 tokens
    other = [3, 1, 7, 7]
    kv_other = _alloc(allocator, 4)
    assert cache.insert(other, kv_other) == 2
    allocator.free(kv_other[:2])
    cache.check_integrity()
    assert (cache.protected_size(), cache.evictable_size()) == (4, 2)
    cache.unlock(match.node)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 6)
    cache.check_integrity()


def test_insert_returns_what_was_already_cached() -> None:
    allocator, cache = _fresh()
    ids = [7, 3, 3, 8, 1, 2]
    kv = _alloc(allocator, len(ids))
    assert cache.insert(ids, kv) == 0
    assert cache.insert(ids, kv) == len(ids)  # all of it
    assert cache.insert(ids[:3], kv[:3]) == 3  # a prefix that ends inside an edge
    assert cache.total_size() == len(ids)
    longer = ids + [4, 4]
    extra = _alloc(allocator, 2)
    assert cache.insert(longer, torch.cat([kv, extra])) == len(ids)
    assert cache.total_size() == len(longer)
    assert cache.match_prefix(longer).kv_indices.tolist() == kv.tolist() + extra.tolist()
    assert cache.insert([], torch.empty(0, dtype=torch.int64)) == 0
    with pytest.raises(ValueError, match="one slot per token"):
        cache.insert([1, 2, 3], kv[:2])
    cache.check_integrity()


def test_insert_keeps_its_own_copy_of_the_slots() -> None:
    allocator, cache = _fresh()
    kv = _alloc(allocator, 4)
    expected = kv.tolist()
    cache.insert([1, 2, 3, 4], kv)
    kv.fill_(0)  # the caller reuses its tensor (e.g. a req_to_token row)
    assert cache.match_prefix([1, 2, 3, 4]).kv_indices.tolist() == expected


def test_lock_protects_from_eviction() -> None:
    allocator, cache = _fresh()
    start = allocator.available_size()
    kv_a = _put(cache, allocator, [1, 2, 3, 4])
    _put(cache, allocator, [1, 2, 8, 8, 8])
    _put(cache, allocator, [9, 9])
    held = cache.match_prefix([1, 2, 3, 4, 5])
    cache.lock(held.node)
    cache.lock(held.node)  # two requests on the same prefix
    assert cache.protected_size() == 4 and cache.evictable_size() == 5
    assert cache.evict(1000) == 5
    assert cache.match_prefix([1, 2, 3, 4]).kv_indices.tolist() == kv_a.tolist()
    cache.unlock(held.node)
    assert cache.evict(1000) == 0  # still locked once
    cache.unlock(held.node)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(held.node)
    assert cache.evict(1000) == 4
    assert allocator.available_size() == start and cache.total_size() == 0
    with pytest.raises(RuntimeError, match="stale"):
        cache.lock(held.node)  # its tokens are gone
    with pytest.raises(TypeError):
        cache.lock("not a node")
    cache.check_integrity()


def test_eviction_is_lru_and_cascades_to_parents() -> None:
    allocator, cache = _fresh()
    a, b, c = [1, 1, 1], [2, 2], [3, 3, 3, 3]
    for ids in (a, b, c):
        _put(cache, allocator, ids)
    cache.match_prefix(a)  # a is now the most recently used; b the least
    assert cache.evict(1) == 2  # a whole leaf goes, even if more than asked
    assert cache.match_prefix(b).kv_indices.numel() == 0
    assert cache.evict(1) == 4  # then c
    assert cache.match_prefix(c).kv_indices.numel() == 0
    assert cache.match_prefix(a).kv_indices.numel() == 3

    # a chain: evicting the leaf makes its parent a leaf, which goes next in the same call
    _put(cache, allocator, [4, 4, 4])
    _put(cache, allocator, [4, 4, 4, 5, 5])
    cache.match_prefix(a)
    assert cache.evict(4) == 5
    assert cache.match_prefix([4]).kv_indices.numel() == 0 and cache.total_size() == 3
    cache.check_integrity()


def test_evicting_everything_returns_every_slot() -> None:
    rng = random.Random(1)
    allocator, cache = _fresh(num_slots=512)
    start = allocator.available_size()
    for _ in range(40):
        _put(cache, allocator, [rng.randrange(4) for _ in range(rng.randrange(1, 12))])
    assert cache.total_size() > 0
    assert allocator.available_size() + cache.total_size() == start
    everything = cache.evictable_size()
    assert cache.evict(everything) == everything
    assert cache.total_size() == 0 and allocator.available_size() == start
    assert sorted(_free_slots(allocator)) == list(range(1, 513))

    for _ in range(10):
        _put(cache, allocator, [rng.randrange(4) for _ in range(rng.randrange(1, 12))])
    _put(cache, allocator, [0, 1])
    node = cache.match_prefix([0, 1]).node
    cache.lock(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.unlock(node)
    cache.reset()
    assert cache.total_size() == 0 and allocator.available_size() == start
    assert cache.match_prefix([0, 1, 2, 3]).kv_indices.numel() == 0


def test_hit_tokens_total_counts_matched_tokens() -> None:
    allocator, cache = _fresh()
    cache.insert([1, 2, 3], _alloc(allocator, 3))
    before = cache.hit_tokens_total
    cache.match_prefix([1, 2, 9])
    cache.match_prefix([1, 2, 3, 4])
    cache.match_prefix([7])
    assert cache.hit_tokens_total - before == 5


def test_pages_are_matched_and_split_whole() -> None:
    """Page size 4: a match is cut to whole pages, an edge splits only between pages, a part page is never
    cached, and the integrity check catches slots that are not whole pages' runs."""
    allocator = TokenSlotAllocator(64, page_size=4)
    cache = RadixCache(allocator)
    a = [5, 1, 2, 3, 4, 6, 7, 8]
    kv_a = allocator.alloc_extend([(-1, 8)])
    assert kv_a is not None and cache.insert(a, kv_a) == 0
    assert cache.match_prefix(a[:7]).kv_indices.tolist() == kv_a[:4].tolist()  # 7 shared tokens: one page
    assert cache.match_prefix(a[:3] + [9]).kv_indices.numel() == 0  # inside the first page: nothing
    b = a[:6] + [0, 0]  # shares one page and a half: the edge splits after the first page
    kv_b = allocator.alloc_extend([(-1, 8)])
    assert kv_b is not None and cache.insert(b, kv_b) == 4
    allocator.free(kv_b[:4])
    assert cache.match_prefix(b).kv_indices.tolist() == kv_a[:4].tolist() + kv_b[4:].tolist()
    assert cache.total_size() == 12
    cache.check_integrity()
    with pytest.raises(ValueError, match="whole number of pages"):
        cache.insert(a + [1, 2], torch.cat([kv_a, kv_a[:2]]))
    with pytest.raises(RuntimeError, match="not whole pages"):
        c = [9, 9, 9, 9]
        cache.insert(c, kv_a[4:].flip(0))  # a page whose slots run backwards
        cache.check_integrity()


def test_a_salted_key_shares_only_with_its_salt() -> None:
    """vLLM's cache_salt: the same tokens under another salt, or none, match nothing of each other."""
    allocator, cache = _fresh()
    ids = [5, 1, 2, 3]
    kv = {salt: _alloc(allocator, 4) for salt in (None, "a", "b")}
    for salt, slots in kv.items():
        assert cache.insert(ids, slots, salt) == 0  # nothing shared: each keeps its own slots
    for salt, slots in kv.items():
        assert cache.match_prefix(ids + [9], salt).kv_indices.tolist() == slots.tolist()
    assert cache.match_prefix(ids, "c").kv_indices.numel() == 0
    assert cache.insert(ids[:2] + [7], _alloc(allocator, 3), "a") == 2
    assert cache.total_size() == 13
    cache.check_integrity()
    assert cache.evict(100) == 13 and allocator.available_size() == allocator.num_slots - 2  # (the 2 duplicates)


def test_no_prefix_cache_keeps_nothing() -> None:
    allocator = TokenSlotAllocator(64)
    cache = create_prefix_cache(False, allocator)
    assert isinstance(cache, NoPrefixCache) and isinstance(create_prefix_cache(True, allocator), RadixCache)
    start = allocator.available_size()
    kv = _alloc(allocator, 5)
    assert cache.insert([1, 2, 3, 4, 5], kv) == 0
    match = cache.match_prefix([1, 2, 3, 4, 5])
    assert match.kv_indices.numel() == 0 and match.kv_indices.dtype == torch.int64
    cache.lock(match.node)
    cache.unlock(match.node)
    assert cache.evict(100) == 0
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size(), cache.hit_tokens_total) == (0, 0, 0, 0)
    assert allocator.available_size() == start - 5  # insert freed nothing: the caller still owns kv
    cache.reset()
    cache.check_integrity()
    with pytest.raises(ValueError):
        cache.insert([1, 2], kv)


# ---------------------------------------------------------------------------------------- fuzz
class _Oracle:
    """Brute force: every cached prefix of whole pages (a tuple) -> the slots of its last page, and its LRU
    stamp (page size 1: a prefix per token)."""

    def __init__(self, page: int = 1) -> None:
        self.page = page
        self.slot: dict[tuple[int, ...], list[int]] = {}
        self.stamp: dict[tuple[int, ...], int] = {}
        self.clock = 0

    def _touch(self, ids: tuple[int, ...], n: int) -> None:
        for i in range(self.page, n + 1, self.page):
            self.stamp[ids[:i]] = self.clock

    def match(self, ids: tuple[int, ...]) -> list[int]:
        self.clock += 1
        n, p = 0, self.page
        while n + p <= len(ids) and ids[: n + p] in self.slot:
            n += p
        self._touch(ids, n)
        return [s for i in range(p, n + 1, p) for s in self.slot[ids[:i]]]

    def insert(self, ids: tuple[int, ...], kv: list[int]) -> int:
        already = len(self.match(ids))
        for i in range(already + self.page, len(ids) + 1, self.page):
            self.slot[ids[:i]] = kv[i - self.page : i]
        self._touch(ids, len(ids))
        return already

    def tokens(self) -> int:
        return len(self.slot) * self.page

    def slots(self) -> list[int]:
        return [s for page in self.slot.values() for s in page]


class _Req:
    def __init__(self, target: tuple[int, ...]) -> None:
        self.target = target  # every token the request will have
        self.prefix: list[int] = []  # cache-owned slots of target[:len(prefix)], locked through node
        self.node: object = None
        self.own: list[int] = []  # request-owned slots of the tokens after the prefix

    @property
    def kv_len(self) -> int:
        return len(self.prefix) + len(self.own)


class _Driver:
    """Runs the scheduler's sequence of calls on the cache and the oracle and checks them against
    each other after every call (paged: as `Scheduler._insert_into_cache` hands whole pages over)."""

    def __init__(self, seed: int, num_slots: int, page: int = 1) -> None:
        self.rng = random.Random(seed)
        self.page = page
        self.allocator = TokenSlotAllocator(num_slots, page)
        self.cache: PrefixCache = RadixCache(self.allocator)
        self.oracle = _Oracle(page)
        self.reqs: list[_Req] = []
        self.prompts: list[tuple[int, ...]] = []
        self.num_duplicates = self.num_evicted = 0

    def random_ids(self) -> tuple[int, ...]:
        rng = self.rng
        tail = tuple(rng.randrange(3) for _ in range(rng.randrange(1, 9 * self.page)))
        if self.prompts and rng.random() < 0.7:
            base = rng.choice(self.prompts)
            return base[: rng.randrange(len(base) + 1)] + tail
        self.prompts = (self.prompts + [tail])[-6:]
        return tail

    def match(self, ids: tuple[int, ...]):
        hits = self.cache.hit_tokens_total
        m = self.cache.match_prefix(list(ids))
        expected = self.oracle.match(ids)
        assert m.kv_indices.dtype == torch.int64 and m.kv_indices.tolist() == expected, ids
        assert self.cache.hit_tokens_total - hits == len(expected)
        return m

    def evict(self, num_tokens: int) -> None:
        cache, oracle = self.cache, self.oracle
        total, evictable, available = cache.total_size(), cache.evictable_size(), self.allocator.available_size()
        freed = cache.evict(num_tokens)
        remaining = set(cache.cached_kv_indices().tolist())
        evicted = {p for p, s in oracle.slot.items() if s[0] not in remaining}
        assert freed == len(evicted) * self.page == total - cache.total_size()
        assert self.allocator.available_size() == available + freed
        assert freed >= min(max(num_tokens, 0), evictable)
        assert freed >= num_tokens or cache.evictable_size() == 0
        locked = self.locked_prefixes()
        assert not evicted & locked
        stamps = [oracle.stamp[p] for p in evicted]
        for p in evicted:
            del oracle.slot[p], oracle.stamp[p]
        parents = {p[: -self.page] for p in oracle.slot}
        assert parents <= set(oracle.slot) | {()}  # only leaves went: still closed under prefixes
        leaves = [oracle.stamp[p] for p in oracle.slot if p not in parents and p not in locked]
        if stamps and leaves:
            assert max(stamps) <= min(leaves)  # least recently used first
        self.num_evicted += freed

    def alloc(self, r: _Req, n: int) -> list[int] | None:
        need = self.allocator.slots_needed(r.kv_len, n)
        short = need - self.allocator.available_size()
        if short > 0:
            self.evict(short)
        last = (r.prefix + r.own)[-1] if r.kv_len else -1
        out = self.allocator.alloc_extend([(last, n)])
        return None if out is None else out.tolist()

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        return {r.target[:i] for r in self.reqs for i in range(self.page, len(r.prefix) + 1, self.page)}

    # ---- the scheduler's moves
    def admit(self) -> None:
        r = _Req(self.random_ids())
        m = self.match(r.target)
        self.cache.lock(m.node)
        r.prefix, r.node = m.kv_indices.tolist(), m.node
        self.reqs.append(r)

    def advance(self, r: _Req) -> None:
        n = min(self.rng.randrange(1, 5 * self.page), len(r.target) - r.kv_len)
        slots = self.alloc(r, n) if n else None
        if slots is not None:
            r.own += slots

    def hand_over(self, r: _Req, finished: bool) -> None:
        end = r.kv_len - r.kv_len % self.page  # whole pages; the part-filled last one stays the request's
        ids, kv = r.target[:end], r.prefix + r.own
        already = self.cache.insert(list(ids), torch.tensor(kv[:end], dtype=torch.int64))
        assert already == self.oracle.insert(ids, kv[:end]) and already >= len(r.prefix)
        self.num_duplicates += already - len(r.prefix)
        self.allocator.free(torch.tensor(kv[len(r.prefix) : already], dtype=torch.int64))
        self.cache.unlock(r.node)
        r.prefix, r.own, r.node = [], kv[end:], None
        if finished:
            self.allocator.free(torch.tensor(r.own, dtype=torch.int64))
            self.reqs.remove(r)
            return
        m = self.match(r.target[: end + len(r.own)])  # chunked prefill goes on from the longer cached prefix
        self.cache.lock(m.node)
        r.prefix, r.node = m.kv_indices.tolist(), m.node
        assert len(r.prefix) == len(ids)

    def abort(self, r: _Req) -> None:
        self.allocator.free(torch.tensor(r.own, dtype=torch.int64))
        self.cache.unlock(r.node)
        self.reqs.remove(r)

    def step(self) -> None:
        rng, x = self.rng, self.rng.random()
        if not self.reqs or (x < 0.25 and len(self.reqs) < 4):
            self.admit()
        elif x < 0.5:
            self.advance(rng.choice(self.reqs))
        elif x < 0.6:
            self.hand_over(rng.choice(self.reqs), finished=False)
        elif x < 0.75:
            self.hand_over(rng.choice(self.reqs), finished=True)
        elif x < 0.8:
            self.abort(rng.choice(self.reqs))
        elif x < 0.9:
            self.evict(rng.randrange(-1, 12 * self.page))
        else:
            self.match(self.random_ids())
        self.check()

    def check(self) -> None:
        cache, oracle, p = self.cache, self.oracle, self.page
        cache.check_integrity()
        assert cache.total_size() == oracle.tokens()
        assert cache.protected_size() == len(self.locked_prefixes()) * p
        assert cache.evictable_size() == cache.total_size() - cache.protected_size()
        cached = cache.cached_kv_indices().tolist()
        assert sorted(cached) == sorted(oracle.slots())
        owned = [s for r in self.reqs for s in r.own]
        free = _free_slots(self.allocator)
        # every page in one place: cached whole, a request's own (its last one part-filled), or free
        pages = [s // p for s in cached if s % p == 0] + sorted({s // p for s in owned}) + [s // p for s in free if s % p == 0]
        assert len(set(pages)) == len(pages)  # no page in two places, none twice
        assert sorted(pages) == list(range(1, self.allocator.num_slots // p + 1))  # and none lost
        assert len(set(owned)) == len(owned) and not set(owned) & set(cached)


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("seed", range(6))
def test_fuzz_against_prefix_dict_oracle(seed: int, page: int) -> None:
    d = _Driver(seed, num_slots=40 * page, page=page)
    for _ in range(400 * page):
        d.step()
    for r in list(d.reqs):
        if seed % 2:
            d.hand_over(r, finished=True)
        else:
            d.abort(r)
        d.check()
    assert d.num_duplicates > 0 and d.num_evicted > 0  # the interesting paths did run
    if seed % 3:
        d.evict(10**6)
    else:
        d.cache.reset()
    assert d.cache.total_size() == 0
    assert d.allocator.available_size() == d.allocator.num_slots
