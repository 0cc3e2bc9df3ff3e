"""The one error type every checkpoint problem is reported with.

Loading treats files as hostile: any inconsistency (missing tensor, wrong shape, bad offset,
unknown architecture, truncated data) raises `CheckpointError` whose message names the file,
the tensor or key, and what was expected, so a user can fix the checkpoint without a debugger.
Names in those messages come from the file: characters a terminal or a log would act on are escaped and
a message is cut to a readable length, so a forged file cannot write fake log lines, drive the terminal
that shows its error, or fill a log with one megabyte-long name.
"""

from __future__ import annotations

import os

MAX_MESSAGE_CHARS = 2000


def printable(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` with its unprintable characters (controls, line breaks, format characters) escaped as Python
    writes them, and at most `limit` characters of it kept."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: limit + 1])
    if len(text) > limit or len(shown) > limit:
        return f"{shown[:limit]}... ({len(text)} characters in all)"
    return shown


class CheckpointError(ValueError):
    """A checkpoint (HF directory or GGUF file) cannot be loaded as it is."""

    def __init__(self, path: str | os.PathLike[str], what: str) -> None:
        self.path = str(path)
        super().__init__(printable(f"{self.path}: {what}"))


_OOM_TEXTS = ("can't allocate memory", "std::bad_alloc", "out of memory")


def out_of_memory(exc: BaseException) -> str | None:
    """What to tell for an allocation that failed while a model loaded or its engine started (Python's
    MemoryError, torch's allocator's RuntimeError, a C++ `bad_alloc` from the extension, CUDA's out-of-memory),
    else None: a line that says so, rather than the allocator's traceback."""
    said = str(exc).strip()
    if not isinstance(exc, MemoryError) and not (isinstance(exc, RuntimeError) and any(t in said for t in _OOM_TEXTS)):
        return None
    text = said.splitlines()[0] if said else type(exc).__name__
    return (f"not enough memory to start the model ({printable(text, 200)}): use a smaller quantization of it (a "
            "GGUF such as Q4_K_M) or a machine or container with more memory; serving, a smaller KV cache "
            "(--max-total-tokens, --mem-fraction) or fewer --dp replicas (each loads the whole model)")
