"""llama.cpp's own CPU matrix multiply (ggml `mul_mat` on a GGUF weight, computed by ggml's thread
pool) as a kernel-level peer for `quant_linear_cpu.py`: the dense layers' decode speed against the
code llama.cpp runs for the same blocks, in the same process, alternating.

The library is the ggml that llama-cpp-python ships (`llama_cpp/lib/libggml-{base,cpu}.so`), reached
through its C API with ctypes: one small graph per weight (`y = W x`, x f32 as llama.cpp's
activations are; ggml quantizes it to its `vec_dot` type itself), planned once and computed on one
`ggml_threadpool` shared by every weight. llama-cpp-python's wheel builds ggml with OpenMP: its
graphs then run on libgomp's threads, which spin after each graph for as long as `GOMP_SPINCOUNT` says
(read when the library loads; the thread pool's pause is a no-op there), as they do between llama.cpp's
tokens. Unbounded (libgomp's default), that spin took 10-20 ms of a core after each graph on a 2-core
Zen 3 VM and slowed whatever ran next by ~20%: `settle()` after a timed pass waits it out, outside the
timing, and quant_linear_cpu.py bounds it (GOMP_SPINCOUNT=10000) before the library loads.

`GgmlPool.load()` is None when llama-cpp-python (or a symbol used here) is absent: the benchmark then
records the peer as not measured.
"""

from __future__ import annotations

import ctypes
import importlib.util
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

GGML_TYPES = {"f32": GGMLQuantizationType.F32, "bf16": GGMLQuantizationType.BF16}


def ggml_type(fmt: str) -> int:
    """The ggml type number of a weight format as `cpp_experts.LINEAR_BLOCKS` names it (q4_k -> Q4_K)."""
    return int(GGML_TYPES.get(fmt) or GGMLQuantizationType[fmt.upper()])


def lib_dir() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(next(iter(spec.submodule_search_locations))) / "lib"
    return d if (d / "libggml-cpu.so").exists() and (d / "libggml-base.so").exists() else None


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _CPlan(ctypes.Structure):  # ggml-cpu.h's struct ggml_cplan
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p), ("n_threads", ctypes.c_int),
                ("threadpool", ctypes.c_void_p), ("abort_callback", ctypes.c_void_p),
                ("abort_callback_data", ctypes.c_void_p), ("use_ref", ctypes.c_bool)]


class GgmlPool:
    """The two ggml libraries and one thread pool of `threads` threads (the caller's thread is one)."""

    def __init__(self, directory: Path, threads: int) -> None:
        self.base = ctypes.CDLL(str(directory / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(directory / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        b, c, p = self.base, self.cpu, ctypes.c_void_p
        for fn, res, args in ((b.ggml_init, p, [_InitParams]), (b.ggml_free, None, [p]),
                              (b.ggml_new_tensor_2d, p, [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
                              (b.ggml_mul_mat, p, [p, p, p]), (b.ggml_new_graph, p, [p]),
                              (b.ggml_build_forward_expand, None, [p, p]), (b.ggml_get_data, p, [p]),
                              (b.ggml_tensor_overhead, ctypes.c_size_t, []),
                              (b.ggml_graph_overhead, ctypes.c_size_t, []),
                              (b.ggml_threadpool_params_init, None, [p, ctypes.c_int]),
                              (c.ggml_cpu_init, None, []), (c.ggml_threadpool_new, p, [p]),
                              (c.ggml_threadpool_free, None, [p]), (c.ggml_threadpool_pause, None, [p]),
                              (c.ggml_threadpool_resume, None, [p]),
                              (c.ggml_graph_plan, _CPlan, [p, ctypes.c_int, p]),
                              (c.ggml_graph_compute, ctypes.c_int, [p, ctypes.POINTER(_CPlan)])):
            fn.restype, fn.argtypes = res, args
        c.ggml_cpu_init()
        self._params = ctypes.create_string_buffer(4096)  # struct ggml_threadpool_params (~530 bytes)
        b.ggml_threadpool_params_init(self._params, threads)
        self.threads = threads
        self.pool = c.ggml_threadpool_new(self._params)
        if not self.pool:
            raise RuntimeError("ggml_threadpool_new failed")
        self.paused = False

    @classmethod
    def load(cls, threads: int) -> GgmlPool | None:
        d = lib_dir()
        if d is None:
            return None
        try:
            return cls(d, threads)
        except (OSError, AttributeError):  # an older/newer ggml without one of these symbols
            return None

    def resume(self) -> None:
        if self.paused:
            self.cpu.ggml_threadpool_resume(self.pool)
            self.paused = False

    def pause(self) -> None:
        if not self.paused:
            self.cpu.ggml_threadpool_pause(self.pool)
            self.paused = True

    def settle(self, seconds: float = 0.02) -> None:
        """Pauses the pool and sleeps while its idle threads stop spinning (see the module docstring)."""
        self.pause()
        time.sleep(seconds)

    def close(self) -> None:
        if self.pool:
            self.resume()
            self.cpu.ggml_threadpool_free(self.pool)
            self.pool = None


class GgmlLinear:
    """`y = x W^T` for one weight of `n` rows of `k` inputs in GGUF blocks (`raw`: n rows of bytes), for
    each row count of x in `ms`, through ggml's `mul_mat` on `pool`: the weight is copied in once and
    every M has its own x, y and planned graph."""

    def __init__(self, pool: GgmlPool, raw: np.ndarray, fmt: str, n: int, k: int, ms: tuple[int, ...]) -> None:
        self.p, self.n, self.k = pool, n, k
        b = pool.base
        raw = np.ascontiguousarray(raw)
        mem = (raw.nbytes + sum(m * (k + n) * 4 for m in ms) + (1 + 3 * len(ms)) * b.ggml_tensor_overhead()
               + len(ms) * b.ggml_graph_overhead() + (1 << 16))
        self.ctx = b.ggml_init(_InitParams(mem, None, False))
        if not self.ctx:
            raise MemoryError(f"ggml_init({mem}) failed")
        w = b.ggml_new_tensor_2d(self.ctx, ggml_type(fmt), k, n)
        ctypes.memmove(b.ggml_get_data(w), raw.ctypes.data, raw.nbytes)
        self.graphs: dict[int, tuple[int, int, int, _CPlan, ctypes.Array]] = {}
        for m in ms:
            x = b.ggml_new_tensor_2d(self.ctx, int(GGMLQuantizationType.F32), k, m)
            y = b.ggml_mul_mat(self.ctx, w, x)
            graph = b.ggml_new_graph(self.ctx)
            b.ggml_build_forward_expand(graph, y)
            plan = pool.cpu.ggml_graph_plan(graph, pool.threads, pool.pool)
            work = ctypes.create_string_buffer(max(1, plan.work_size))
            plan.work_data = ctypes.cast(work, ctypes.c_void_p)
            self.graphs[m] = (b.ggml_get_data(x), b.ggml_get_data(y), graph, plan, work)

    def __call__(self, x: torch.Tensor) -> None:
        """Computes into ggml's output buffer (`result(m)` reads it); x: (m, k) f32, contiguous."""
        x_data, _, graph, plan, _ = self.graphs[x.shape[0]]
        ctypes.memmove(x_data, x.data_ptr(), x.numel() * 4)
        status = self.p.cpu.ggml_graph_compute(graph, ctypes.byref(plan))
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute returned {status}")

    def result(self, m: int) -> torch.Tensor:
        buf = (ctypes.c_float * (m * self.n)).from_address(self.graphs[m][1])
        return torch.frombuffer(buf, dtype=torch.float32).view(m, self.n).clone()

    def __del__(self) -> None:
        if getattr(self, "ctx", None):
            self.p.base.ggml_free(self.ctx)
            self.ctx = None
