"""llama.cpp (llama-cpp-python) as an oracle: one way to open a GGUF file with it.

Opened without llama.cpp's "extra" weight buffers (repacked and AMX tile layouts): on a host with AMX,
llama-cpp-python 0.3.36 built natively crashes (SIGSEGV) in its first eval through them. The plain CPU
kernels it falls back to compute the same model; they are the oracle here, not a speed reference.
"""

from __future__ import annotations

import os
from typing import Any

from bench import peers


def open_llama(path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """`llama_cpp.Llama(model_path=path, **kwargs)` with llama.cpp's extra weight buffers off."""
    return peers.open_llama(path, extra_buffers=False, **kwargs)


def quantize_with_llama(src: str | os.PathLike[str], dst: str | os.PathLike[str], ftype: str) -> None:
    """llama.cpp's own quantizer (`llama_model_quantize`, what `llama-quantize` runs) writes `dst` from
    `src` as file type `ftype` ("Q2_K", "IQ4_XS", ...): the mix of block types a downloaded file of that
    name has, with llama.cpp's fallbacks where rows are not whole blocks. A quantized `src` is requantized."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src}, {ftype}) returned {rc}")
