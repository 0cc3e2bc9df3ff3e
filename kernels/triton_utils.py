"""What every Triton kernel module here shares: whether the kernels are interpreted, the device check,
the dot precision, and the rounding of an fp32 result to a 16-bit type."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Whether `triton.jit` built the kernels for Triton's CPU interpreter (TRITON_INTERPRET=1 set before
#: Triton was imported), decided once at import like Triton itself does.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)


def _patch_the_language_once() -> None:
    """Triton's interpreter patches `triton.language` for each launch and restores it after, and patches it
    again at every call of a `@triton.jit` function inside a kernel (ours, and the language's own such as
    `tl.zeros`): four scans of the language's modules each time, more than a third of an interpreted
    decode's time. In a process whose kernels are all interpreted nothing needs the language unpatched, so
    each language module is patched the first time a function that names it runs, and stays so. Left as it
    is when this Triton's interpreter has another shape."""
    import inspect

    from triton.runtime import interpreter as ti

    patch_lang = getattr(ti, "_patch_lang", None)
    scope_class = getattr(ti, "_LangPatchScope", None)
    lang = getattr(ti, "tl", None)
    if None in (patch_lang, scope_class, lang):
        return
    languages = (lang, lang.core)
    seen: dict[object, frozenset[int]] = {}  # a function -> the language modules its globals name
    for_good: set[int] = set()  # the language modules patched for good

    def patch_once(fn):
        wanted = seen.get(fn)
        if wanted is None:
            wanted = seen[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                          if inspect.ismodule(v) and v in languages)
        if not wanted or not wanted <= for_good:  # (none: Triton's own check says what is wrong)
            patch_lang(fn)  # (its scope dropped: never restored)
            for_good.update(wanted)
        return scope_class()  # nothing to restore

    ti._patch_lang = patch_once


def _cache_interpreted_np_dtypes() -> None:
    """The interpreter maps a Triton type to its numpy one at nearly every operation, building a dict of
    every type each time: 7 % of an interpreted decode's time. The same mapping, kept per element type
    (a block's is its element's). Left as it is when this Triton's interpreter has another shape."""
    from triton.runtime import interpreter as ti

    original = getattr(ti, "_get_np_dtype", None)
    if original is None:
        return
    cache: dict[object, object] = {}

    def np_dtype(tt_dtype):
        ty = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(ty, tl.pointer_type):  # (unhashable; the original answers at once)
            return original(ty)
        try:
            return cache[ty]
        except KeyError:
            cache[ty] = found = original(ty)
            return found

    ti._get_np_dtype = np_dtype


if INTERPRETED:
    _patch_the_language_once()
    _cache_interpreted_np_dtypes()


def check_device(device: torch.device, what: str, cpu_alternative: str) -> None:
    """Triton kernels need CUDA tensors, or CPU tensors with the interpreter (tests)."""
    if device.type == "cuda" or (INTERPRETED and device.type == "cpu"):
        return
    raise RuntimeError(
        f"{what} needs a CUDA device (got tensors on {device}); use --device cuda, or {cpu_alternative} on a "
        "CPU (tests run the kernels on CPU with TRITON_INTERPRET=1 set before triton is imported)"
    )


def dot_precision(dtype: torch.dtype) -> str | None:
    """IEEE fp32 products for fp32 inputs (Triton would otherwise use TF32 on Ampere+, ~1e-3 off the
    torch reference); the default (native) for bf16/fp16."""
    return "ieee" if dtype == torch.float32 else None


@triton.jit
def cast_out(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> dtype, rounding to nearest even as compiled Triton does. The interpreter's fp32 -> bf16
    cast truncates instead, so there the bits are rounded first (finite values; NaN/inf not handled)."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
