"""Reading the small JSON files of a checkpoint (config, index, tokenizer config) with clear errors, and the
rule for where a model directory's files may link (`confined`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from models.loader.errors import CheckpointError


def _hf_cache_blobs(path: Path) -> Path | None:
    """(`path` absolute) The blobs/ folder of the Hugging Face cache repository whose snapshot holds `path`, if one does
    (<cache>/models--org--name/snapshots/<revision>/... links each file to ../../blobs/<hash>)."""
    for folder in path.parents:
        if folder.parent.name == "snapshots":
            return (folder.parent.parent / "blobs").resolve()
    return None


def confined(path: Path, root: Path) -> Path:
    """`path` itself when, links followed, it is inside `root`, or is a blob of the Hugging Face cache
    repository whose snapshot holds it; else a CheckpointError. For a model's text that reaches prompts (its
    chat templates): one linked to /etc/passwd would be rendered into every prompt. Its weights, configs
    and tokenizer may link anywhere, as transformers lets them (a folder of links to shared weights), since
    what they hold never reaches a client as text."""
    real = path.resolve()
    inside = root.resolve()
    if real == inside or inside in real.parents:
        return path
    # (the snapshot found from the model directory's own target: `./model` may be a link to a snapshot)
    blobs = _hf_cache_blobs(inside / path.absolute().relative_to(root.absolute()))
    if blobs is not None and real.parent == blobs:
        return path
    raise CheckpointError(path, f"links to {real}, outside the model directory: a chat template may link only "
                                "within it (or, in a Hugging Face cache snapshot, to its repository's blobs/); "
                                "copy the file in")


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
