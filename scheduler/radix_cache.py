"""Prefix cache: requests that share a prompt prefix share its KV slots (docs/architecture.md §3).

`RadixCache` is a radix tree over token ids. Each edge (a `_Node`) holds a run of token ids (`key`)
and the KV slot of each of them (`value`, int64, same length); children are keyed by the first
token of their run, so a lookup reads each token once. With the allocator's page size P > 1 (the paged
kernels' layout) the tree holds whole pages only, as SGLang's paged radix cache does: a match is cut down
to a multiple of P, children are keyed by their first page, an edge splits only between pages, and what
a caller inserts is a whole number of pages (a request's part-filled last page stays its own, freed with
it). Positions and slots then agree modulo P on every edge, so a matched prefix is a run of whole pages
that a page table reads as the request's own. `NoPrefixCache` is the do-nothing stand-in used when
caching is off.

A request's `cache_salt` (vLLM's, for tenants that must not learn each other's prompts from how fast they
come back) is folded into the first token of the keys it matches and inserts, so requests share cached
KV only with requests that bring the same salt (or, both, none).

Who owns a KV slot (read this before touching the scheduler; this is where leaks come from)
-------------------------------------------------------------------------------------------
Every usable slot is at any moment in exactly one place: the allocator's free list, the cache
(some node's `value`), or one running request (slots it allocated that the cache does not hold).
While nothing runs:  allocator.available_size() + cache.total_size() == allocator.num_slots.

1. `m = match_prefix(ids)`: `m.kv_indices` (P slots) belong to the cache. Lock `m.node` at once
   (before anything may call `evict`); the slots stay valid only while it is locked. The request
   writes them into its req_to_token row but never frees them.
2. The request allocates slots for tokens P.. itself: those are its own.
3. `n = insert(ids, kv)` with kv[:P] the matched slots and kv[P:] its own (len(ids) a multiple of the
   page size: the caller keeps its part-filled last page out of the cache). The locked path keeps
   the first P tokens cached, so n >= P. Then:
     kv[P:n]  duplicates: another request cached these tokens after our match. The cache keeps
              its own slots; ours are still ours and the caller must free them.
     kv[n:]   now the cache's. The caller must never free them.
   `insert` frees nothing and evicts nothing, so the call itself invalidates no slot. Afterwards
   unlock the old node. To keep computing (chunked prefill, n > 1 sampling), match `ids` again,
   lock the new node and rewrite the req_to_token row with its slots (positions P..n changed).
   `NoPrefixCache.insert` returns 0 and keeps nothing: all of kv[P:] (P is 0) stays the caller's,
   to free when the request finishes. This is the one place a caller must know which cache it has
   (`shares`: False for it).
4. A request dropped without caching (abort, retract) frees kv[P:] (its own), unlocks, and never
   frees kv[:P].
5. `evict` frees only unlocked leaves, straight back to the allocator; `reset` frees everything.

Locks, splits and LRU
---------------------
`lock(node)` adds one reference to node and each ancestor (the handle covers the whole path), so
`protected_size` counts every token on a locked path once. A match or insert that ends inside an
edge splits it: a new upper node takes the first part and the old node keeps the rest and its
children, so a handle held by a request still ends where its match ended. Every match/insert
stamps the nodes on its path with a counter (not the wall clock), so a parent is never older than
its children, and eviction pops the oldest unlocked leaf first; a parent left childless and
unlocked becomes a leaf and joins the queue.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from executor.memory_pool import TokenSlotAllocator


@dataclass
class PrefixMatch:
    kv_indices: torch.Tensor  # [L] int64 slots of the longest cached prefix of the query (L may be 0)
    node: object  # handle to lock/unlock (the deepest matched node)


class PrefixCache(ABC):
    """What the scheduler needs from a prefix cache; the ownership rules are in the module docstring."""

    shares = True  # whether what is inserted can be matched by other requests (False: caching off)

    def __init__(self, page_size: int = 1) -> None:
        self.page_size = page_size  # matches and inserts are whole multiples of it
        self.hit_tokens_total = 0  # sum of matched lengths over all match_prefix calls (not reset)

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int], salt: str | None = None) -> PrefixMatch:
        """Longest cached prefix of `token_ids` (whole pages) inserted with the same `salt`. Refreshes its
        LRU stamp; may split an edge."""

    @abstractmethod
    def lock(self, node: object) -> None:
        """Protects `node` and its ancestors from eviction (reference counted)."""

    @abstractmethod
    def unlock(self, node: object) -> None:
        """Undoes one `lock(node)`."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], kv_indices: torch.Tensor, salt: str | None = None) -> int:
        """Caches the KV of `token_ids` (kv_indices[i] holds token i; whole pages) and returns n, how many
        leading tokens were already cached. With P the length the caller got from `match_prefix` (and still
        holds locked): the caller frees kv_indices[P:n] (duplicates); kv_indices[n:] now belong to
        the cache. Frees nothing itself."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Frees least recently used unlocked leaves to the allocator until at least `num_tokens`
        slots are freed or nothing evictable is left; returns the number freed."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens held and not locked."""

    @abstractmethod
    def protected_size(self) -> int:
        """Tokens held on locked paths."""

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    @abstractmethod
    def reset(self) -> None:
        """Frees every cached slot. Must not be called while anything is locked."""

    def check_integrity(self) -> None:
        """Raises RuntimeError if the internal bookkeeping is inconsistent (tests, debugging)."""


Key = tuple[Any, ...]  # token ids; a salted key's first item is (salt, id)


def _as_key(token_ids: Sequence[int], salt: str | None = None) -> Key:
    """The tree's key of `token_ids`: their ints, the first paired with `salt` where there is one (no key of
    another salt, or of none, then has a first token in common with it)."""
    if isinstance(token_ids, torch.Tensor):
        key = tuple(token_ids.tolist())
    else:
        key = tuple(int(t) for t in token_ids)
    return key if salt is None or not key else ((salt, key[0]), *key[1:])


def _check_insert_args(key: Key, kv_indices: torch.Tensor) -> None:
    if kv_indices.dim() != 1 or kv_indices.numel() != len(key):
        shape = tuple(kv_indices.shape)
        raise ValueError(f"kv_indices has shape {shape}, expected [{len(key)}]: one slot per token")
    if kv_indices.dtype.is_floating_point or kv_indices.dtype.is_complex or kv_indices.dtype == torch.bool:
        raise ValueError(f"kv_indices must be an integer tensor, got {kv_indices.dtype}")


def _common_len(edge: Key, key: Key, start: int, page_size: int) -> int:
    """Length of the common prefix of `edge` and key[start:], in whole pages."""
    m = min(len(edge), len(key) - start)
    if edge[:m] == key[start : start + m]:  # the usual case, compared in C
        return m
    i = 0
    while edge[i] == key[start + i]:
        i += 1
    return i - i % page_size


class _Node:
    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access", "seq")

    def __init__(self, key: Key, value: torch.Tensor, parent: _Node | None, tick: int, seq: int) -> None:
        self.key = key  # token ids of this edge
        self.value = value  # [len(key)] int64 KV slots of those tokens
        # first token (page size 1) or first page's tokens (a tuple) of the child's key -> child
        self.children: dict[Any, _Node] = {}
        self.parent = parent  # None for the root and for evicted (detached) nodes
        self.lock_ref = 0  # locks held on this node or a descendant
        self.last_access = tick
        self.seq = seq  # creation order: a stable tie-break for equal stamps


class RadixCache(PrefixCache):
    """Radix tree over token ids in the allocator's pages (a token each at page size 1), LRU eviction of
    unlocked leaves."""

    def __init__(self, allocator: TokenSlotAllocator) -> None:
        super().__init__(allocator.page_size)
        self.allocator = allocator
        self._empty = torch.empty(0, dtype=torch.int64, device=allocator.device)
        self._clock = 0
        self._num_nodes = 0
        self._root = self._new_node((), self._empty, None)
        self._evictable = 0
        self._protected = 0

    # ------------------------------------------------------------------ lookup and insert
    def match_prefix(self, token_ids: Sequence[int], salt: str | None = None) -> PrefixMatch:
        key = _as_key(token_ids, salt)
        node, matched_len, values = self._walk(key[: len(key) - len(key) % self.page_size])
        self.hit_tokens_total += matched_len
        kv = torch.cat(values) if values else self._empty.clone()
        return PrefixMatch(kv_indices=kv, node=node)

    def insert(self, token_ids: Sequence[int], kv_indices: torch.Tensor, salt: str | None = None) -> int:
        key = _as_key(token_ids, salt)
        _check_insert_args(key, kv_indices)
        if len(key) % self.page_size:
            raise ValueError(f"{len(key)} tokens to cache: a whole number of pages of {self.page_size} is cached, "
                             "the part-filled last page stays the request's")
        node, matched_len, _ = self._walk(key)
        if matched_len < len(key):
            value = kv_indices[matched_len:].to(torch.int64).clone()  # never alias the caller's tensor
            leaf = self._new_node(key[matched_len:], value, node)
            node.children[self._first(leaf.key, 0)] = leaf
            self._evictable += len(leaf.key)
        return matched_len

    def _walk(self, key: Key) -> tuple[_Node, int, list[torch.Tensor]]:
        """Follows `key` down the tree, splitting the edge where it stops inside one, and stamps
        the path. Returns the deepest node reached, the matched length and the path's values."""
        self._clock += 1
        node, pos, values = self._root, 0, []
        while pos < len(key):
            child = node.children.get(self._first(key, pos))
            if child is None:
                break
            n = _common_len(child.key, key, pos, self.page_size)  # >= a page: children are keyed by their first one
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._clock
            values.append(child.value)
            node, pos = child, pos + n
        return node, pos, values

    def _split(self, node: _Node, n: int) -> _Node:
        """Cuts node's edge after n tokens; returns the new upper node. `node` keeps the lower part
        (and its children), so handles to it stay valid; lock counts carry over to the upper part."""
        parent = node.parent
        assert parent is not None and 0 < n < len(node.key)
        upper = self._new_node(node.key[:n], node.value[:n].clone(), parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.key, node.value = node.key[n:], node.value[n:].clone()
        node.parent = upper
        upper.children[self._first(node.key, 0)] = node
        parent.children[self._first(upper.key, 0)] = upper
        return upper

    def _first(self, key: Key, pos: int) -> Any:
        """The child key of the edge that starts at key[pos]: its token, or its page's tokens."""
        return key[pos] if self.page_size == 1 else key[pos : pos + self.page_size]

    def _new_node(self, key: Key, value: torch.Tensor, parent: _Node | None) -> _Node:
        self._num_nodes += 1
        return _Node(key, value, parent, self._clock, self._num_nodes)

    # ------------------------------------------------------------------ locks
    def lock(self, node: object) -> None:
        node = self._handle(node)
        while node is not self._root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: object) -> None:
        node = self._handle(node)
        if node is not self._root and node.lock_ref == 0:  # ancestors hold >= the node's count
            raise RuntimeError("unlock of a prefix-cache node that is not locked")
        while node is not self._root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node = node.parent

    def _handle(self, node: object) -> _Node:
        if not isinstance(node, _Node):
            raise TypeError(f"not a RadixCache node handle: {node!r}")
        if node is not self._root and node.parent is None:
            raise RuntimeError("prefix-cache node handle is stale: its tokens were evicted or the cache was reset")
        return node

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        heap = [
            (n.last_access, n.seq, n)
            for n in self._nodes()
            if not n.children and n.lock_ref == 0 and n is not self._root
        ]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[self._first(node.key, 0)]
            node.parent = None
            freed.append(node.value)
            num_freed += len(node.key)
            self._evictable -= len(node.key)
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.seq, parent))
        if freed:
            self.allocator.free(torch.cat(freed))
        return num_freed

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError(f"prefix-cache reset while {self._protected} tokens are locked")
        values = []
        for node in list(self._nodes()):
            if node is not self._root:
                values.append(node.value)
                node.parent = None  # any handle still around becomes detectably stale
            node.children = {}
        if values:
            self.allocator.free(torch.cat(values))
        self._evictable = 0

    # ------------------------------------------------------------------ sizes and checks
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def cached_kv_indices(self) -> torch.Tensor:
        """Every slot the cache holds, in no particular order (for leak hunting and tests)."""
        values = [n.value for n in self._nodes() if n is not self._root]
        return torch.cat(values) if values else self._empty.clone()

    def _nodes(self) -> Iterator[_Node]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self) -> None:
        evictable = protected = 0
        for node in self._nodes():
            locked_below = 0
            for first, child in node.children.items():
                if child.parent is not node or not child.key or self._first(child.key, 0) != first:
                    raise RuntimeError(f"radix tree: child keyed {first} is misplaced")
                if child.last_access > node.last_access and node is not self._root:
                    raise RuntimeError("radix tree: a child was used more recently than its parent")
                locked_below += child.lock_ref
            if node is self._root:
                continue
            if node.value.shape != (len(node.key),):
                raise RuntimeError(f"radix tree: {len(node.key)} tokens but value of shape {tuple(node.value.shape)}")
            p = self.page_size
            if p > 1:  # whole pages, each a run of slots from its page's first
                runs = node.value.view(-1, p) if len(node.key) % p == 0 else None
                if runs is None or (runs[:, :1] % p).any() or (runs - runs[:, :1] != torch.arange(p)).any():
                    raise RuntimeError(f"radix tree: an edge of {len(node.key)} tokens is not whole pages of {p}")
            if node.lock_ref < locked_below:
                raise RuntimeError("radix tree: a node holds fewer locks than its children together")
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        if (evictable, protected) != (self._evictable, self._protected):
            raise RuntimeError(
                f"radix tree: sizes say evictable={self._evictable} protected={self._protected}, "
                f"the tree holds evictable={evictable} protected={protected}"
            )
        slots = self.cached_kv_indices()
        if slots.unique().numel() != slots.numel():
            raise RuntimeError("radix tree: a KV slot is cached twice")


class NoPrefixCache(PrefixCache):
    """Caching turned off: matches nothing, keeps nothing, evicts nothing."""

    shares = False

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self._empty = torch.empty(0, dtype=torch.int64, device=device)

    def match_prefix(self, token_ids: Sequence[int], salt: str | None = None) -> PrefixMatch:
        return PrefixMatch(kv_indices=self._empty.clone(), node=None)

    def lock(self, node: object) -> None:
        pass

    def unlock(self, node: object) -> None:
        pass

    def insert(self, token_ids: Sequence[int], kv_indices: torch.Tensor, salt: str | None = None) -> int:
        """Keeps nothing and returns 0: every slot in kv_indices stays the caller's."""
        _check_insert_args(_as_key(token_ids), kv_indices)
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass


def create_prefix_cache(enabled: bool, allocator: TokenSlotAllocator) -> PrefixCache:
    """The cache the engine uses: a radix tree, or the do-nothing cache when prefix caching is off."""
    return RadixCache(allocator) if enabled else NoPrefixCache(allocator.device)
