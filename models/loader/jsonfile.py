"""Reading the small JSON files of a checkpoint (config, index, tokenizer config) with clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from models.loader.errors import CheckpointError


def read_json(path: Path, *, required: bool = True, expect_object: bool = True) -> Any:
    """The parsed file; None when it is absent and not `required`. Errors name the file."""
    if not path.is_file():
        if required:
            raise CheckpointError(path, "file is missing")
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # (not UTF-8, not JSON, an integer past Python's digit limit)
        raise CheckpointError(path, f"not valid JSON: {e}") from None
    except RecursionError:
        raise CheckpointError(path, "not valid JSON: nested too deeply") from None
    if expect_object and not isinstance(value, dict):
        raise CheckpointError(path, "must hold a JSON object")
    return value
