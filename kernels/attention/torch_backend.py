"""Reference attention backend in plain torch; runs on CPU and CUDA and is the oracle for the others.

Per forward it gathers, for every request, the KV slot indices of all its positions
(`req_to_token[row, :seq_len]`), then each layer attends request by request (extend) or in one
padded batch (decode). Scores and softmax run in fp32 whatever the cache dtype. Queries are
processed in chunks so a long prefill never materialises a [H, T, T] score tensor at once.

GQA never repeats K/V: queries are viewed as [Hkv, group, n, D] and matmul'd against [Hkv, D, L].
MLA never builds per-head K in the absorbed path: scores are two matmuls against views of the latent
buffer (c_kv columns and k_pe columns), broadcast over heads by matmul itself.

OmniKV's context bank (kernels/attention/context_bank.py): a decode step's filter layer hands the padded
view its sparse layers read to the bank, which gathers their rows (`torch_gather`); those layers then
attend over the gathered rows. Other reads of a host layer go through `read_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention.base import AttentionBackend, AttentionLayer, ForwardBatch
from kernels.attention.context_bank import read_rows, torch_gather
from kernels.attention.omnikv import FILTER


_QUERY_CHUNK = 1024


@dataclass
class _Metadata:
    kv_indices: list[torch.Tensor]  # per request (extend only): [seq_len] int64 KV slots of positions 0..seq_len-1
    starts: list[int]  # per request: first packed token
    prefix_lens: list[int]
    extend_lens: list[int]
    decode_indices: torch.Tensor | None  # [B, Lmax] slots, padded with slot 0 (decode only)
    decode_mask: torch.Tensor | None  # [B, Lmax] True where a position is valid (decode only)


def _causal_softmax_attend(
    scores: torch.Tensor, values: torch.Tensor, prefix_len: int, q_offset: int
) -> torch.Tensor:
    """scores [..., n, L] fp32; query j sits at position prefix_len + q_offset + j and sees keys <= it."""
    n, length = scores.shape[-2], scores.shape[-1]
    q_pos = torch.arange(n, device=scores.device) + prefix_len + q_offset
    k_pos = torch.arange(length, device=scores.device)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), values)


def _observe(layer: AttentionLayer, batch: ForwardBatch, q: torch.Tensor, keys: torch.Tensor) -> None:
    """At an OmniKV filter layer: hands the decode rows' queries (q [T, H, D] packed; a sparse row has
    one token) and the layer's keys [slots, Hkv, D] to the selection."""
    sparse = batch.omnikv
    if sparse is None or sparse.role(layer.layer_id) != FILTER:
        return
    starts = batch.extend_start_loc_cpu
    sparse.observe(layer.layer_id, sparse.rows, q[[starts[b] for b in sparse.rows]], keys, layer.scaling)


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, **_: object) -> None:
        self.meta: _Metadata | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = batch.req_to_token_pool.req_to_token
        kv_indices: list[torch.Tensor] = []
        decode_indices = decode_mask = None
        if not batch.forward_mode.is_decode():  # decode reads the padded table below instead
            rows = batch.req_pool_indices.tolist()
            kv_indices = [table[r, :n].to(torch.int64) for r, n in zip(rows, batch.seq_lens_cpu)]
        else:
            max_len = max(batch.seq_lens_cpu)
            lens = torch.tensor(batch.seq_lens_cpu, device=table.device)
            decode_indices = table[batch.req_pool_indices, :max_len].to(torch.int64)
            decode_mask = torch.arange(max_len, device=table.device)[None, :] < lens[:, None]
            decode_indices = decode_indices.masked_fill(~decode_mask, 0)
        self.meta = _Metadata(
            kv_indices=kv_indices,
            starts=batch.extend_start_loc_cpu,
            prefix_lens=list(batch.extend_prefix_lens_cpu),
            extend_lens=list(batch.extend_seq_lens_cpu),
            decode_indices=decode_indices,
            decode_mask=decode_mask,
        )

    def _requests(self, layer: AttentionLayer, batch: ForwardBatch):
        """Per request: KV slots it attends to, first packed token, keys before its first new token, new
        tokens. An OmniKV row at a SPARSE layer attends to its selection (its one query sees all of it)."""
        assert self.meta is not None, "init_forward_metadata must run before attention"
        m = self.meta
        sparse = batch.omnikv
        for i, (kv_idx, start, prefix, n) in enumerate(zip(m.kv_indices, m.starts, m.prefix_lens, m.extend_lens)):
            chosen = sparse.slots(layer.layer_id, i) if sparse is not None else None
            if chosen is not None:
                kv_idx, prefix = chosen.to(kv_idx.device), int(chosen.numel()) - 1
            yield kv_idx, start, prefix, n

    # ---- MHA / GQA ----
    def _gqa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, prefix: int) -> torch.Tensor:
        """q [n, H, D], k [L, Hkv, D], v [L, Hkv, Dv] -> [n, H, Dv], causal with `prefix` cached keys."""
        n, h, d = q.shape
        hkv = k.shape[1]
        qg = q.float().view(n, hkv, h // hkv, d).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
        kt = k.float().permute(1, 2, 0).unsqueeze(1)  # [Hkv, 1, D, L]
        vv = v.float().permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, L, Dv]
        outs = []
        for s in range(0, n, _QUERY_CHUNK):
            scores = torch.matmul(qg[:, :, s : s + _QUERY_CHUNK], kt) * layer.scaling
            outs.append(_causal_softmax_attend(scores, vv, prefix, s))
        out = torch.cat(outs, dim=2)  # [Hkv, G, n, Dv]
        return out.permute(2, 0, 1, 3).reshape(n, h, -1).to(q.dtype)

    def forward_extend(self, q, k, v, layer, batch):
        pool = batch.token_to_kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
        for kv_idx, start, prefix, n in self._requests(layer, batch):
            out[start : start + n] = self._gqa(q[start : start + n], read_rows(k_buf, kv_idx), read_rows(v_buf, kv_idx),
                                               layer, prefix)
        _observe(layer, batch, q, k_buf)
        return out

    def forward_decode(self, q, k, v, layer, batch):
        pool = batch.token_to_kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        if batch.omnikv is not None:
            batch.omnikv.bank_store(layer.layer_id, batch.out_cache_loc, (k, v))
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        indices, mask = self._decode_view(layer.layer_id, batch)
        b, h, d = q.shape
        hkv = k_buf.shape[1]
        banked = batch.omnikv.bank_rows(layer.layer_id) if batch.omnikv is not None else None
        k_rows, v_rows = banked if banked is not None else (read_rows(k_buf, indices), read_rows(v_buf, indices))
        keys = k_rows.float().permute(0, 2, 3, 1)  # [B, Hkv, D, L]
        vals = v_rows.float().transpose(1, 2)  # [B, Hkv, L, Dv]
        qg = q.float().view(b, hkv, h // hkv, d)  # [B, Hkv, G, D]
        scores = torch.matmul(qg, keys) * layer.scaling  # [B, Hkv, G, L]
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1), vals)  # [B, Hkv, G, Dv]
        _observe(layer, batch, q, k_buf)
        self._bank_prefetch(layer, batch)
        return out.reshape(b, h, -1).to(q.dtype)

    def _decode_view(self, layer_id: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded [B, L] KV slots and validity of a decode batch at this layer (OmniKV rows at a
        SPARSE layer: their selections)."""
        m = self.meta
        assert m is not None and m.decode_indices is not None and m.decode_mask is not None
        view = batch.omnikv.decode_view(layer_id, m.decode_indices, m.decode_mask) if batch.omnikv else None
        return view if view is not None else (m.decode_indices, m.decode_mask)

    def _bank_prefetch(self, layer: AttentionLayer, batch: ForwardBatch) -> None:
        """At a filter layer of a decode step with a context bank: the view its sparse layers read, to
        the bank (whole padded rows: padding entries are the zeroed slot 0)."""
        sparse = batch.omnikv
        if sparse is None or sparse.bank is None or sparse.role(layer.layer_id) != FILTER:
            return
        first = sparse.first_sparse(layer.layer_id)
        if first is not None:
            sparse.bank_prefetch(layer.layer_id, self._decode_view(first, batch)[0], None, torch_gather)

    # ---- MLA ----
    def set_mla_kv(self, layer, batch, c_kv, k_pe):
        batch.token_to_kv_pool.set_mla_kv(layer.layer_id, batch.out_cache_loc, c_kv, k_pe)
        if batch.omnikv is not None and batch.forward_mode.is_decode():
            batch.omnikv.bank_store_latent(layer.layer_id, batch.out_cache_loc, c_kv, k_pe)

    def forward_mla_normal(self, q, k, v, layer, batch):
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
        for _, start, prefix, n in self._requests(layer, batch):
            if prefix:
                raise ValueError("forward_mla_normal cannot attend to a cached prefix; use forward_mla_absorb")
            sl = slice(start, start + n)
            out[sl] = self._gqa(q[sl], k[sl], v[sl], layer, 0)
        return out

    def forward_mla_absorb(self, q_latent, q_pe, layer, batch):
        buf = batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        r = layer.kv_lora_rank
        if batch.forward_mode.is_decode():
            return self._mla_decode(q_latent, q_pe, buf, layer, batch)
        out = q_latent.new_empty(q_latent.shape)
        for kv_idx, start, prefix, n in self._requests(layer, batch):
            latent = read_rows(buf, kv_idx).float()  # [L, r + P]: gathered rows of the shared cache, no per-head copy
            c_kv, k_pe = latent[:, :r], latent[:, r:]
            ql = q_latent[start : start + n].float().transpose(0, 1)  # [H, n, r]
            qp = q_pe[start : start + n].float().transpose(0, 1)  # [H, n, P]
            res = []
            for s in range(0, n, _QUERY_CHUNK):
                scores = (
                    torch.matmul(ql[:, s : s + _QUERY_CHUNK], c_kv.T) + torch.matmul(qp[:, s : s + _QUERY_CHUNK], k_pe.T)
                ) * layer.scaling
                res.append(_causal_softmax_attend(scores, c_kv, prefix, s))
            out[start : start + n] = torch.cat(res, dim=1).transpose(0, 1).to(out.dtype)
        _observe(layer, batch, torch.cat([q_latent, q_pe], dim=-1), buf[:, None, :])
        return out

    def _mla_decode(self, q_latent: torch.Tensor, q_pe: torch.Tensor, buf: torch.Tensor, layer: AttentionLayer,
                    batch: ForwardBatch) -> torch.Tensor:
        """All requests at once: one query token each against its padded latent rows [B, L, r + P]."""
        indices, mask = self._decode_view(layer.layer_id, batch)
        r = layer.kv_lora_rank
        banked = batch.omnikv.bank_rows(layer.layer_id) if batch.omnikv is not None else None
        latent = (banked[0] if banked is not None else read_rows(buf, indices)).float()  # [B, L, r + P], once for all heads
        c_kv, k_pe = latent[..., :r], latent[..., r:]
        scores = (torch.matmul(q_latent.float(), c_kv.transpose(1, 2))  # [B, H, r] @ [B, r, L]
                  + torch.matmul(q_pe.float(), k_pe.transpose(1, 2))) * layer.scaling
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        _observe(layer, batch, torch.cat([q_latent, q_pe], dim=-1), buf[:, None, :])
        self._bank_prefetch(layer, batch)
        return torch.matmul(scores.softmax(dim=-1), c_kv).to(q_latent.dtype)  # [B, H, r]
