"""The request->token table and the slot allocator, token-granular and paged."""

from __future__ import annotations

import random

import pytest
import torch

from executor.memory_pool import ReqToTokenPool, TokenSlotAllocator


def test_req_to_token_rows_and_reserved_row_zero():
    pool = ReqToTokenPool(3, 16)
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [1, 2, 3] and pool.alloc() is None
    pool.write(rows[0], 2, torch.tensor([7, 8, 9]))
    assert pool.req_to_token[rows[0], 2:5].tolist() == [7, 8, 9]
    with pytest.raises(ValueError):
        pool.write(rows[0], 15, torch.tensor([1, 2]))
    pool.free(rows[1])
    with pytest.raises(ValueError):
        pool.free(rows[1])
    with pytest.raises(ValueError):
        pool.free(0)


def test_token_allocator_never_hands_out_slot_zero_and_accounts():
    a = TokenSlotAllocator(10)
    got = a.alloc(10)
    assert sorted(got.tolist()) == list(range(1, 11)) and a.alloc(1) is None
    a.free(got[:4])
    assert a.available_size() == 4 and a.alloc(5) is None


@pytest.mark.parametrize("page", [4, 64])
def test_paged_allocator_fills_pages_per_request(page):
    a = TokenSlotAllocator(page * 16, page_size=page)
    rng = random.Random(0)
    owned: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for _ in range(30):
        r = rng.randrange(3)
        n = rng.randint(1, page + 3)
        last = owned[r][-1] if owned[r] else -1
        want = a.slots_needed(len(owned[r]), n)
        before = a.available_size()
        got = a.alloc_extend([(last, n)])
        if got is None:
            assert want > before
            continue
        assert before - a.available_size() == want
        owned[r] += got.tolist()
        slots = owned[r]
        assert all(s >= page for s in slots)  # page 0 is the reserved dummy page
        for i in range(1, len(slots)):  # inside a page slots are consecutive
            if slots[i - 1] % page != page - 1:
                assert slots[i] == slots[i - 1] + 1
    pages = [{s // page for s in v} for v in owned.values()]
    assert not (pages[0] & pages[1]) and not (pages[0] & pages[2]) and not (pages[1] & pages[2])
    for v in owned.values():
        a.free(torch.tensor(v, dtype=torch.int64))
    assert a.available_size() == page * 16


def test_paged_alloc_extend_is_all_or_nothing():
    a = TokenSlotAllocator(8, page_size=4)
    assert a.alloc_extend([(-1, 4), (-1, 5)]) is None  # needs 3 pages, 2 exist
    assert a.available_size() == 8
    got = a.alloc_extend([(-1, 3), (-1, 4)])
    assert got is not None and a.available_size() == 0
    more = a.alloc_extend([(int(got[2]), 1)])  # the first request's page still has one slot
    assert more.tolist() == [int(got[2]) + 1]


def test_alloc_into_takes_what_alloc_extend_would_and_nothing_when_short():
    """A decode step's allocation without a torch call (`alloc_into`, into a memoryview) hands out the
    slots `alloc_extend` would, in the same order, also after frees; short of slots it takes none."""
    rng = random.Random(7)
    a, b = TokenSlotAllocator(40), TokenSlotAllocator(40)
    held: list[torch.Tensor] = []
    for _ in range(60):
        n = rng.randint(1, 5)
        out = torch.zeros(n, dtype=torch.int64)
        want = a.alloc_extend([(-1, n)])
        got = b.alloc_into(memoryview(out.numpy()))
        assert got == (want is not None)
        if want is None:
            assert a.available_size() == b.available_size()
            loc = held.pop(rng.randrange(len(held)))
            a.free(loc)
            b.free(loc)
            continue
        assert out.tolist() == want.tolist()
        held.append(want.clone())
    with pytest.raises(ValueError, match="page_size 1"):
        TokenSlotAllocator(16, page_size=4).alloc_into(memoryview(torch.zeros(1, dtype=torch.int64).numpy()))


def test_write_slot_records_one_slot_like_write_and_journals_it():
    pool, ref = ReqToTokenPool(3, 16), ReqToTokenPool(3, 16)
    pool.journal = []
    pool.write_slot(2, 5, 77)
    ref.write(2, 5, torch.tensor([77]))
    assert torch.equal(pool.req_to_token, ref.req_to_token)
    assert pool.journal == [(2, 5, [77])]
    for row, pos in ((2, 16), (2, -1), (-1, 0), (4, 0)):  # past the context, before it, outside the rows
        with pytest.raises(ValueError):
            pool.write_slot(row, pos, 1)
    assert torch.equal(pool.req_to_token, ref.req_to_token)
