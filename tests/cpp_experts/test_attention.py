"""cpp_experts.PagedAttention against a torch fp32 reference written out here: for each token, the keys
of positions 0..pos of its request row (looked up through req_to_token), softmax(q·k · scale), then
the weighted values. Slots are handed out in shuffled order, requests are ragged (1 to ~700 keys, so
the split-KV path runs too), batches mix decode tokens with multi-token extends, heads are GQA groups
of 1..4 (and MLA's shared latent), head dims include ones that are not multiples of 8, caches fp32
and bf16."""

from __future__ import annotations

import pytest
import torch

import cpp_experts

from tests.cpp_experts.helpers import assert_bf16_dot_close, bf16_dot


@pytest.fixture(scope="module")
def attn():
    with cpp_experts.WorkerPool(2) as pool:
        yield cpp_experts.PagedAttention(pool)


def make_table(lens: list[int], slots: int, g: torch.Generator, rows: int = 8, width: int = 1024) -> torch.Tensor:
    """req_to_token with request i on row i + 1, its positions on distinct shuffled slots (never slot 0)."""
    table = torch.zeros(rows, width, dtype=torch.int32)
    perm = torch.randperm(slots - 1, generator=g) + 1
    start = 0
    for i, n in enumerate(lens):
        table[i + 1, :n] = perm[start:start + n].int()
        start += n
    return table


def batch(lens: list[int], new: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows and positions: request i's last new[i] positions (new 1 = a decode token)."""
    rows, pos = [], []
    for i, (n, k) in enumerate(zip(lens, new)):
        rows += [i + 1] * k
        pos += list(range(n - k, n))
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64)


def reference(q, keys, values, table, rows, pos, scale):
    """q [T, H, D]; keys/values: slot -> [Hkv, D] / [Hkv, Dv] fp32 (Hkv = 1 for MLA). Per request row,
    its tokens at once with a causal mask over the row's positions."""
    T, H, _ = q.shape
    out = torch.empty(T, H, values.shape[-1], dtype=torch.float64)
    for row in rows.unique().tolist():
        idx = (rows == row).nonzero().squeeze(1)
        length = int(pos[idx].max()) + 1
        slots = table[row, :length].long()
        k, v = keys[slots].double(), values[slots].double()  # [L, Hkv, D], [L, Hkv, Dv]
        group = H // k.shape[1]
        kh, vh = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = torch.einsum("thd,lhd->thl", q[idx].double(), kh) * scale
        s = s.masked_fill(torch.arange(length)[None, None, :] > pos[idx][:, None, None], float("-inf"))
        out[idx] = torch.einsum("thl,lhd->thd", s.softmax(-1), vh)
    return out.float()


def rms(x: torch.Tensor) -> float:
    return float(x.double().pow(2).mean().sqrt())


def check_gqa(got, q, K, V, table, rows, pos, scale, what, exact=None):
    """A GQA output against the reference: within 2e-5 from the fp32 kernels; from the vdpbf16ps ones (a bf16
    cache, AVX512_BF16, Dv a multiple of 16: query and probabilities rounded to bf16) close to the reference
    given the same rounded query, and, given the unrounded (K, V) `exact`, no further from the exact result
    than the cache's own rounding takes the reference (root mean square, 1.5x)."""
    want = reference(q, K.float(), V.float(), table, rows, pos, scale)
    if K.dtype == torch.float32 or not bf16_dot(V.shape[-1]):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=what)
        return
    assert_bf16_dot_close(got, reference(q.bfloat16().float(), K.float(), V.float(), table, rows, pos, scale), what)
    if exact is not None:
        unrounded = reference(q, *exact, table, rows, pos, scale)
        assert rms(got - want) <= 1.5 * rms(want - unrounded), what


CASES = [  # (request lengths, new tokens per request)
    ([1], [1]),
    ([37], [1]),
    ([700, 5, 130], [1, 1, 1]),  # decode of ragged requests: split-KV
    ([9, 64, 33], [9, 7, 1]),  # a fresh prefill, an extend over a prefix, a decode
    ([300], [300]),  # a long prefill
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("H", "Hkv", "D", "Dv"),
                         [(4, 4, 16, 16), (9, 3, 64, 64), (8, 2, 12, 20), (6, 1, 128, 128), (5, 5, 64, 64), (3, 3, 48, 32)])
def test_gqa_matches_reference(attn, dtype, H, Hkv, D, Dv):
    g = torch.Generator().manual_seed(H * 1000 + D)
    slots = 2048
    for lens, new in CASES:
        Ke, Ve = torch.randn(slots, Hkv, D, generator=g) * 2, torch.randn(slots, Hkv, Dv, generator=g)
        K, V = Ke.to(dtype), Ve.to(dtype)
        table = make_table(lens, slots, g)
        rows, pos = batch(lens, new)
        q = torch.randn(len(rows), H, D, generator=g)
        scale = D ** -0.5
        got = attn.gqa(q, K, V, table, rows, pos, scale)
        check_gqa(got, q, K, V, table, rows, pos, scale, f"{lens} {new} {dtype}", exact=(Ke, Ve))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("H", "r", "P"), [(4, 48, 8), (16, 512, 64), (20, 64, 16)])
def test_mla_matches_reference(attn, dtype, H, r, P):
    """fp32 caches, and bf16 ones where the kernel widens them: within 2e-5 of the reference. Where a bf16
    cache runs the vdpbf16ps kernel (its query and probabilities rounded to bf16): close to the reference
    given the same rounded query, and no further from the exact result on the unrounded latents than the
    cache's own rounding takes the exact reference (root mean square, 1.5x; measured 0.6-1.0x)."""
    g = torch.Generator().manual_seed(H * 100 + r)
    slots = 2048
    for lens, new in CASES:
        exact = torch.randn(slots, r + P, generator=g)
        latent = exact.to(dtype)
        table = make_table(lens, slots, g)
        rows, pos = batch(lens, new)
        q = torch.randn(len(rows), H, r + P, generator=g) / (r + P) ** 0.25
        scale = 0.1
        got = attn.mla(q, latent, table, rows, pos, r, scale)
        lat = latent.float()[:, None, :]
        want = reference(q, lat, lat[..., :r], table, rows, pos, scale)
        if dtype == torch.float32 or not bf16_dot(r):
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=f"{lens} {new} {dtype}")
            continue
        assert_bf16_dot_close(got, reference(q.bfloat16().float(), lat, lat[..., :r], table, rows, pos, scale),
                              f"{lens} {new}")
        ex = exact[:, None, :]
        unrounded = reference(q, ex, ex[..., :r], table, rows, pos, scale)
        assert rms(got - want) <= 1.5 * rms(want - unrounded), f"{lens} {new}"


def test_bad_indices_are_refused(attn):
    q = torch.randn(1, 2, 8)
    K = torch.randn(16, 2, 8)
    table = torch.zeros(4, 32, dtype=torch.int32)
    table[1, :3] = torch.tensor([1, 2, 99], dtype=torch.int32)
    with pytest.raises(ValueError, match="KV slot 99"):
        attn.gqa(q, K, K, table, torch.tensor([1]), torch.tensor([2]), 1.0)
    with pytest.raises(ValueError, match="request row 7"):
        attn.gqa(q, K, K, table, torch.tensor([7]), torch.tensor([0]), 1.0)
    with pytest.raises(ValueError, match="position 32"):
        attn.gqa(q, K, K, table, torch.tensor([1]), torch.tensor([32]), 1.0)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        attn.gqa(q, K.half(), K.half(), table, torch.tensor([1]), torch.tensor([0]), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_grouping_keeps_the_bits(attn, dtype):
    """A decode token whose key blocks keep the pool busy reads all its KV heads in one group (whole
    slots); on a pool with more threads than its blocks each KV head is a group of its own. Per query
    and key the arithmetic is the same, so the outputs are equal bit for bit."""
    g = torch.Generator().manual_seed(7)
    H, Hkv, D, slots = 9, 3, 64, 2048
    lens, new = [700, 300, 130, 5], [1, 1, 1, 1]
    K = torch.randn(slots, Hkv, D, generator=g).to(dtype)
    V = torch.randn(slots, Hkv, D, generator=g).to(dtype)
    table = make_table(lens, slots, g)
    rows, pos = batch(lens, new)
    q = torch.randn(len(rows), H, D, generator=g)
    whole = attn.gqa(q, K, V, table, rows, pos, 0.125)
    with cpp_experts.WorkerPool(24) as wide:  # 700 keys make 10 blocks: fewer than two per thread
        per_head = cpp_experts.PagedAttention(wide).gqa(q, K, V, table, rows, pos, 0.125)
    assert torch.equal(whole, per_head)
    check_gqa(whole, q, K, V, table, rows, pos, 0.125, str(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_of_decode_tokens_reads_whole_slots_with_the_bits_of_one_token(attn, dtype):
    """Alone, a decode token of 192-255 keys (3 key blocks) on 2 threads takes a group per KV head; in a
    batch of two or more tokens per thread, every token's blocks read whole slots. Each token's output
    is the same bit for bit either way."""
    g = torch.Generator().manual_seed(11)
    H, Hkv, D, slots = 9, 3, 64, 4096
    lens = [200, 255, 193, 230, 250, 210]
    K = torch.randn(slots, Hkv, D, generator=g).to(dtype)
    V = torch.randn(slots, Hkv, D, generator=g).to(dtype)
    table = make_table(lens, slots, g)
    rows, pos = batch(lens, [1] * len(lens))
    q = torch.randn(len(rows), H, D, generator=g)
    together = attn.gqa(q, K, V, table, rows, pos, 0.125)
    for i in range(len(lens)):
        alone = attn.gqa(q[i:i + 1].contiguous(), K, V, table, rows[i:i + 1], pos[i:i + 1], 0.125)
        assert torch.equal(together[i:i + 1], alone), i
    check_gqa(together, q, K, V, table, rows, pos, 0.125, str(dtype))



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", ["mla", (9, 3, 64, 64), (6, 6, 64, 64), (4, 4, 40, 24), (8, 4, 128, 128)])
def test_a_tokens_output_does_not_depend_on_where_the_batch_cut_its_request(attn, dtype, heads):
    """One request of 301 positions attended whole (a prefill), in pieces cut at random points (a cached
    prefix and chunked prefill: pieces that start anywhere, not only at multiples of 4), and one token
    at a time (decode): every token's output has the same bits each way (the engine's greedy output then
    does not depend on the prefix cache, the chunk size or the batch). The GQA shapes take both ways of
    batching queries against a key row: a token's heads (decode, SmolLM2's 3 a KV head), or one head of
    several tokens (a prefill's tokens with MHA, and with 2 heads a KV head in the AVX-512 build), with a
    head dim the kernels read in place (64, 128) and one they widen into tiles (40 / 24)."""
    g = torch.Generator().manual_seed(21)
    n, slots = 301, 1024
    table = make_table([n], slots, g)
    if heads == "mla":
        H, r, P = 4, 48, 8
        latent = torch.randn(slots, r + P, generator=g).to(dtype)
        q = torch.randn(n, H, r + P, generator=g)
        run = lambda rows, pos, qq: attn.mla(qq, latent, table, rows, pos, r, 0.1)  # noqa: E731
    else:
        H, Hkv, D, Dv = heads
        K = torch.randn(slots, Hkv, D, generator=g).to(dtype)
        V = torch.randn(slots, Hkv, Dv, generator=g).to(dtype)
        q = torch.randn(n, H, D, generator=g)
        run = lambda rows, pos, qq: attn.gqa(qq, K, V, table, rows, pos, 0.125)  # noqa: E731
    pos = torch.arange(n)
    rows = torch.ones(n, dtype=torch.int64)
    whole = run(rows, pos, q)
    for _ in range(3):
        cuts = sorted(torch.randperm(n - 1, generator=g)[:6].add(1).tolist())
        pieces = [run(rows[a:b], pos[a:b], q[a:b]) for a, b in zip([0, *cuts], [*cuts, n])]
        assert torch.equal(torch.cat(pieces), whole), cuts
    decoded = torch.cat([run(rows[t:t + 1], pos[t:t + 1], q[t:t + 1]) for t in range(0, n, 7)])
    assert torch.equal(decoded, whole[::7])


_BUILD_RUN = """
import sys, torch, cpp_experts
from tests.cpp_experts.test_attention import batch, make_table, reference
g = torch.Generator().manual_seed(11)
slots, lens, new = 2048, [700, 33, 9], [1, 1, 9]
table = make_table(lens, slots, g)
rows, pos = batch(lens, new)
out = {"lanes": cpp_experts.info()["attention_lanes"]}
with cpp_experts.WorkerPool(2) as pool:
    attn = cpp_experts.PagedAttention(pool)
    for dtype in (torch.float32, torch.bfloat16):
        for H, Hkv, D in ((9, 3, 64), (8, 2, 128), (8, 2, 20), (4, 4, 64), (8, 4, 40)):
            K = torch.randn(slots, Hkv, D, generator=g).to(dtype)
            V = torch.randn(slots, Hkv, D, generator=g).to(dtype)
            q = torch.randn(len(rows), H, D, generator=g)
            got = attn.gqa(q, K, V, table, rows, pos, 0.125)
            dot = dtype == torch.bfloat16 and cpp_experts.info()["attention_bf16_dot"] and D % 16 == 0
            qr = q.bfloat16().float() if dot else q  # the vdpbf16ps kernels round the query to bf16
            out[f"gqa {dtype} {H} {D}" + (" bf16 dot" if dot else "")] = (
                got, reference(qr, K.float(), V.float(), table, rows, pos, 0.125))
        latent = torch.randn(slots, 48 + 8, generator=g).to(dtype)
        q = torch.randn(len(rows), 4, 48 + 8, generator=g)
        lat = latent.float()[:, None, :]
        dot = dtype == torch.bfloat16 and cpp_experts.info()["attention_bf16_dot"]  # its query rounded to bf16
        qr = q.bfloat16().float() if dot else q
        out[f"mla {dtype}" + (" bf16 dot" if dot else "")] = (
            attn.mla(q, latent, table, rows, pos, 48, 0.1), reference(qr, lat, lat[..., :48], table, rows, pos, 0.1))
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif("avx512vl" not in cpp_experts.info()["cpu_flags"], reason="this CPU has no AVX-512VL")
def test_avx512_and_avx2_builds_both_match_the_reference(tmp_path):
    """Attention is one source templated on its vector width: 16 lanes in the AVX-512 build, 8 in the
    AVX2 one (their sums differ in the last bits). Where the CPU has both, the first runs, and
    MLASERVE_CPP_EXPERTS_KERNEL=avx2 takes the second (per process): each must match the reference. A bf16
    cache (MLA, and GQA with head dims that are multiples of 16) runs the vdpbf16ps kernels in the first where
    the CPU has AVX512_BF16, the fp32 ones in the second."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for build, lanes in (("default", 16), ("avx2", 8)):
        env = {k: v for k, v in os.environ.items() if k != "MLASERVE_CPP_EXPERTS_KERNEL"}
        if build == "avx2":
            env["MLASERVE_CPP_EXPERTS_KERNEL"] = "avx2"
        path = tmp_path / f"{build}.pt"
        subprocess.run([sys.executable, "-c", _BUILD_RUN, str(path)], cwd=root, env=env, check=True, timeout=300)
        out = torch.load(path)
        assert out.pop("lanes") == lanes, build
        for name, (got, want) in out.items():
            if name.endswith("bf16 dot"):  # the vdpbf16ps kernels (AVX512_BF16, not the AVX2 build)
                assert build == "default"
                assert_bf16_dot_close(got, want, f"{build}: {name}")
            else:
                torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=f"{build}: {name}")
