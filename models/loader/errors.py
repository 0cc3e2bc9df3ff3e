"""The one error type every checkpoint problem is reported with.

Loading treats files as hostile: any inconsistency (missing tensor, wrong shape, bad offset,
unknown architecture, truncated data) raises `CheckpointError` whose message names the file,
the tensor or key, and what was expected, so a user can fix the checkpoint without a debugger.
"""

from __future__ import annotations

import os


class CheckpointError(ValueError):
    """A checkpoint (HF directory or GGUF file) cannot be loaded as it is."""

    def __init__(self, path: str | os.PathLike[str], what: str) -> None:
        self.path = str(path)
        super().__init__(f"{self.path}: {what}")
