"""Shared helpers for the cpp_experts tests: random experts in every weight format and the torch
fp32 reference (weights decoded by models.loader.gguf_quants, activations quantised by gguf)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import cpp_experts
from models.loader.gguf_quants import dequantize

QTYPE = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "q4_1": gguf.GGMLQuantizationType.Q4_1}


def thread_names() -> list[str]:
    """The names of this process's threads (/proc/self/task/*/comm; a thread that ends meanwhile is left out)."""
    import os

    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            pass
    return names


def extension_threads(expect: int | None = None) -> int:
    """Threads of this process the extension started: its pools' workers (`cpx-pool-N`) and its MoE
    drivers (`cpx-moe-driver`), by name, so that threads other code starts or ends meanwhile do not count.
    With `expect`, waits up to 2 s for that count: a joined thread can stay listed in /proc for a moment
    after pthread_join returns (the kernel wakes the joiner before it removes the task), which a slow
    build (AddressSanitizer) made visible."""
    import time

    def count() -> int:
        return sum(name.startswith("cpx-") for name in thread_names())

    deadline = time.monotonic() + 2.0
    while True:
        n = count()
        if expect is None or n == expect or time.monotonic() > deadline:
            return n
        time.sleep(0.005)


def available_paths() -> list[str]:
    kernels = cpp_experts.info()["kernels"]
    paths = ["portable"]
    if "avx2" in kernels:
        paths.append("avx2")
    if "avx512_bf16" in kernels or "avx512_vnni" in kernels:
        paths.append("avx512")
    if "amx" in kernels:
        paths.append("amx")
    if "amx_emulated" in kernels:
        paths.append("amx_emulated")
    if "neon_dotprod" in kernels:
        paths.append("neon_dotprod")
    return paths


def path_params() -> list:
    """Every kernel path; the ones this CPU lacks are skipped with a message."""
    have = available_paths()
    return [p if p in have else pytest.param(p, marks=pytest.mark.skip(reason=f"this CPU has no usable {p} kernels"))
            for p in ("portable", "avx2", "avx512", "amx", "amx_emulated", "neon_dotprod")]


def has_path(path: str, fmt: str) -> bool:
    """Whether `path` runs `fmt` on this CPU (the skips of path_params cover the path itself)."""
    kernels = cpp_experts.info()["kernels"]
    if path == "avx512":
        if fmt == "f32":  # forcing 'avx512' needs AVX-512; f32 then runs its AVX2 kernel
            return "avx512_bf16" in kernels or "avx512_vnni" in kernels
        return ("avx512_bf16" if fmt == "bf16" else "avx512_vnni") in kernels
    if path == "avx2":
        return "avx2" in kernels
    if path == "amx_emulated":
        return "amx_emulated" in kernels
    if path == "neon_dotprod":  # bf16 and f32 run the portable kernels under it
        return "neon_dotprod" in kernels
    return path != "amx" or "amx" in kernels


def expected_kernel(path: str, fmt: str) -> str:
    """The `kernel` string of an operator of `fmt` on a forced path (a MoE reports its experts' QuantLinears')."""
    kernels = cpp_experts.info()["kernels"]
    if path in ("portable", "avx2"):
        return path
    if path == "neon_dotprod":
        return "portable" if fmt in ("bf16", "f32") else path
    if fmt == "f32":  # its only SIMD kernel, under 'avx512' and 'amx' too
        return "avx2" if "avx2" in kernels else "portable"
    if path == "amx_emulated":
        return "amx_emulated+avx512_bf16" if fmt == "bf16" else "amx_int8_emulated+avx512_vnni"
    if fmt != "bf16":
        amx_int8 = path == "amx" and "amx_int8" in kernels
        return "amx_int8+avx512_vnni" if amx_int8 else "avx512_vnni"
    return "amx+avx512_bf16" if path == "amx" else "avx512_bf16"


class Experts:
    """E random experts; `weights[e]` = fp32 (gate, up, down) as the kernel sees them."""

    def __init__(self, fmt: str, E: int, H: int, I: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.fmt, self.E, self.H, self.I = fmt, E, H, I
        self.raw, self.weights = [], []
        for _ in range(E):
            mats = (torch.randn(I, H, generator=g) / H**0.5, torch.randn(I, H, generator=g) / H**0.5,
                    torch.randn(H, I, generator=g) / I**0.5)
            if fmt in ("bf16", "f32"):
                self.raw.append(mats)
                self.weights.append(tuple(m.bfloat16().float() if fmt == "bf16" else m for m in mats))
            else:
                blocks = [gguf.quants.quantize(m.numpy(), QTYPE[fmt]) for m in mats]
                self.raw.append(tuple(torch.from_numpy(np.ascontiguousarray(b)) for b in blocks))
                self.weights.append(tuple(dequantize(b, QTYPE[fmt], m.shape) for b, m in zip(blocks, mats)))

    def build(self, top_k: int, threads: int | None, kernel: str) -> cpp_experts.MoE:
        """An operator with these weights, bound to a pool of its own (`threads`: None = the default)."""
        moe = cpp_experts.MoE(self.E, top_k, self.H, self.I, self.fmt, kernel=kernel,
                              pool=cpp_experts.WorkerPool(threads))
        for e, (gt, up, dn) in enumerate(self.raw):
            moe.load_expert(e, gt, up, dn)
        moe.finalize()
        return moe


def q8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """x through GGUF's Q8_0 (as the kernels quantise activations), per 32 values of the last dim."""
    q = gguf.quants.quantize(x.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    return torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).copy()).reshape(x.shape)


def reference(ex: Experts, hidden: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
              quant_acts: bool) -> torch.Tensor:
    """fp32 MoE: every expert on every token, then the routing-weighted sum."""
    x = hidden.float()
    if quant_acts:
        x = q8_roundtrip(x)
    ys = []
    for gt, up, dn in ex.weights:
        h = F.silu(x @ gt.T) * (x @ up.T)
        if quant_acts:
            h = q8_roundtrip(h)
        ys.append(h @ dn.T)
    Y = torch.stack(ys)  # [E, T, H]
    T = x.shape[0]
    out = torch.zeros(T, ex.H)
    for k in range(ids.shape[1]):
        out += w[:, k : k + 1] * Y[ids[:, k].long(), torch.arange(T)]
    return out


def routing(T: int, E: int, k: int, mode: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`uniform`: distinct random experts per token, never expert 0 (an expert with no tokens);
    `skewed`: every token's first choice is expert 3 (k = 1: every token to one expert)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] + 1 for _ in range(T)])
    if mode == "skewed":
        for t in range(T):
            row = ids[t].tolist()
            if 3 in row:
                row.remove(3)
            ids[t] = torch.tensor([3] + row[: k - 1])
    w = torch.rand(T, k, generator=g) + 0.05
    return ids, w


def bf16_dot(Dv: int = 16) -> bool:
    """Whether attention over a bf16 cache with value width Dv runs the vdpbf16ps kernels here (AVX512_BF16,
    Dv a multiple of 16; MLA's is its rank): its query is rounded to bf16 and its probabilities too, so its
    results are within bf16 rounding of exact ones."""
    return bool(cpp_experts.info()["attention_bf16_dot"]) and Dv % 16 == 0


def assert_bf16_dot_close(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """The vdpbf16ps kernels against a reference given the same bf16-rounded query: what is left is the
    bf16 rounding of the probabilities. Measured on random latents and queries (MLA: 4 to 20 heads, 1 to
    ~700 keys): at most ~5e-3 and ~5e-4 root mean square; a key left out or added moves the output by
    ~1/keys everywhere, a pair of keys misplaced by far more."""
    err = (got.double() - want.double()).abs()
    assert float(err.max()) <= 1e-2 and float(err.pow(2).mean().sqrt()) <= 1e-3, (
        f"{what}: max {float(err.max()):.2e}, rms {float(err.pow(2).mean().sqrt()):.2e}")
