"""Loading the model for a command of its own (`generate`, `calibrate-omnikv`): every way the model can be
wrong is one line naming it (exit 2), as `serve`'s flag checks say theirs. Here, not in `server.args`,
because it imports the model stack (torch), which the HTTP side never does."""

from __future__ import annotations

from typing import Any

from models.builtin import resolve_model_path
from models.loader.errors import out_of_memory
from models.loader.load import LoadedModel, load_model
from server.args import BadSetting, model_problem

# what `models.loader.load.load_model` raises for a model it cannot read (its CheckpointError is a ValueError)
MODEL_ERRORS = (OSError, KeyError, ValueError)


def load_model_checked(model: str, **kwargs: Any) -> LoadedModel:
    """`load_model(model, **kwargs)`, where every way the model can be wrong (`model_problem`, then what
    loading finds in the files) is a BadSetting naming it, for the command to print in one line (exit 2)."""
    problem = model_problem(model)
    if problem:
        raise BadSetting(problem)
    device = str(kwargs.get("device", "cpu"))
    if device.startswith("cuda"):  # torch's own error is an AssertionError deep in its lazy init
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.partition(":")[2] or 0)
        if index >= count:
            raise BadSetting(f"--device {device}: " + (f"this machine has {count} CUDA device(s), 0..{count - 1}"
                             if count else "this machine (or this torch build) has no CUDA device; use --device cpu"))
    try:
        return load_model(model, **kwargs)
    except (MemoryError, RuntimeError) as e:
        oom = out_of_memory(e)
        if oom is None:
            raise
        raise BadSetting(oom) from None
    except MODEL_ERRORS as e:
        detail = str(e.args[0] if isinstance(e, KeyError) and e.args else e)  # str(KeyError) quotes its message
        detail = detail.removeprefix(f"{resolve_model_path(model)}: ")  # a CheckpointError names the file: once
        raise BadSetting(f"cannot load the model {model}: {detail}") from None
