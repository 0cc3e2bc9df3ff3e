"""Routed experts of a DeepSeek-style MoE layer, and dense layers on GGUF-quantised weights
(`QuantLinear`), on the CPU: the only door into `cpp_experts._C`.

Why a native pool: decode is bound by reading expert weights, prefill by bf16/int8 dot-product
throughput; both need all cores busy without the GIL, and the model wants to run shared experts
while the routed ones compute (`submit` / `sync`). Every entry point checks dtype, device,
contiguity, rank and sizes here and raises ValueError / TypeError; the native layer checks what
needs a pass over the data (expert ids in range, finite routing weights and weight scales).

Two kinds of objects with two owners: operators (a `MoE` holds one layer's packed expert weights, a
`QuantLinear` one dense weight; made while the model loads); a `WorkerPool` holds the threads
operators compute on (made and closed by whoever runs the model). `bind(pool)` joins them; there is
no process-wide pool.

`MLASERVE_CPP_EXPERTS_KERNEL` (`amx`, `avx512`, `avx2`, `neon_dotprod`, `portable`, `amx_emulated`) forces a
code path;
`MLASERVE_CPP_EXPERTS_THREADS` sets the default thread count; `MLASERVE_CPP_EXPERTS_PIN=1` pins
workers to the process's CPUs.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

def _load_native():
    """The extension built in place, or (for `make asan`) the build named by MLASERVE_CPP_EXPERTS_LIB."""
    lib = os.environ.get("MLASERVE_CPP_EXPERTS_LIB")
    if not lib:
        from cpp_experts import _C as native

        return native
    import importlib.machinery
    import importlib.util
    import sys

    loader = importlib.machinery.ExtensionFileLoader("cpp_experts._C", lib)
    spec = importlib.util.spec_from_file_location("cpp_experts._C", lib, loader=loader)
    native = importlib.util.module_from_spec(spec)
    loader.exec_module(native)
    sys.modules["cpp_experts._C"] = native
    return native


try:
    _C = _load_native()
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "cpp_experts._C is not built: reinstall the project (`pip install -e .`) with a C++17 compiler"
    ) from exc

__all__ = ["MoE", "QuantLinear", "WorkerPool", "HostTask", "PagedAttention", "CpuModel", "DecodeInputs", "info", "cuda_host_launch_error", "FORMATS", "BLOCK_BYTES",
           "LINEAR_FORMATS", "LINEAR_BLOCKS", "sample_rows", "noise_uniforms", "row_logprobs"]

# weight formats of both operators (a MoE's experts are QuantLinears); GGUF block (values, bytes) of
# the quantised ones
FORMATS = LINEAR_FORMATS = ("bf16", "f32", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs",
                            "q3_k", "q2_k", "q5_0", "q5_1")
LINEAR_BLOCKS = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q4_k": (256, 144), "q5_k": (256, 176),
                 "q6_k": (256, 210), "iq4_nl": (32, 18), "iq4_xs": (256, 136), "q3_k": (256, 110), "q2_k": (256, 84),
                 "q5_0": (32, 22), "q5_1": (32, 24)}
BLOCK_BYTES = {fmt: size for fmt, (_, size) in LINEAR_BLOCKS.items()}  # bytes per GGUF block
# "amx_emulated": the AMX kernels' own code with the tile instructions modelled in software (needs AVX-512
# VNNI + BF16), so that they are tested on CPUs without AMX; far slower than any real path
# "neon_dotprod": aarch64's int8 kernels on SDOT (Armv8.2+); bf16 and f32 weights stay portable there
_KERNELS = ("amx", "avx512", "avx2", "neon_dotprod", "portable", "amx_emulated")


def _forced() -> str | None:
    value = os.environ.get("MLASERVE_CPP_EXPERTS_KERNEL", "").strip().lower()
    return value or None


def _chosen_kernel(fmt: str, kernels: list[str], forced: str | None) -> str:
    """The `kernel` string a QuantLinear (or a MoE's experts) of `fmt` reports on this CPU, mirroring
    quant_linear.cpp's choice; a forced path this CPU lacks is named as chosen (its constructor raises)."""
    avx2 = "avx2" if "avx2" in kernels or forced == "avx2" else "portable"
    if forced == "portable":
        return "portable"
    if "neon_dotprod" in kernels or forced == "neon_dotprod":  # aarch64: SDOT for the int8 formats only
        return "portable" if fmt in ("bf16", "f32") else "neon_dotprod"
    if fmt == "f32":  # one SIMD kernel, AVX2 (also under 'avx512' / 'amx')
        return avx2
    if fmt == "bf16":
        if forced == "avx2":
            return "avx2"
        if forced == "amx_emulated":
            return "amx_emulated+avx512_bf16"
        if "amx" in kernels and forced in (None, "amx"):
            return "amx+avx512_bf16"  # AMX tiles for every row count where usable
        return "avx512_bf16" if "avx512_bf16" in kernels or forced in ("avx512", "amx") else avx2
    if forced == "avx2":
        return "avx2"
    if forced == "amx_emulated":
        return "amx_int8_emulated+avx512_vnni"
    if "amx_int8" in kernels and forced in (None, "amx"):
        return "amx_int8+avx512_vnni"  # AMX-INT8 from 12 rows of x
    return "avx512_vnni" if "avx512_vnni" in kernels or forced in ("avx512", "amx") else avx2


def info() -> dict:
    """What the CPU offers, which kernels exist for it, and what each weight format would use (`chosen`,
    the same for QuantLinear and for a MoE's experts; `chosen_linear` is its older name);
    `attention_lanes`: the paged-attention kernels' vector width (16 in the AVX-512 build, else 8);
    `x86_paths`: whether this build has the x86 SIMD paths (False off x86: the portable kernels alone)."""
    d = dict(_C.info())
    forced = _forced()
    threads = d.pop("default_threads")
    kernels = d["kernels"]
    d["chosen"] = {fmt: _chosen_kernel(fmt, kernels, forced) for fmt in FORMATS}
    d["chosen_linear"] = d["chosen"]
    d["forced"] = forced
    d["num_threads"] = threads
    return d


def _check_tensor(name: str, t: object, rank: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {t.device}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")
    return t


class WorkerPool:
    """Worker threads that bound operators compute on (calls from several operators take turns).

    `num_threads`: default `MLASERVE_CPP_EXPERTS_THREADS`, else the CPUs this process may run on;
    `pin` (default `MLASERVE_CPP_EXPERTS_PIN=1`) pins each worker to one of those CPUs. `close()`
    joins the threads; operators still bound to a closed pool refuse to run.
    """

    def __init__(self, num_threads: int | None = None, pin: bool | None = None) -> None:
        if num_threads is not None and (not isinstance(num_threads, int) or isinstance(num_threads, bool)
                                        or num_threads <= 0):
            raise ValueError(f"num_threads must be a positive int or None, got {num_threads!r}")
        if pin is None:
            pin = os.environ.get("MLASERVE_CPP_EXPERTS_PIN", "") == "1"
        self._pool = _C.Pool(num_threads or int(_C.info()["default_threads"]), bool(pin))

    @property
    def num_threads(self) -> int:
        return int(self._pool.threads)

    @property
    def closed(self) -> bool:
        return bool(self._pool.closed)

    @property
    def solo_runs(self) -> int:
        """Runs the calling thread did alone because workers kept arriving late (a busy machine)."""
        return int(self._pool.solo_runs)

    def close(self) -> None:
        """Joins the worker threads (after the call under way, if any); idempotent."""
        self._pool.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MoE:
    """Routed experts (SiLU-gated MLPs), each three `QuantLinear`s (gate, up, down: any weight format,
    mixed as a GGUF file mixes them). Computing needs a `WorkerPool`: given here or later to `bind`.

    `set_expert` takes the three operators; `load_expert` makes them from tensors in `weight_format`:
    float tensors held as "bf16" or "f32", or raw GGUF blocks (uint8) of a quantised format.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        weight_format: str = "bf16",
        kernel: str | None = None,
        pool: WorkerPool | None = None,
    ) -> None:
        for name, v in (("num_experts", num_experts), ("top_k", top_k), ("hidden_size", hidden_size),
                        ("intermediate_size", intermediate_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if weight_format not in FORMATS:
            raise ValueError(f"weight_format must be one of {FORMATS}, got {weight_format!r}")
        kernel = kernel if kernel is not None else _forced()
        if kernel is not None and kernel not in _KERNELS + ("auto",):
            raise ValueError(f"kernel must be one of {_KERNELS} (or MLASERVE_CPP_EXPERTS_KERNEL unset), got {kernel!r}")
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.weight_format = weight_format
        self._kernel = kernel
        self._op = _C.MoE(num_experts, top_k, hidden_size, intermediate_size)
        self._pending: tuple | None = None
        self.pool: WorkerPool | None = None
        if pool is not None:
            self.bind(pool)

    def bind(self, pool: WorkerPool) -> None:
        """Computes on `pool` from now on (after a pending submit completes)."""
        if not isinstance(pool, WorkerPool):
            raise TypeError(f"pool must be a cpp_experts.WorkerPool, got {type(pool).__name__}")
        self._op.bind(pool._pool)
        self.pool = pool

    def unbind(self) -> None:
        """Lets the pool go: waits for a pending submit, ends this operator's driver thread."""
        if self._pending is not None:
            self.sync()
        self._op.unbind()
        self.pool = None

    @property
    def memory_bytes(self) -> int:
        """Bytes of packed expert weights held natively."""
        return int(self._op.memory_bytes)

    @property
    def num_threads(self) -> int:
        """Threads of the bound pool (0 when unbound)."""
        return int(self._op.threads)

    @property
    def kernel(self) -> str:
        """The kernel path of expert 0's gate (every weight picks its own, by format and CPU)."""
        return self._op.kernel

    @property
    def formats(self) -> str:
        """The weight formats the experts hold, e.g. "q4_k/q6_k"."""
        return self._op.formats

    def set_expert(self, expert: int, gate: QuantLinear, up: QuantLinear, down: QuantLinear) -> None:
        """Expert `expert`'s weights: gate and up [intermediate, hidden], down [hidden, intermediate]."""
        if not isinstance(expert, int) or not 0 <= expert < self.num_experts:
            raise ValueError(f"expert must be an int in [0, {self.num_experts}), got {expert!r}")
        for name, op in (("gate", gate), ("up", up), ("down", down)):
            if not isinstance(op, QuantLinear):
                raise TypeError(f"{name} must be a cpp_experts.QuantLinear, got {type(op).__name__}")
        self._op.set_expert(expert, gate._op, up._op, down._op)

    def load_expert(self, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """Float tensors (weight_format "bf16" or "f32"): gate/up [I, H], down [H, I]. Quantised formats:
        uint8 raw GGUF blocks in ggml row order, gate/up I rows of H values, down H rows of I (2-D or flat)."""
        if not isinstance(expert, int) or not 0 <= expert < self.num_experts:
            raise ValueError(f"expert must be an int in [0, {self.num_experts}), got {expert!r}")
        H, I = self.hidden_size, self.intermediate_size
        ops = []
        for name, t, rows, k in (("gate", gate, I, H), ("up", up, I, H), ("down", down, H, I)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            try:
                if self.weight_format in ("bf16", "f32"):
                    if not t.is_floating_point():
                        raise TypeError(f"{name} must be a float tensor for weight_format "
                                        f"{self.weight_format!r}, got {t.dtype}")
                    if tuple(t.shape) != (rows, k):
                        raise ValueError(f"expected shape {(rows, k)}, got {tuple(t.shape)}")
                    dtype = torch.float32 if self.weight_format == "f32" else torch.bfloat16
                    ops.append(QuantLinear.from_float(t, dtype=dtype, kernel=self._kernel))
                else:
                    if t.dtype != torch.uint8:
                        raise TypeError(f"{name} must hold raw {self.weight_format} blocks as torch.uint8, got {t.dtype}")
                    values, size = LINEAR_BLOCKS[self.weight_format]
                    if t.dim() == 2 and tuple(t.shape) != (rows, k // values * size):
                        raise ValueError(f"expected shape ({rows}, {k // values * size}), got {tuple(t.shape)}")
                    ops.append(QuantLinear(self.weight_format, t, rows, k, kernel=self._kernel))
            except (TypeError, ValueError) as e:
                raise type(e)(f"expert {expert} {name}: {e}") from None
        self.set_expert(expert, *ops)

    def finalize(self) -> None:
        """Checks that every expert is set."""
        self._op.finalize()

    def _args(self, hidden, topk_ids, topk_weights, out, check_values: bool = True, any_k: bool = False) -> tuple:
        """The checked arguments; `any_k`: each token may bring 1..top_k experts (an all-to-all's pairs: one)."""
        hidden = _check_tensor("hidden", hidden, 2)
        if hidden.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"hidden must be bfloat16 or float32, got {hidden.dtype}")
        T = hidden.shape[0]
        if hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [T, {self.hidden_size}], got {tuple(hidden.shape)}")
        topk_ids = _check_tensor("topk_ids", topk_ids, 2)
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
        k = topk_ids.shape[1] if any_k and 1 <= topk_ids.shape[1] <= self.top_k else self.top_k
        if tuple(topk_ids.shape) != (T, k):
            raise ValueError(f"topk_ids must be [{T}, {'1..' if any_k else ''}{self.top_k}], got {tuple(topk_ids.shape)}")
        topk_weights = _check_tensor("topk_weights", topk_weights, 2)
        if topk_weights.dtype != torch.float32:
            raise TypeError(f"topk_weights must be float32, got {topk_weights.dtype}")
        if tuple(topk_weights.shape) != (T, k):
            raise ValueError(f"topk_weights must be [{T}, {k}], got {tuple(topk_weights.shape)}")
        if topk_ids.dtype == torch.int64:
            if not check_values:
                raise TypeError("topk_ids of a host task must be int32 (its contents change after binding)")
            if T and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= self.num_experts):
                bad = topk_ids[(topk_ids < 0) | (topk_ids >= self.num_experts)][0].item()
                raise ValueError(f"topk_ids holds {bad}, out of range [0, {self.num_experts})")
            topk_ids = topk_ids.to(torch.int32)
        if out is None:
            out = torch.empty_like(hidden)
        else:
            out = _check_tensor("out", out, 2)
            if out.dtype != hidden.dtype or tuple(out.shape) != tuple(hidden.shape):
                raise ValueError(f"out must be {hidden.dtype} {tuple(hidden.shape)}, got {out.dtype} {tuple(out.shape)}")
        return hidden, topk_ids, topk_weights, out

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]); [T, H] in hidden's dtype.
        topk_ids and topk_weights are [T, k], k from 1 to top_k."""
        if self._pending is not None:
            raise RuntimeError("forward() called while a submit() is pending; call sync() first")
        h, ids, w, out = self._args(hidden, topk_ids, topk_weights, out, any_k=True)
        bf = h.dtype == torch.bfloat16
        self._op.forward(h.data_ptr(), bf, h.shape[0], ids.data_ptr(), w.data_ptr(), out.data_ptr(), bf, ids.shape[1])
        return out

    __call__ = forward

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               out: torch.Tensor | None = None) -> None:
        """Starts forward() in the background and returns at once; sync() returns its output.
        The tensors must not be modified until sync() returns."""
        if self._pending is not None:
            raise RuntimeError("submit() called while a previous submit() is pending; call sync() first")
        h, ids, w, out = self._args(hidden, topk_ids, topk_weights, out, any_k=True)
        bf = h.dtype == torch.bfloat16
        self._op.submit(h.data_ptr(), bf, h.shape[0], ids.data_ptr(), w.data_ptr(), out.data_ptr(), bf, ids.shape[1])
        self._pending = (h, ids, w, out)  # keeps the buffers alive while the native side uses them

    def sync(self) -> torch.Tensor:
        """Waits for the submitted work and returns its output."""
        if self._pending is None:
            raise RuntimeError("sync() called without a pending submit()")
        self._op.sync()
        out = self._pending[3]
        self._pending = None
        return out

    @property
    def host_failures(self) -> int:
        """How many runs of this operator's host tasks have failed so far (see `HostTask`)."""
        return int(self._op.host_failures)

    def host_task(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  out: torch.Tensor) -> HostTask:
        """Binds one call to these buffers for running from a stream (`HostTask`): each run reads their
        contents as they are then, so a captured CUDA graph can refill them and run it again. Shapes
        and dtypes are checked now (topk_ids must be int32), ids and weights on every run."""
        h, ids, w, out = self._args(hidden, topk_ids, topk_weights, out, check_values=False)
        if h.shape[0] == 0:
            raise ValueError("a host task needs at least one token")
        return HostTask(self, h, ids, w, out)

    def __del__(self) -> None:
        if getattr(self, "_pending", None) is not None:
            self._op.sync()


# ggml type ids (gguf.GGMLQuantizationType values) -> QuantLinear weight format; the float types are
# held as bf16, or as f32 when asked (`from_gguf(..., float_dtype=torch.float32)`).
_GGML_TYPES = {0: "f32", 1: "f16", 30: "bf16", 8: "q8_0", 2: "q4_0", 3: "q4_1", 12: "q4_k", 13: "q5_k", 14: "q6_k",
               20: "iq4_nl", 23: "iq4_xs", 11: "q3_k", 10: "q2_k", 6: "q5_0", 7: "q5_1"}
_FLOAT_NP = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}
_FLOAT_FORMATS = {"bf16": torch.bfloat16, "f32": torch.float32}  # QuantLinear's float formats: their dtype


def _ggml_format(ggml_type: object) -> str:
    """A ggml type (gguf.GGMLQuantizationType, its int value, or its name such as "Q4_1") -> our format name."""
    if isinstance(ggml_type, str):
        name = ggml_type.lower()
        if name in _GGML_TYPES.values():
            return name
    elif isinstance(ggml_type, int) and not isinstance(ggml_type, bool) and int(ggml_type) in _GGML_TYPES:
        return _GGML_TYPES[int(ggml_type)]
    names = ", ".join(n.upper() for n in _GGML_TYPES.values())
    raise ValueError(f"ggml type {ggml_type!r} is not supported by QuantLinear (supported: {names})")


def _byte_view(data: object, what: str) -> np.ndarray:
    """`data` (torch.Tensor, numpy array or a bytes-like object) as a flat uint8 numpy view of its bytes,
    copied only where it is not contiguous."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise ValueError(f"{what} must be on the CPU, got device {data.device}")
        if data.dtype == torch.bfloat16:  # numpy has no bf16: reinterpret its bytes first
            data = data.view(torch.int16)
        data = data.detach().contiguous().numpy()
    elif not isinstance(data, np.ndarray):
        try:
            data = np.frombuffer(memoryview(data), dtype=np.uint8)
        except TypeError:
            raise TypeError(f"{what} must be a torch.Tensor, numpy array or bytes-like object, "
                            f"got {type(data).__name__}") from None
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)



def _all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in `t`, at memory speed: one sum, which any of them makes non-finite; the exact pass
    (bf16's `isfinite` runs ~50x slower than a sum) only when the sum is not finite, as huge finite values
    can also make it."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())

class QuantLinear:
    """A dense layer `y = x @ W.T + b` on the CPU whose weight W stays in its GGUF block format.

    Why: decoding runs each linear layer on a few rows of x, so its time is the time to read W once.
    torch's eager bf16 F.linear on dequantized weights reads 2 bytes per weight at about a quarter of
    the memory bandwidth; this reads the GGUF blocks themselves (0.56 bytes per weight for Q4_0, 0.63
    for Q4_1, 1.06 for Q8_0), repacked once at construction so that one pass streams them, with int8
    dot products (AVX-512 VNNI, else AVX2's vpmaddubsw) on activations quantised per 32 values to int8
    (Q8_0, fp32 scales), as llama.cpp computes them; AMX int8 tiles from 12 rows of x where the CPU has
    them. The product is accumulated in fp32. bf16 weights ("bf16", and GGUF F16/F32/BF16 tensors by
    default) use bf16 products on x rounded to bf16 (AMX bf16 tiles for any number of rows where usable, else AVX-512 BF16,
    else fp32 FMAs on AVX2). "f32" weights (`from_float(w, dtype=torch.float32)`, or GGUF float tensors
    with `float_dtype=torch.float32`) are kept exact and multiply fp32 x (bf16 x widened) with fp32
    FMAs: the fp32 matmul up to summation order, at 4 bytes per weight.

    Make one per weight at load with `from_gguf` (raw GGUF bytes as they are in the file) or
    `from_float` (held as bf16 or f32); computing needs a `WorkerPool`, given here or to `bind` (as
    `MoE`), whose threads split the output features. `forward(x)` takes fp32 or bf16 [..., in_features]
    and returns [..., out_features] in x's dtype; several layers may share one pool (calls take turns).
    `kernel` (default `MLASERVE_CPP_EXPERTS_KERNEL`, else the best this CPU has, AMX included): "amx",
    "avx512" (AVX-512 VNNI / BF16; f32 stays on AVX2, its only SIMD kernel), "avx2" (AVX2 + FMA + F16C,
    every format), "neon_dotprod" (aarch64's SDOT, the quantised formats), "portable", or "amx_emulated" (the AMX
    kernels over a software model of the tile instructions, for testing their code on CPUs without AMX; slow). The
    choice, per format: quantised AMX-INT8 + AVX-512 VNNI > VNNI > AVX2 > portable (aarch64: NEON SDOT > portable); bf16 AMX + AVX-512 BF16 > AVX-512 BF16 > AVX2 > portable; f32 AVX2 > portable.
    """

    def __init__(self, weight_format: str, data: object, out_features: int, in_features: int, *,
                 bias: torch.Tensor | None = None, kernel: str | None = None, pool: WorkerPool | None = None) -> None:
        """Low level: `data` holds `out_features` rows of raw `weight_format` blocks, or for "bf16" /
        "f32" a [out_features, in_features] bfloat16 / float32 tensor. Prefer `from_gguf` / `from_float`."""
        for name, v in (("out_features", out_features), ("in_features", in_features)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if weight_format not in LINEAR_FORMATS:
            raise ValueError(f"weight_format must be one of {LINEAR_FORMATS}, got {weight_format!r}")
        kernel = kernel if kernel is not None else _forced()
        if kernel is not None and kernel not in _KERNELS + ("auto",):
            raise ValueError(f"kernel must be one of {_KERNELS} (or MLASERVE_CPP_EXPERTS_KERNEL unset), got {kernel!r}")
        if weight_format in _FLOAT_FORMATS:
            want = _FLOAT_FORMATS[weight_format]
            if not isinstance(data, torch.Tensor) or data.dtype != want:
                raise TypeError(f"{weight_format} weights must be a {want} tensor (use QuantLinear.from_float)")
            if tuple(data.shape) != (out_features, in_features):
                raise ValueError(f"weight must be [{out_features}, {in_features}], got {tuple(data.shape)}")
            raw = _byte_view(data, "weight")
        else:
            if isinstance(data, (torch.Tensor, np.ndarray)) and data.dtype not in (torch.uint8, torch.int8, np.uint8,
                                                                                   np.int8):
                raise TypeError(f"{weight_format} weights must be raw GGUF blocks (uint8), got dtype {data.dtype}")
            values, size = LINEAR_BLOCKS[weight_format]
            if in_features % values:
                raise ValueError(f"{weight_format} needs in_features divisible by its block size {values}, "
                                 f"got {in_features}")
            raw = _byte_view(data, "weight")
            blocks = in_features // values
            if raw.nbytes != out_features * blocks * size:
                raise ValueError(f"{weight_format} weight of {out_features} x {in_features} needs "
                                 f"{out_features * blocks * size} bytes ({out_features} rows x {blocks} blocks of "
                                 f"{size}), got {raw.nbytes}")
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
                raise TypeError(f"bias must be a float torch.Tensor, got {type(bias).__name__}")
            if tuple(bias.shape) != (out_features,):
                raise ValueError(f"bias must be [{out_features}], got {tuple(bias.shape)}")
            bias = bias.detach().to(device="cpu", dtype=torch.float32).contiguous()
            if not _all_finite(bias):
                raise ValueError("bias contains NaN or Inf")
        self.weight_format, self.out_features, self.in_features = weight_format, out_features, in_features
        self.bias = bias
        self._op = _C.QuantLinear(weight_format, out_features, in_features, raw.ctypes.data, raw.nbytes,
                                  bias.data_ptr() if bias is not None else 0, kernel or "")
        self.pool: WorkerPool | None = None
        if pool is not None:
            self.bind(pool)

    @classmethod
    def from_gguf(cls, data: object, ggml_type: object, out_features: int, in_features: int, *,
                  bias: torch.Tensor | None = None, kernel: str | None = None, pool: WorkerPool | None = None,
                  float_dtype: torch.dtype = torch.bfloat16) -> QuantLinear:
        """From a GGUF tensor as stored: `data` its bytes (e.g. `gguf.GGUFReader(...).tensors[i].data`,
        a torch uint8 tensor, or bytes), `ggml_type` its type (`tensor.tensor_type`, an int or a name
        like "Q4_1"); the tensor's ggml shape is (in_features, out_features), rows of in_features.
        `float_dtype`: how F32 / F16 / BF16 tensors are held, torch.bfloat16 (default, half the bytes)
        or torch.float32 (exact: the "f32" format)."""
        if float_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"float_dtype must be torch.bfloat16 or torch.float32, got {float_dtype!r}")
        fmt = _ggml_format(ggml_type)
        if fmt in _FLOAT_NP:
            raw = _byte_view(data, "weight")
            want = out_features * in_features * np.dtype(_FLOAT_NP[fmt]).itemsize
            if raw.nbytes != want:
                raise ValueError(f"{fmt.upper()} weight of {out_features} x {in_features} needs {want} bytes, "
                                 f"got {raw.nbytes}")
            values = torch.from_numpy(raw.view(_FLOAT_NP[fmt]).copy()).reshape(out_features, in_features)
            w = values.view(torch.bfloat16) if fmt == "bf16" else values
            return cls.from_float(w, dtype=float_dtype, bias=bias, kernel=kernel, pool=pool)
        return cls(fmt, data, out_features, in_features, bias=bias, kernel=kernel, pool=pool)

    @classmethod
    def from_float(cls, weight: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
                   kernel: str | None = None, pool: WorkerPool | None = None) -> QuantLinear:
        """From a float [out_features, in_features] tensor (an nn.Linear's weight), held as `dtype`:
        torch.bfloat16 (the "bf16" format) or torch.float32 (the "f32" format, exact for fp32 models)."""
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype!r}")
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise TypeError(f"weight must be a float torch.Tensor, got "
                            f"{weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__}")
        if weight.dim() != 2:
            raise ValueError(f"weight must be [out_features, in_features], got shape {tuple(weight.shape)}")
        w = weight.detach().to(device="cpu", dtype=dtype).contiguous()
        if not _all_finite(w):
            raise ValueError("weight contains NaN or Inf")
        fmt = "f32" if dtype == torch.float32 else "bf16"
        return cls(fmt, w, w.shape[0], w.shape[1], bias=bias, kernel=kernel, pool=pool)

    def bind(self, pool: WorkerPool) -> None:
        """Computes on `pool` from now on."""
        if not isinstance(pool, WorkerPool):
            raise TypeError(f"pool must be a cpp_experts.WorkerPool, got {type(pool).__name__}")
        self._op.bind(pool._pool)
        self.pool = pool

    def unbind(self) -> None:
        """Lets the pool go (after a call under way)."""
        self._op.unbind()
        self.pool = None

    @property
    def kernel(self) -> str:
        """The code path: "amx_int8+avx512_vnni", "avx512_vnni", "amx+avx512_bf16", "avx512_bf16", "avx2"
        (every format on the AVX2 path, and f32 on AVX-512 CPUs) or "portable"."""
        return self._op.kernel

    @property
    def memory_bytes(self) -> int:
        """Bytes held natively: the packed weight (and the bias)."""
        return int(self._op.memory_bytes)

    @property
    def num_threads(self) -> int:
        """Threads of the bound pool (0 when unbound)."""
        return int(self._op.threads)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in_features] fp32 or bf16 -> x @ W.T + b, [..., out_features] in x's dtype (into `out`,
        when given: contiguous, that shape and dtype)."""
        # Decode calls this hundreds of times per token: the checks use the cheapest tensor queries.
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        dtype, shape = x.dtype, x.shape
        if dtype is not torch.float32 and dtype is not torch.bfloat16:
            raise TypeError(f"x must be float32 or bfloat16, got {dtype}")
        if not x.is_cpu:
            raise ValueError(f"x must be on the CPU, got device {x.device}")
        if not shape or shape[-1] != self.in_features:
            raise ValueError(f"x must be [..., {self.in_features}], got shape {tuple(shape)}")
        if not x.is_contiguous():
            raise ValueError("x must be contiguous (call .contiguous())")
        out_shape = (*shape[:-1], self.out_features)
        if out is None:
            out = x.new_empty(out_shape)
        elif (not isinstance(out, torch.Tensor) or out.dtype is not dtype or out.shape != out_shape
              or not out.is_cpu or not out.is_contiguous()):
            raise ValueError(f"out must be a contiguous CPU {dtype} tensor of shape {out_shape}")
        self._op.forward(x.data_ptr(), dtype is torch.bfloat16, x.numel() // self.in_features, out.data_ptr())
        return out

    __call__ = forward

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W decoded to fp32, [*ids.shape, in_features] (an embedding lookup on the blocks)."""
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or not ids.is_cpu:
            raise TypeError("ids must be an int64 CPU tensor")
        flat = ids.reshape(-1).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            raise ValueError(f"ids must be in [0, {self.out_features})")
        out = torch.empty(flat.numel(), self.in_features)
        self._op.dequant_rows(flat.data_ptr(), flat.numel(), out.data_ptr())
        return out.reshape(*ids.shape, self.in_features)

    def set_bias(self, bias: torch.Tensor | None) -> None:
        """Replaces the bias ([out_features] float, or None for none)."""
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or tuple(bias.shape) != (
                    self.out_features,):
                raise ValueError(f"bias must be a float tensor [{self.out_features}]")
            bias = bias.detach().to(device="cpu", dtype=torch.float32).contiguous()
            if not _all_finite(bias):
                raise ValueError("bias contains NaN or Inf")
        self._op.set_bias(bias.data_ptr() if bias is not None else 0)
        self.bias = bias

    def __repr__(self) -> str:
        return (f"QuantLinear({self.weight_format}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, kernel={self.kernel!r})")


_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class HostTask:
    """One routed-expert call bound to fixed (pinned) buffers, run in two halves from a CUDA stream.

    `enqueue_submit(stream)` and `enqueue_sync(stream)` put host functions on the stream with
    `cuLaunchHostFunc`; under stream capture they become host nodes of the graph, so a replay hands
    the buffers' current contents to the pool and later waits for it, in stream order, without
    Python. The submit half returns at once, so GPU work enqueued between the two overlaps the CPU
    experts. `run_submit()` / `run_sync()` call the same native entry points on this thread.

    A failed run (expert id out of range, non-finite routing weight) cannot raise on the driver's
    thread: its sync half zeroes `out` and `take_error()` returns the message once the stream has
    been synchronized. The task, its operator and its buffers must outlive every graph that holds it.
    """

    def __init__(self, moe: MoE, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 out: torch.Tensor) -> None:
        bf = hidden.dtype == torch.bfloat16
        self.tensors = (hidden, topk_ids, topk_weights, out)  # the native task holds their addresses
        self._task = _C.HostTask(moe._op, hidden.data_ptr(), bf, hidden.shape[0], topk_ids.data_ptr(),
                                 topk_weights.data_ptr(), out.data_ptr(), bf, out.numel() * out.element_size())
        self._submit_fn, self._sync_fn = _C.host_functions()

    @property
    def runs(self) -> int:
        """Completed submit+sync pairs (failed ones included)."""
        return int(self._task.runs)

    def take_error(self) -> str | None:
        """The first failure since the last call, or None; clears it."""
        return self._task.take_error() or None

    def run_submit(self) -> None:
        _HOST_FN(self._submit_fn)(self._task.address)

    def run_sync(self) -> None:
        _HOST_FN(self._sync_fn)(self._task.address)

    def enqueue_submit(self, stream: int) -> None:
        """Queues the submit half on a CUDA stream (a `torch.cuda.Stream.cuda_stream` handle)."""
        _launch_host_func(stream, self._submit_fn, self._task.address)

    def enqueue_sync(self, stream: int) -> None:
        """Queues the sync half on a CUDA stream."""
        _launch_host_func(stream, self._sync_fn, self._task.address)


@functools.cache
def _libcuda() -> ctypes.CDLL | str:
    """The CUDA driver library with cuLaunchHostFunc bound, or why it cannot be had. The driver API
    is used (not the runtime's cudaLaunchHostFunc) because libcuda.so.1 is on every host with an
    NVIDIA driver, whichever runtime PyTorch bundles, and its streams are the runtime's streams."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchHostFunc
    except (OSError, AttributeError) as e:
        return f"the CUDA driver library has no cuLaunchHostFunc ({e})"
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuGetErrorString.restype = ctypes.c_int
    return lib


def cuda_host_launch_error() -> str | None:
    """Why host tasks cannot be queued on CUDA streams here, or None when they can."""
    lib = _libcuda()
    return lib if isinstance(lib, str) else None


def _launch_host_func(stream: int, fn: int, data: int) -> None:
    lib = _libcuda()
    if isinstance(lib, str):
        raise RuntimeError(f"cannot queue CPU experts on a CUDA stream: {lib}")
    rc = lib.cuLaunchHostFunc(ctypes.c_void_p(stream), ctypes.c_void_p(fn), ctypes.c_void_p(data))
    if rc != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"cuLaunchHostFunc failed with CUDA error {rc}: "
                           f"{(msg.value or b'unknown').decode(errors='replace')}")


class PagedAttention:
    """Attention over the paged KV pool on the CPU (decode and extend alike), on a `WorkerPool`.

    Token t of the batch belongs to the request whose `req_to_token` row is `rows[t]`, sits at
    `positions[t]`, and attends to positions 0..positions[t] of that row: the new tokens' K/V must be in
    the pool already. Pools are fp32 or bf16; arithmetic is fp32 (online softmax). One call at a time
    per object (it holds the scratch).
    """

    def __init__(self, pool: WorkerPool) -> None:
        if not isinstance(pool, WorkerPool):
            raise TypeError(f"pool must be a cpp_experts.WorkerPool, got {type(pool).__name__}")
        self.pool = pool
        self._op = _C.PagedAttention(pool._pool)

    @staticmethod
    def _tokens(q: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> int:
        _check_tensor("q", q, 3)
        if q.dtype != torch.float32:
            raise TypeError(f"q must be float32, got {q.dtype}")
        _check_tensor("req_to_token", req_to_token, 2)
        if req_to_token.dtype != torch.int32:
            raise TypeError(f"req_to_token must be int32, got {req_to_token.dtype}")
        T = q.shape[0]
        for name, t in (("rows", rows), ("positions", positions)):
            _check_tensor(name, t, 1)
            if t.dtype != torch.int64 or t.shape[0] != T:
                raise ValueError(f"{name} must be int64 [{T}], got {t.dtype} {tuple(t.shape)}")
        return T

    @staticmethod
    def _slot_lists(lists: Sequence[torch.Tensor | None] | None, T: int) -> tuple[list[int], list[int]]:
        """Addresses and lengths of per-token slot lists (int32; None: the token reads its row). The caller
        keeps `lists` referenced until the native call returns."""
        if lists is None:
            return [], []
        if len(lists) != T:
            raise ValueError(f"slot_lists must hold one entry per token ({T}), got {len(lists)}")
        ptrs, lens = [], []
        for t, s in enumerate(lists):
            if s is None:
                ptrs.append(0)
                lens.append(0)
                continue
            _check_tensor(f"slot_lists[{t}]", s, 1)
            if s.dtype != torch.int32 or s.numel() == 0:
                raise ValueError(f"slot_lists[{t}] must be a non-empty int32 tensor")
            ptrs.append(s.data_ptr())
            lens.append(int(s.numel()))
        return ptrs, lens

    @staticmethod
    def _cache(name: str, t: torch.Tensor, rank: int) -> bool:
        _check_tensor(name, t, rank)
        if t.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"{name} must be float32 or bfloat16, got {t.dtype}")
        return t.dtype == torch.bfloat16

    def gqa(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
            rows: torch.Tensor, positions: torch.Tensor, scale: float,
            slot_lists: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
        """q [T, H, D] fp32 (RoPE'd), K [slots, Hkv, D], V [slots, Hkv, Dv] -> [T, H, Dv] fp32. `slot_lists`:
        per token None, or the KV slots (int32) it attends to instead of its row's positions (OmniKV)."""
        T = self._tokens(q, req_to_token, rows, positions)
        sel, sel_n = self._slot_lists(slot_lists, T)
        bf16 = self._cache("k_buffer", k_buffer, 3)
        if self._cache("v_buffer", v_buffer, 3) != bf16:
            raise TypeError("k_buffer and v_buffer must have the same dtype")
        _, H, D = q.shape
        slots, Hkv, Dk = k_buffer.shape
        Dv = v_buffer.shape[2]
        if Dk != D or v_buffer.shape[:2] != k_buffer.shape[:2] or Hkv <= 0 or H % Hkv:
            raise ValueError(f"q {tuple(q.shape)}, K {tuple(k_buffer.shape)} and V {tuple(v_buffer.shape)} do not fit "
                             "(heads a multiple of KV heads, same D, same slots)")
        out = torch.empty(T, H, Dv)
        self._op.gqa(q.data_ptr(), T, H, Hkv, D, Dv, float(scale), k_buffer.data_ptr(), v_buffer.data_ptr(), bf16,
                     slots, req_to_token.data_ptr(), req_to_token.shape[0], req_to_token.shape[1], rows.data_ptr(),
                     positions.data_ptr(), out.data_ptr(), sel, sel_n)
        return out

    def mla(self, q: torch.Tensor, latent: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
            positions: torch.Tensor, kv_lora_rank: int, scale: float,
            slot_lists: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
        """q [T, H, r + P] fp32 (q_nope absorbed by w_kc ‖ RoPE'd q_pe) against the latent cache [slots, r + P]
        (c_kv ‖ k_pe) -> attention-weighted c_kv [T, H, r] fp32. `slot_lists` as for `gqa`."""
        T = self._tokens(q, req_to_token, rows, positions)
        sel, sel_n = self._slot_lists(slot_lists, T)
        bf16 = self._cache("latent", latent, 2)
        _, H, width = q.shape
        r = int(kv_lora_rank)
        if latent.shape[1] != width or not 0 < r <= width:
            raise ValueError(f"q {tuple(q.shape)} and latent {tuple(latent.shape)} do not fit rank {r}")
        out = torch.empty(T, H, r)
        self._op.mla(q.data_ptr(), T, H, r, width - r, float(scale), latent.data_ptr(), bf16, latent.shape[0],
                     req_to_token.data_ptr(), req_to_token.shape[0], req_to_token.shape[1], rows.data_ptr(),
                     positions.data_ptr(), out.data_ptr(), sel, sel_n)
        return out


def sample_rows(x: torch.Tensor, rows: Sequence[int], temperature: Sequence[float], top_k: Sequence[int],
                top_p: Sequence[float], log_min_p: Sequence[float], keys: Sequence[int]) -> list[int]:
    """executor/sampler.py's draw for `rows` of fp32 logits `x` [B, V] (rows may be strided, columns not):
    per row, its token, or -1 where the sampler's torch code must draw it (csrc/sample.h says when).
    `temperature` > 0, `log_min_p` -inf for none, `keys` the noise keys (`noise_seed`, 64-bit)."""
    _check_logits(x, rows)
    if any(not (t > 0.0 and math.isfinite(t)) for t in temperature):
        raise ValueError("temperatures must be positive and finite")
    if any(not 0.0 <= p <= 1.0 for p in top_p) or any(not lm <= 0.0 for lm in log_min_p):
        raise ValueError("top_p must lie in [0, 1] and log_min_p be <= 0 (or -inf)")
    return _C.sample_rows(x.data_ptr(), x.stride(0), x.shape[1], list(rows), list(temperature), list(top_k),
                          list(top_p), list(log_min_p), list(keys))


def row_logprobs(x: torch.Tensor, rows: Sequence[int], targets: Sequence[int], k: int
                 ) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """log_softmax of rows `rows` of fp32 logits `x` [B, V] (rows may be strided, columns not) at `targets`
    (a token id a row), with the row's k best (id, logprob), best first, equal logits in id order, -inf ones
    left out; None for a row the caller must compute (a NaN among its logits, or none finite)."""
    _check_logits(x, rows)
    if len(targets) != len(rows) or any(not 0 <= t < x.shape[1] for t in targets):
        raise ValueError(f"targets must hold one id in 0..{x.shape[1] - 1} per row")
    if not 0 <= k <= x.shape[1]:
        raise ValueError(f"k must lie in 0..{x.shape[1]}")
    return _C.row_logprobs(x.data_ptr(), x.stride(0), x.shape[1], list(rows), list(targets), k)


def _check_logits(x: torch.Tensor, rows: Sequence[int]) -> None:
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError("x must be a 2-D float32 CPU tensor")
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise ValueError("x's columns must be contiguous (rows may be strided, or one row repeated)")
    if not 0 < x.shape[1] < 2**31:
        raise ValueError(f"x must have 1..2^31-1 columns, got {x.shape[1]}")
    if any(not 0 <= r < x.shape[0] for r in rows):
        raise ValueError(f"rows must lie in 0..{x.shape[0] - 1}")


def noise_uniforms(keys: Sequence[int], ids: torch.Tensor | None, width: int) -> torch.Tensor:
    """The sampler's uniforms [len(keys), width] (float64): row r's at columns `ids[r]` (int64 [n, width]),
    or at 0..width-1 where `ids` is None. csrc/sample.h defines them; executor.sampler.counter_uniforms is
    the same function in torch ops."""
    n = len(keys)
    if ids is not None:
        ids = _check_tensor("ids", ids, 2)
        if ids.dtype != torch.int64 or tuple(ids.shape) != (n, width):
            raise ValueError(f"ids must be int64 [{n}, {width}], got {ids.dtype} {tuple(ids.shape)}")
    out = torch.empty(n, width, dtype=torch.float64)
    _C.noise_uniforms(list(keys), 0 if ids is None else ids.data_ptr(), width, out.data_ptr())
    return out


def _f32(name: str, t: torch.Tensor, numel: int) -> torch.Tensor:
    """t as a contiguous fp32 CPU tensor of `numel` values (a copy where it is not one already)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor")
    t = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if t.numel() != numel:
        raise ValueError(f"{name} must hold {numel} values, got shape {tuple(t.shape)}")
    return t


def _cache_tensor(name: str, t: torch.Tensor, numel: int) -> bool:
    _check_tensor(name, t, t.dim())
    if t.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{name} must be float32 or bfloat16 (the native forward reads no other cache dtype)")
    if t.numel() < numel:
        raise ValueError(f"{name} holds {t.numel()} values, the model needs {numel}")
    return t.dtype == torch.bfloat16


class DecodeInputs:
    """The inputs and logits of decode batches of `size` tokens (one per request), made once and reused:
    a decode step writes its token ids, positions, request rows and KV slots into them as Python ints
    through memoryviews (`ids_mv`, `pos_mv`, `rows_mv`, `loc_mv`; `omni_mv`: OmniKV budgets, as
    `forward`'s omni_k), and `CpuModel.forward_decode` reads them through
    pointers taken here. So no torch call runs between two decode forwards: on a CPU the forward has just
    streamed the weights through the caches, and each torch call's code and data must then come back
    from memory (the first one after a forward took ~100 us on a 2-core Zen 4 VM, a numpy item write 15).

    `views(n)` gives the first n rows of the same storage as another `DecodeInputs`, so that batches of
    every size up to `size` share one set of buffers. The logits are overwritten by the next forward that
    uses these inputs: a caller keeps two and alternates, as a CUDA graph's static output is reused."""

    def __init__(self, size: int, vocab_size: int, *, _base: DecodeInputs | None = None) -> None:
        if size < 1:
            raise ValueError(f"a decode batch needs at least one token, got {size}")
        if _base is None:
            self.input_ids, self.positions, self.rows, self.out_loc, self.omni_k = (
                torch.zeros(size, dtype=torch.int64) for _ in range(5))
            self.logit_rows = torch.arange(size, dtype=torch.int64)
            self.logits = torch.empty(size, vocab_size)
        else:
            if size > _base.size:
                raise ValueError(f"a view of {size} rows of inputs for {_base.size}")
            self.input_ids, self.positions, self.rows, self.out_loc, self.omni_k, self.logit_rows, self.logits = (
                t[:size] for t in (_base.input_ids, _base.positions, _base.rows, _base.out_loc, _base.omni_k,
                                   _base.logit_rows, _base.logits))
        self.size, self.vocab_size = size, vocab_size
        self.ids_mv, self.pos_mv, self.rows_mv, self.loc_mv, self.omni_mv = (
            memoryview(t.numpy()) for t in (self.input_ids, self.positions, self.rows, self.out_loc, self.omni_k))
        self._ptrs = (self.input_ids.data_ptr(), self.positions.data_ptr(), self.rows.data_ptr(),
                      self.out_loc.data_ptr(), self.logit_rows.data_ptr(), self.logits.data_ptr())
        self._omni_ptr = self.omni_k.data_ptr()

    def views(self, n: int) -> DecodeInputs:
        """The first `n` tokens' inputs and logits, on this object's storage."""
        return DecodeInputs(n, self.vocab_size, _base=self)


class CpuModel:
    """A whole decoder forward in one native call (see csrc/model.h): embedding, layers, final norm and
    LM head on one `WorkerPool`, over the executor's KV caches and req_to_token table.

    Built once: the constructor, `set_table`, then per layer one attention block (`add_gqa` or `add_mla`)
    followed by one MLP block (`add_dense_mlp` or `add_moe`), and optionally OmniKV's plan
    (`set_omnikv`). Every operator, cache and table given here is kept referenced by this object; the
    caches, the table and the query history must not be reallocated while it lives.
    """

    ALPHA_MODES = ("last_token", "uniform", "exponential")  # models.omnikv_config.ALPHA_MODES

    def __init__(self, pool: WorkerPool, embed: QuantLinear, lm_head: QuantLinear, final_norm: torch.Tensor,
                 eps: float) -> None:
        if not isinstance(pool, WorkerPool):
            raise TypeError(f"pool must be a cpp_experts.WorkerPool, got {type(pool).__name__}")
        self.hidden_size = embed.in_features
        self.vocab_size = lm_head.out_features
        norm = _f32("final_norm", final_norm, self.hidden_size)
        self.pool = pool
        self._keep: list[object] = [pool, embed, lm_head]
        self._op = _C.CpuModel(pool._pool, self.hidden_size, embed._op, lm_head._op, norm.data_ptr(), float(eps))
        self.num_slots = 0
        self.table_rows = 0
        self.omnikv_counts = (0, 0)  # the last forward's OmniKV (positions kept, context positions)
        self.argmax: list[int] | None = None  # the last forward's logits rows' argmax, when it was asked

    def set_table(self, req_to_token: torch.Tensor, num_slots: int) -> None:
        _check_tensor("req_to_token", req_to_token, 2)
        if req_to_token.dtype != torch.int32:
            raise TypeError(f"req_to_token must be int32, got {req_to_token.dtype}")
        self._keep.append(req_to_token)
        self.num_slots = int(num_slots)
        self.table_rows = int(req_to_token.shape[0])
        self._op.set_table(req_to_token.data_ptr(), req_to_token.shape[0], req_to_token.shape[1], self.num_slots)

    def add_gqa(self, norm: torch.Tensor, eps: float, q: QuantLinear, k: QuantLinear, v: QuantLinear, o: QuantLinear,
                *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, rope_table: torch.Tensor,
                rope_dim: int, interleaved: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, qk_eps: float = 1e-6) -> None:
        """An attention block (GQA/MHA); `rope_table` [2, positions, rope_dim / 2] fp32 (cos, sin); `q_norm`
        and `k_norm` [head_dim] (Qwen3): each query and key head RMS-normalised before RoPE."""
        norm = _f32("norm", norm, self.hidden_size)
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm come together")
        qn = _f32("q_norm", q_norm, head_dim) if q_norm is not None else None
        kn = _f32("k_norm", k_norm, head_dim) if k_norm is not None else None
        table = self._rope(rope_table, rope_dim)
        need = self.num_slots * num_kv_heads * head_dim
        bf16 = _cache_tensor("k_cache", k_cache, need)
        if _cache_tensor("v_cache", v_cache, need) != bf16:
            raise TypeError("k_cache and v_cache must have the same dtype")
        self._keep += [norm, qn, kn, q, k, v, o, table, k_cache, v_cache]
        self._op.add_gqa(norm.data_ptr(), self.hidden_size, float(eps), q._op, k._op, v._op, o._op, num_heads,
                         num_kv_heads, head_dim, float(scale), table.data_ptr(), table.shape[1], rope_dim,
                         bool(interleaved), k_cache.data_ptr(), v_cache.data_ptr(), bf16,
                         qn.data_ptr() if qn is not None else 0, kn.data_ptr() if kn is not None else 0, float(qk_eps))

    def add_mla(self, norm: torch.Tensor, eps: float, *, q: QuantLinear | None, q_a: QuantLinear | None,
                q_a_norm: torch.Tensor | None, q_a_eps: float, q_b: QuantLinear | None, kv_a: QuantLinear,
                kv_norm: torch.Tensor, kv_eps: float, w_kc: list[QuantLinear], w_vc: list[QuantLinear], o: QuantLinear,
                num_heads: int, nope_dim: int, rope_dim: int, v_dim: int, kv_lora_rank: int, scale: float,
                rope_table: torch.Tensor, interleaved: bool, latent: torch.Tensor) -> None:
        """An MLA attention block (absorbed): `w_kc[h]` [r, nope] and `w_vc[h]` [v, r] per head."""
        norm = _f32("norm", norm, self.hidden_size)
        kv_norm = _f32("kv_norm", kv_norm, kv_lora_rank)
        qa_norm = _f32("q_a_norm", q_a_norm, q_a.out_features) if q_a is not None else None
        table = self._rope(rope_table, rope_dim)
        bf16 = _cache_tensor("latent", latent, self.num_slots * (kv_lora_rank + rope_dim))
        self._keep += [norm, kv_norm, qa_norm, q, q_a, q_b, kv_a, o, table, latent, *w_kc, *w_vc]
        op = lambda m: m._op if m is not None else None  # noqa: E731
        self._op.add_mla(norm.data_ptr(), self.hidden_size, float(eps), op(q), op(q_a),
                         qa_norm.data_ptr() if qa_norm is not None else 0, float(q_a_eps), op(q_b), kv_a._op,
                         kv_norm.data_ptr(), float(kv_eps), [m._op for m in w_kc], [m._op for m in w_vc], o._op,
                         num_heads, nope_dim, rope_dim, v_dim, kv_lora_rank, float(scale), table.data_ptr(),
                         table.shape[1], bool(interleaved), latent.data_ptr(), bf16)

    def add_dense_mlp(self, norm: torch.Tensor, eps: float, gate: QuantLinear, up: QuantLinear,
                      down: QuantLinear) -> None:
        norm = _f32("norm", norm, self.hidden_size)
        self._keep += [norm, gate, up, down]
        self._op.add_dense_mlp(norm.data_ptr(), self.hidden_size, float(eps), gate._op, up._op, down._op)

    TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")

    def add_moe(self, norm: torch.Tensor, eps: float, *, router: torch.Tensor, correction_bias: torch.Tensor | None,
                top_k: int, scoring: str, topk_method: str, n_group: int, topk_group: int, norm_topk_prob: bool,
                routed_scaling_factor: float, experts: MoE, shared: tuple[QuantLinear, QuantLinear, QuantLinear] | None,
                shared_gate: torch.Tensor | None = None) -> None:
        """A MoE block: the router [E, hidden] and its top-k as models/moe_routing.py, routed `experts`
        (bound to this model's pool), shared experts (gate, up, down) or None, and Qwen2-MoE's gate on their
        output ([hidden] or [1, hidden]: the output times sigmoid(x·w)) or None."""
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring must be softmax or sigmoid, got {scoring!r}")
        if topk_method not in self.TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {self.TOPK_METHODS}, got {topk_method!r}")
        if not isinstance(experts, MoE):
            raise TypeError("experts must be a cpp_experts.MoE")
        if experts.pool is None or experts.pool._pool is not self._keep[0]._pool:
            raise ValueError("the experts must be bound to this model's pool")
        if experts.hidden_size != self.hidden_size or experts.top_k != top_k:
            raise ValueError("the experts' hidden size and top-k must match the block's")
        norm = _f32("norm", norm, self.hidden_size)
        E = experts.num_experts
        router = _f32("router", router, E * self.hidden_size)
        bias = _f32("correction_bias", correction_bias, E) if correction_bias is not None else None
        g, u, d = shared if shared is not None else (None, None, None)
        scale = _f32("shared_gate", shared_gate, self.hidden_size) if shared_gate is not None else None
        self._keep += [norm, router, bias, experts, g, u, d, scale]
        op = lambda m: m._op if m is not None else None  # noqa: E731
        self._op.add_moe(norm.data_ptr(), self.hidden_size, float(eps), router.data_ptr(),
                         bias.data_ptr() if bias is not None else 0, E, top_k, scoring == "sigmoid",
                         self.TOPK_METHODS.index(topk_method), n_group, topk_group, bool(norm_topk_prob),
                         float(routed_scaling_factor), experts._op, op(g), op(u), op(d),
                         scale.data_ptr() if scale is not None else 0)

    @staticmethod
    def _rope(table: torch.Tensor, rope_dim: int) -> torch.Tensor:
        if not isinstance(table, torch.Tensor) or table.dim() != 3 or table.shape[0] != 2 or table.shape[2] * 2 != rope_dim:
            raise ValueError(f"rope_table must be [2, positions, {rope_dim // 2}]")
        return table.detach().to(device="cpu", dtype=torch.float32).contiguous()

    @property
    def num_layers(self) -> int:
        return int(self._op.num_layers)

    def set_omnikv(self, roles: list[int], source: list[int], *, sink: int, recent: int, alpha: str,
                   history_q: torch.Tensor | None = None, history_pos: torch.Tensor | None = None) -> None:
        """OmniKV's plan (models.omnikv_config.LayerPlan: per layer FULL 0 / FILTER 1 / SPARSE 2 and the
        filter index a SPARSE layer reads), after every layer and `set_table`. The query history
        (kernels.attention.omnikv.QueryHistory): q [table rows, F, W, H, D] fp32 and pos [table rows, F, W]
        int64 (-1: empty), D the head dim (GQA) or r + P (MLA); without it only the current query counts."""
        roles, source = [int(r) for r in roles], [int(s) for s in source]
        if len(roles) != self.num_layers or len(source) != self.num_layers:
            raise ValueError(f"roles and source need {self.num_layers} entries (one per layer)")
        if alpha not in self.ALPHA_MODES:
            raise ValueError(f"alpha must be one of {', '.join(self.ALPHA_MODES)}, got {alpha!r}")
        q_ptr = pos_ptr = 0
        rows = filters = window = heads = dim = 0
        if (history_q is None) != (history_pos is None):
            raise ValueError("history_q and history_pos go together")
        if history_q is not None:
            _check_tensor("history_q", history_q, 5)
            _check_tensor("history_pos", history_pos, 3)
            if history_q.dtype != torch.float32 or history_pos.dtype != torch.int64:
                raise TypeError("history_q must be float32 and history_pos int64")
            rows, filters, window, heads, dim = history_q.shape
            if rows != self.table_rows or tuple(history_pos.shape) != (rows, filters, window):
                raise ValueError(f"history_q {tuple(history_q.shape)} and history_pos {tuple(history_pos.shape)} must be "
                                 f"[{self.table_rows} (req_to_token rows), F, W, H, D] and [{self.table_rows}, F, W]")
            self._keep += [history_q, history_pos]
            q_ptr, pos_ptr = history_q.data_ptr(), history_pos.data_ptr()
        self._op.set_omnikv(roles, source, int(sink), int(recent), self.ALPHA_MODES.index(alpha), q_ptr, pos_ptr, rows,
                            filters, window, heads, dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, out_loc: torch.Tensor,
                logit_rows: torch.Tensor, omni_k: torch.Tensor | None = None, argmax: bool = False) -> torch.Tensor:
        """Logits [N, vocab] fp32 for the token indices `logit_rows`; all index tensors int64 CPU. The
        slots `out_loc` must already be recorded in req_to_token at (rows, positions). `omni_k` [T]: each
        token's OmniKV budget, -1 where it attends fully (a token with a budget must be the only one of
        its row); `omnikv_counts` then holds the positions kept and the context positions, summed over
        filter layers and those tokens. `argmax`: `self.argmax` becomes each logits row's argmax (as
        torch's: the first of equal maxima, NaN the largest), found by the LM head's tasks as they write
        the row, so that a greedy pick need not read the logits back from the other cores' caches; else
        None."""
        T = int(input_ids.shape[0])
        named = [("input_ids", input_ids), ("positions", positions), ("rows", rows), ("out_loc", out_loc)]
        if omni_k is not None:
            named.append(("omni_k", omni_k))
        for name, t in named:
            if t.dtype != torch.int64 or t.dim() != 1 or t.shape[0] != T or not t.is_cpu or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous int64 CPU tensor [{T}]")
        if logit_rows.dtype != torch.int64 or logit_rows.dim() != 1 or not logit_rows.is_contiguous():
            raise ValueError("logit_rows must be a contiguous int64 tensor")
        N = int(logit_rows.shape[0])
        logits = torch.empty(N, self.vocab_size)
        self.omnikv_counts, self.argmax = self._op.forward(
            T, input_ids.data_ptr(), positions.data_ptr(), rows.data_ptr(), out_loc.data_ptr(), N,
            logit_rows.data_ptr(), logits.data_ptr(), omni_k.data_ptr() if omni_k is not None else 0, bool(argmax))
        return logits

    def forward_decode(self, inputs: DecodeInputs, argmax: bool = False, omnikv: bool = False) -> torch.Tensor:
        """`forward` of a decode batch whose inputs the caller wrote into `inputs` (made for this model's
        vocabulary): every token's logits, in `inputs.logits`; `omnikv`: with `inputs.omni_k` as the
        OmniKV budgets. The native forward checks the values as `forward` does (ids, slots, rows,
        positions, budgets); their dtypes and shapes are `inputs`' own."""
        if inputs.vocab_size != self.vocab_size:
            raise ValueError(f"decode inputs for a vocabulary of {inputs.vocab_size}, the model has {self.vocab_size}")
        ids, pos, rows, loc, logit_rows, logits = inputs._ptrs
        n = inputs.size
        self.omnikv_counts, self.argmax = self._op.forward(n, ids, pos, rows, loc, n, logit_rows, logits,
                                                           inputs._omni_ptr if omnikv else 0, bool(argmax))
        return inputs.logits

    @property
    def decode_program(self) -> bool:
        """Whether decode forwards of a dense GQA model (up to 3 tokens, no OmniKV token) run as one
        program of passes on every thread of the pool instead of a pool run per pass
        (csrc/model.h; on by default, the same bits either way). Benchmarks switch it to compare."""
        return bool(self._op.decode_program())

    @decode_program.setter
    def decode_program(self, on: bool) -> None:
        self._op.set_decode_program(bool(on))

    @property
    def kv_ahead(self) -> bool:
        """Whether the decode program asks for each layer's KV rows (prefetches them into L2) while the
        layer before it streams its weights (csrc/model.cpp, Program::ask_kv; on by default, the same
        bits either way). Benchmarks switch it to compare."""
        return bool(self._op.kv_ahead())

    @kv_ahead.setter
    def kv_ahead(self, on: bool) -> None:
        self._op.set_kv_ahead(bool(on))

    def set_profiling(self, on: bool) -> None:
        """Time every forward from now on phase by phase (`on`), or stop; the totals are kept until
        `profile(reset=True)`. A benchmark's tool (`bench/bench_cpu_model.py --profile`): decode passes
        are tens of microseconds, finer than a sampling profiler sees."""
        self._op.set_profiling(bool(on))

    def profile(self, reset: bool = False) -> dict[str, Any]:
        """The timed forwards so far: {"forwards", "forward_s", "program_forwards" (those run as the decode
        program, whose norms and RoPE count in the q·k·v and gate·up phases), "phases": {name: {"calls", "s",
        "pool_runs", "wait_s"}}}. A phase's seconds are its wall time on the calling thread (its serial
        work and its waits included); "wait_s" the part of it the caller spent waiting for workers after
        its own share of the phase's parallel pool runs (their imbalance). Phases: see csrc/model.h."""
        raw = self._op.profile()
        if reset:
            self._op.reset_profile()
        phases = {name: {"calls": int(d["calls"]), "s": d["ns"] / 1e9, "pool_runs": int(d["pool_runs"]),
                         "wait_s": d["wait_ns"] / 1e9} for name, d in raw["phases"].items()}
        return {"forwards": int(raw["forwards"]), "forward_s": raw["forward_ns"] / 1e9,
                "program_forwards": int(raw["program_forwards"]), "phases": phases}

    def omnikv_selection(self, f: int) -> list[torch.Tensor]:
        """The KV slots (int32, ascending positions) the last OmniKV forward kept at filter `f`, per token
        with a budget, in batch order (tests and debugging)."""
        return [torch.tensor(s, dtype=torch.int32) for s in self._op.omnikv_selection(int(f))]
