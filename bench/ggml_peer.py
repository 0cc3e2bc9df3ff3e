"""llama.cpp's own CPU matrix multiply (ggml `mul_mat` on a GGUF weight) as a kernel-level peer for
`quant_linear_cpu.py` and an oracle for the kernel tests: the dense layers against the code llama.cpp
runs for the same blocks, in the same process.

The library is the ggml that llama-cpp-python ships (`llama_cpp/lib/libggml-{base,cpu}.so`), reached
through its C API with ctypes, the way llama.cpp's runtime uses it: a CPU backend of the given threads,
one small graph per weight (`y = W x`, x f32 as llama.cpp's activations are; ggml rounds it to its
`vec_dot` type itself), and the weight in the CPU device's repacking buffer ("CPU_REPACK") where
llama.cpp would put it there: on AVX2 that is Q4_0, Q4_K and IQ4_NL, interleaved 8 rows at a time
for its GEMM/GEMV kernels (`GgmlLinear.repacked`; `repack=False` keeps the blocks as stored). Not on
a CPU with AMX-INT8, where llama.cpp 0.3.36 crashes in its extra buffers (bench/peers.py).

llama-cpp-python's wheel builds ggml with OpenMP: its graphs then run on libgomp's threads, which spin
after each graph for as long as `GOMP_SPINCOUNT` says (read when the library loads; the thread pool's
pause is a no-op there), as they do between llama.cpp's tokens. Unbounded (libgomp's default), that
spin took 10-20 ms of a core after each graph on a 2-core Zen 3 VM and slowed whatever ran next by
~20%: `settle()` after a timed pass waits it out, outside the timing, and quant_linear_cpu.py bounds
it (GOMP_SPINCOUNT=10000) before the library loads.

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

from bench import peers


def ggml_type(fmt: str) -> int:
    """The ggml type number of a QuantLinear weight format (q4_k -> Q4_K, bf16 -> BF16)."""
    return int(GGMLQuantizationType[fmt.upper()])


def lib_dir() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(next(iter(spec.submodule_search_locations))) / "lib"
    return d if (d / "libggml-cpu.so").exists() and (d / "libggml-base.so").exists() else None


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


_EXTRA_BUFTS = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
_LOG = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_QUIET = _LOG(lambda level, text, user: None)  # module-level: ggml keeps the pointer


class GgmlPool:
    """The two ggml libraries, a CPU backend of `threads` threads (the caller's thread is one) on one
    thread pool, and the CPU device's repacking buffer type (llama.cpp's "CPU_REPACK"), if it has one."""

    def __init__(self, directory: Path, threads: int) -> None:
        self.base = ctypes.CDLL(str(directory / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(directory / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        b, c, p, sz = self.base, self.cpu, ctypes.c_void_p, ctypes.c_size_t
        for fn, res, args in ((b.ggml_init, p, [_InitParams]), (b.ggml_free, None, [p]),
                              (b.ggml_new_tensor_2d, p, [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
                              (b.ggml_mul_mat, p, [p, p, p]), (b.ggml_new_graph, p, [p]),
                              (b.ggml_build_forward_expand, None, [p, p]), (b.ggml_get_data, p, [p]),
                              (b.ggml_tensor_overhead, sz, []), (b.ggml_graph_overhead, sz, []),
                              (b.ggml_threadpool_params_init, None, [p, ctypes.c_int]), (b.ggml_log_set, None, [_LOG, p]),
                              (b.ggml_backend_buft_name, ctypes.c_char_p, [p]),
                              (b.ggml_backend_buft_alloc_buffer, p, [p, sz]),
                              (b.ggml_backend_buft_get_alloc_size, sz, [p, p]),
                              (b.ggml_backend_buffer_set_usage, None, [p, ctypes.c_int]),
                              (b.ggml_backend_buffer_get_base, p, [p]), (b.ggml_backend_buffer_free, None, [p]),
                              (b.ggml_backend_tensor_alloc, ctypes.c_int, [p, p, p]),
                              (b.ggml_backend_tensor_set, None, [p, p, sz, sz]),
                              (b.ggml_backend_alloc_ctx_tensors_from_buft, p, [p, p]),
                              (b.ggml_backend_cpu_buffer_type, p, []),
                              (b.ggml_backend_dev_supports_op, ctypes.c_bool, [p, p]),
                              (b.ggml_backend_reg_dev_get, p, [p, sz]),
                              (b.ggml_backend_reg_get_proc_address, p, [p, ctypes.c_char_p]),
                              (b.ggml_backend_graph_compute, ctypes.c_int, [p, p]), (b.ggml_backend_free, None, [p]),
                              (c.ggml_cpu_init, None, []), (c.ggml_threadpool_new, p, [p]),
                              (c.ggml_threadpool_free, None, [p]), (c.ggml_threadpool_pause, None, [p]),
                              (c.ggml_threadpool_resume, None, [p]), (c.ggml_backend_cpu_init, p, []),
                              (c.ggml_backend_cpu_reg, p, []), (c.ggml_backend_cpu_set_n_threads, None, [p, ctypes.c_int]),
                              (c.ggml_backend_cpu_set_threadpool, None, [p, p])):
            fn.restype, fn.argtypes = res, args
        b.ggml_log_set(_QUIET, None)  # its "repack: repack tensor ..." lines; close() gives ggml its default back
        c.ggml_cpu_init()
        self._params = ctypes.create_string_buffer(4096)  # struct ggml_threadpool_params (~530 bytes)
        b.ggml_threadpool_params_init(self._params, threads)
        self.threads = threads
        self.pool = c.ggml_threadpool_new(self._params)
        self.backend = c.ggml_backend_cpu_init()
        if not self.pool or not self.backend:
            raise RuntimeError("ggml_threadpool_new / ggml_backend_cpu_init failed")
        c.ggml_backend_cpu_set_n_threads(self.backend, threads)
        c.ggml_backend_cpu_set_threadpool(self.backend, self.pool)
        reg = c.ggml_backend_cpu_reg()
        self.dev = b.ggml_backend_reg_dev_get(reg, 0)
        self.cpu_buft = b.ggml_backend_cpu_buffer_type()
        self.repack_buft = None
        extra = b.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
        if extra and peers.extra_buffers():  # see the module docstring
            bufts = _EXTRA_BUFTS(extra)(self.dev)
            for i in range(16):
                if not bufts[i]:
                    break
                if b.ggml_backend_buft_name(bufts[i]) == b"CPU_REPACK":
                    self.repack_buft = bufts[i]
        self._repackable: dict[tuple[int, int, int], bool] = {}
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

    def repackable(self, qtype: int, n: int, k: int) -> bool:
        """Whether llama.cpp's runtime repacks this weight (its `supports_op` for a mul_mat whose weight
        sits in the repacking buffer: a layout for the type on this CPU and n rows), asked on a
        throwaway graph so that nothing unsupported is ever written into that buffer."""
        key = (qtype, n, k)
        if self.repack_buft is None:
            return False
        if key not in self._repackable:
            b = self.base
            ctx = b.ggml_init(_InitParams(4 * b.ggml_tensor_overhead() + (1 << 12), None, True))
            w = b.ggml_new_tensor_2d(ctx, qtype, k, n)
            y = b.ggml_mul_mat(ctx, w, b.ggml_new_tensor_2d(ctx, int(GGMLQuantizationType.F32), k, 1))
            buf = b.ggml_backend_buft_alloc_buffer(self.repack_buft, b.ggml_backend_buft_get_alloc_size(self.repack_buft, w))
            ok = bool(buf) and b.ggml_backend_tensor_alloc(buf, w, b.ggml_backend_buffer_get_base(buf)) == 0
            self._repackable[key] = ok and b.ggml_backend_dev_supports_op(self.dev, y)
            if buf:
                b.ggml_backend_buffer_free(buf)
            b.ggml_free(ctx)
        return self._repackable[key]

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
        self.base.ggml_log_set(_LOG(), None)  # NULL: ggml's own logger (stderr)
        if self.backend:
            self.base.ggml_backend_free(self.backend)
            self.backend = None
        if self.pool:
            self.resume()
            self.cpu.ggml_threadpool_free(self.pool)
            self.pool = None


class GgmlLinear:
    """`y = x W^T` for one weight of `n` rows of `k` inputs in GGUF blocks (`raw`: n rows of bytes), for
    each row count of x in `ms`, through ggml's `mul_mat` on `pool`'s CPU backend. The weight goes where
    llama.cpp's runtime puts it: into the repacking buffer (interleaved rows for its GEMM/GEMV kernels)
    where it repacks that type on this CPU, unless `repack` is False, else a plain CPU buffer as stored."""

    def __init__(self, pool: GgmlPool, raw: np.ndarray | torch.Tensor, fmt: str, n: int, k: int, ms: tuple[int, ...],
                 repack: bool = True) -> None:
        self.p, self.n, self.k = pool, n, k
        b = pool.base
        raw = raw.contiguous().view(torch.uint8).numpy() if isinstance(raw, torch.Tensor) else np.ascontiguousarray(raw)
        qtype = ggml_type(fmt)
        self.repacked = repack and pool.repackable(qtype, n, k)
        self.ctx = b.ggml_init(_InitParams((1 + 3 * len(ms)) * b.ggml_tensor_overhead()
                                           + len(ms) * b.ggml_graph_overhead() + (1 << 16), None, True))
        if not self.ctx:
            raise MemoryError("ggml_init failed")
        w = b.ggml_new_tensor_2d(self.ctx, qtype, k, n)
        buft = pool.repack_buft if self.repacked else pool.cpu_buft
        self.wbuf = b.ggml_backend_buft_alloc_buffer(buft, b.ggml_backend_buft_get_alloc_size(buft, w))
        if not self.wbuf:
            raise MemoryError(f"ggml_backend_buft_alloc_buffer ({raw.nbytes} bytes) failed")
        b.ggml_backend_buffer_set_usage(self.wbuf, 1)  # GGML_BACKEND_BUFFER_USAGE_WEIGHTS
        if b.ggml_backend_tensor_alloc(self.wbuf, w, b.ggml_backend_buffer_get_base(self.wbuf)) != 0:
            raise RuntimeError("ggml_backend_tensor_alloc failed")
        graphs = {}
        for m in ms:
            x = b.ggml_new_tensor_2d(self.ctx, int(GGMLQuantizationType.F32), k, m)
            y = b.ggml_mul_mat(self.ctx, w, x)
            graph = b.ggml_new_graph(self.ctx)
            b.ggml_build_forward_expand(graph, y)
            graphs[m] = (x, y, graph)
        self.buf = b.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx, pool.cpu_buft)  # x and y
        if not self.buf:
            raise MemoryError("ggml_backend_alloc_ctx_tensors_from_buft failed")
        b.ggml_backend_tensor_set(w, raw.ctypes.data, 0, raw.nbytes)  # the repacking buffer repacks here
        self.graphs = {m: (b.ggml_get_data(x), b.ggml_get_data(y), graph) for m, (x, y, graph) in graphs.items()}

    def __call__(self, x: torch.Tensor) -> None:
        """Computes into ggml's output buffer (`result(m)` reads it); x: (m, k) f32, contiguous."""
        x_data, _, graph = self.graphs[x.shape[0]]
        ctypes.memmove(x_data, x.data_ptr(), x.numel() * 4)
        status = self.p.base.ggml_backend_graph_compute(self.p.backend, graph)
        if status != 0:
            raise RuntimeError(f"ggml_backend_graph_compute returned {status}")

    def result(self, m: int) -> torch.Tensor:
        buf = (ctypes.c_float * (m * self.n)).from_address(self.graphs[m][1])
        return torch.frombuffer(buf, dtype=torch.float32).view(m, self.n).clone()

    def __del__(self) -> None:
        b = self.p.base
        for name in ("buf", "wbuf"):
            if getattr(self, name, None):
                b.ggml_backend_buffer_free(getattr(self, name))
                setattr(self, name, None)
        if getattr(self, "ctx", None):
            b.ggml_free(self.ctx)
            self.ctx = None
