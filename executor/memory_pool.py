"""The KV memory managers, each with one job (docs/architecture.md §3).

* `ReqToTokenPool`      — int32 table [max_running_requests + 1, max_context_len]: row = request slot,
                          column = token position, value = KV slot index. Row 0 is reserved (padding
                          for CUDA-graph dummy requests), so usable rows are 1..size.
* `TokenSlotAllocator`  — hands out KV slot indices; slot indices 0..page_size-1 are a reserved dummy
                          page that padded writes may target, so usable slots are page_size..
* `MLATokenToKVPool`    — per layer [num_slots + page_size, kv_lora_rank + qk_rope_head_dim]: the first
                          `kv_lora_rank` columns hold the normalised latent c_kv (also the "value"),
                          the rest the RoPE'd k_pe. Nothing per-head is cached.
* `MHATokenToKVPool`    — per layer K and V [num_slots + page_size, num_kv_heads, head_dim].

Pools hold tensors only; which request owns which slot is the scheduler's business.

Host layers (OmniKV's context bank, `host_layers`): the listed layers' buffers live in host memory
(pinned on a GPU host, so the device reads and writes them directly) while the others stay on the
device; a slot still names one token in every layer, so allocation, prefix sharing and freeing are
the same for both. Writes from the device to a host layer go through `_store_rows`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch


def _kv_buffer(shape: tuple[int, ...], page_size: int, dtype: torch.dtype, device: torch.device | str,
               host: bool = False) -> torch.Tensor:
    """Uninitialised KV storage (pages are committed by the OS as they are first written, so a
    large pool starts instantly), except the reserved dummy page, zeroed: padded reads land there.
    `host`: in host memory instead of on `device` (pinned where `device` is a GPU)."""
    if host:
        buf = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=torch.device(device).type == "cuda")
    else:
        buf = torch.empty(shape, dtype=dtype, device=device)
    buf[:page_size].zero_()
    return buf


def _store_rows(buf: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
    """buf[loc] = rows, for a buffer on the rows' device or a host layer's (a copy to the host first)."""
    if buf.device != loc.device:
        loc, rows = loc.to(buf.device), rows.to(buf.device)
    buf[loc] = rows.to(buf.dtype)


class ReqToTokenPool:
    """Maps (request slot, position) -> KV slot index."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32, device=device)
        # on the CPU, writes go through a numpy view of the table: a decode step's one write then costs a
        # fraction of torch's indexing, whose code a forward streaming the weights has evicted by then
        self._table_np = self.req_to_token.numpy() if self.req_to_token.device.type == "cpu" else None
        self._table_mv = memoryview(self._table_np) if self._table_np is not None else None
        self._free = list(range(1, size + 1))
        # per-row state kept beside the table (OmniKV's query window): cleared when a row changes hands
        self.on_alloc: list[Callable[[int], None]] = []
        # while a list: every write is also appended here as (row, start, slots), for the ranks that
        # mirror this table under tensor parallelism (executor.distributed)
        self.journal: list[tuple[int, int, list[int]]] | None = None

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """One request slot, or None when all are taken."""
        if not self._free:
            return None
        row = self._free.pop(0)
        for clear in self.on_alloc:
            clear(row)
        return row

    def free(self, req_pool_idx: int) -> None:
        if not 1 <= req_pool_idx <= self.size or req_pool_idx in self._free:
            raise ValueError(f"request slot {req_pool_idx} is not allocated")
        self._free.append(req_pool_idx)

    def write(self, req_pool_idx: int, start: int, kv_loc: torch.Tensor) -> None:
        """Records KV slots `kv_loc` for positions start..start+len-1 of a request."""
        end = start + kv_loc.numel()
        if end > self.max_context_len:
            raise ValueError(f"position {end - 1} exceeds max_context_len {self.max_context_len}")
        if self._table_np is not None and kv_loc.device.type == "cpu":
            self._table_np[req_pool_idx, start:end] = kv_loc.numpy()
        else:
            self.req_to_token[req_pool_idx, start:end] = kv_loc.to(torch.int32)
        if self.journal is not None:
            self.journal.append((req_pool_idx, start, kv_loc.tolist()))

    def check_slot(self, req_pool_idx: int, pos: int) -> None:
        """Raises ValueError unless (request slot, position) is a cell of the table."""
        if not 0 <= pos < self.max_context_len:
            raise ValueError(f"position {pos} exceeds max_context_len {self.max_context_len}")
        if not 0 <= req_pool_idx <= self.size:
            raise ValueError(f"request slot {req_pool_idx} is outside the table")

    def write_slot(self, req_pool_idx: int, pos: int, slot: int) -> None:
        """Records one KV slot (a decode token's) at position `pos`: `write` without a torch call (CPU)."""
        self.check_slot(req_pool_idx, pos)
        if self._table_mv is None:
            self.req_to_token[req_pool_idx, pos] = slot
        else:
            self._table_mv[req_pool_idx, pos] = slot
        if self.journal is not None:
            self.journal.append((req_pool_idx, pos, [slot]))


class TokenSlotAllocator:
    """Hands out KV slot indices, a token (page_size 1) or a page at a time.

    Paged (page_size P > 1, for kernels that read the cache in P-token pages): a request's tokens
    fill its last page before it gets a new one, so its slots are P-aligned runs; a page belongs to
    one request only and returns to the free list when that request frees its slots. Page 0 (slots
    0..P-1) is the reserved dummy page.
    """

    def __init__(self, num_slots: int, page_size: int = 1, device: torch.device | str = "cpu") -> None:
        if page_size < 1 or num_slots % page_size:
            raise ValueError(f"num_slots {num_slots} must be a positive multiple of page_size {page_size}")
        self.num_slots = num_slots
        self.page_size = page_size
        self.device = device
        self._on_cpu = torch.device(device).type == "cpu"
        # free slots (page_size 1) or free page numbers (paged), page 0 reserved: _free[_head:]. Taking
        # from the front moves _head (one slice per allocation, not two: each torch call a decode step
        # makes costs tens of microseconds on a CPU, its code evicted by the weights the forward streamed)
        self._free = torch.arange(1, num_slots // page_size + 1, dtype=torch.int64)
        self._head = 0
        self._len = num_slots // page_size  # _free's length, kept as an int: the scheduler asks every step
        self._free_mv = self._items(self._free)

    def _items(self, free: torch.Tensor) -> memoryview | None:
        """The free list's items for `alloc_into` (on the CPU; page_size 1): plain item reads, no torch call."""
        return memoryview(free.numpy()) if self._on_cpu and self.page_size == 1 else None

    def available_size(self) -> int:
        """Free slots in whole free pages (a request's part-filled last page is not counted)."""
        return (self._len - self._head) * self.page_size

    def slots_needed(self, prefix_len: int, n: int) -> int:
        """Slots taken from the free list by `n` new tokens after `prefix_len` cached ones."""
        if self.page_size == 1:
            return n
        room = (-prefix_len) % self.page_size  # left in the last page
        return -(-max(0, n - room) // self.page_size) * self.page_size

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` fresh slots (page_size 1), or None when not enough are free."""
        return self.alloc_extend([(-1, n)])

    def alloc_extend(self, requests: list[tuple[int, int]]) -> torch.Tensor | None:
        """Slots for several requests at once: (slot of the request's last cached token or -1, count).
        Returns the slots concatenated in request order, or None (nothing taken) when short."""
        p = self.page_size
        h = self._head
        if p == 1:
            n = sum(c for _, c in requests)
            if n > self._len - h:
                return None
            out = self._free[h:h + n]
            self._head = h + n
            return out if self._on_cpu else out.to(self.device)
        pages_needed = sum(self.slots_needed(0 if last < 0 else last % p + 1, c) // p for last, c in requests)
        if pages_needed > self._len - h:
            return None
        pages = self._free[h:h + pages_needed].tolist()
        self._head = h + pages_needed
        out: list[int] = []
        for last, count in requests:
            nxt = last + 1 if last >= 0 and (last + 1) % p else None  # continue the last page if it has room
            for _ in range(count):
                if nxt is None:
                    nxt = pages.pop(0) * p
                out.append(nxt)
                nxt = nxt + 1 if (nxt + 1) % p else None
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def alloc_into(self, out: memoryview) -> bool:
        """Fills `out` (int64 items, as `cpp_experts.DecodeInputs.loc_mv`) with fresh slots, or returns False
        (nothing taken) when not enough are free. CPU, page_size 1: a decode step's allocation without a
        torch call."""
        if self._free_mv is None:
            raise ValueError("alloc_into takes slots on the CPU with page_size 1; use alloc_extend")
        h, n = self._head, len(out)
        if n > self._len - h:
            return False
        out[:] = self._free_mv[h:h + n]
        self._head = h + n
        return True

    def free(self, loc: torch.Tensor) -> None:
        """Returns slots (page_size 1) or the pages they lie on (paged: the caller owns whole pages)."""
        if not loc.numel():
            return
        loc = loc.detach().to("cpu", torch.int64)
        if self.page_size > 1:
            loc = torch.unique(loc // self.page_size)
        # to the front: the next allocation reuses the slots freed last, whose pages are already touched, so a
        # CPU cache's resident memory follows the tokens held at once, not every slot ever handed out
        self._free = torch.cat([loc, self._free[self._head:]])
        self._head = 0
        self._len = int(self._free.numel())
        self._free_mv = self._items(self._free)


class MLATokenToKVPool:
    """Latent KV cache: one [num_slots + page_size, kv_lora_rank + rope_dim] buffer per layer."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        page_size: int = 1,
        host_layers: Collection[int] = (),
    ) -> None:
        self.num_slots = num_slots
        self.page_size = page_size
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.dtype = dtype
        self.host_layers = frozenset(host_layers)
        self.kv_buffer = [
            _kv_buffer((num_slots + page_size, kv_lora_rank + qk_rope_head_dim), page_size, dtype, device,
                       i in self.host_layers)
            for i in range(num_layers)
        ]

    def bytes_per_token(self) -> int:
        """Every layer's bytes of one token, wherever they are held."""
        return len(self.kv_buffer) * (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_buffer[0].element_size()

    def host_bytes_per_token(self) -> int:
        """The host layers' share of `bytes_per_token` (the device holds the rest)."""
        return self.bytes_per_token() * len(self.host_layers) // len(self.kv_buffer)

    def layer_buffers(self, layer_id: int) -> tuple[torch.Tensor, ...]:
        """The layer's buffers, as the context bank gathers them: (latent,)."""
        return (self.kv_buffer[layer_id],)

    def get_kv_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id]

    def set_mla_kv(self, layer_id: int, loc: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Stores latent c_kv [T, kv_lora_rank] and k_pe [T, rope_dim] at slots `loc` [T]."""
        buf = self.kv_buffer[layer_id]
        if buf.device != loc.device:  # a host layer: one copy of whole rows
            _store_rows(buf, loc, torch.cat([c_kv.to(self.dtype), k_pe.reshape(k_pe.shape[0], -1).to(self.dtype)], -1))
            return
        buf[loc, : self.kv_lora_rank] = c_kv.to(self.dtype)
        buf[loc, self.kv_lora_rank :] = k_pe.reshape(k_pe.shape[0], -1).to(self.dtype)


class MHATokenToKVPool:
    """Per-head KV cache for GQA/MHA models: K and V [num_slots + page_size, num_kv_heads, head_dim]."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        page_size: int = 1,
        v_head_dim: int | None = None,
        host_layers: Collection[int] = (),
    ) -> None:
        self.num_slots = num_slots
        self.page_size = page_size
        self.dtype = dtype
        self.host_layers = frozenset(host_layers)
        shape = (num_slots + page_size, num_kv_heads)
        self.k_buffer = [_kv_buffer((*shape, head_dim), page_size, dtype, device, i in self.host_layers)
                         for i in range(num_layers)]
        self.v_buffer = [_kv_buffer((*shape, v_head_dim or head_dim), page_size, dtype, device, i in self.host_layers)
                         for i in range(num_layers)]

    def bytes_per_token(self) -> int:
        """Every layer's bytes of one token, wherever they are held."""
        k, v = self.k_buffer[0], self.v_buffer[0]
        return len(self.k_buffer) * (k[0].numel() + v[0].numel()) * k.element_size()

    def host_bytes_per_token(self) -> int:
        """The host layers' share of `bytes_per_token` (the device holds the rest)."""
        return self.bytes_per_token() * len(self.host_layers) // len(self.k_buffer)

    def layer_buffers(self, layer_id: int) -> tuple[torch.Tensor, ...]:
        """The layer's buffers, as the context bank gathers them: (K, V)."""
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        _store_rows(self.k_buffer[layer_id], loc, k)
        _store_rows(self.v_buffer[layer_id], loc, v)


KVPool = MLATokenToKVPool | MHATokenToKVPool
