"""The sampling values a model recommends, as its files state them (read, not yet trusted).

    HF directory   generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty
    GGUF file      general.sampling.{temp, top_p, top_k, min_p, penalty_repeat}: the keys llama.cpp
                   reads as a model's sampling defaults (gguf-py's `Keys.General.SAMPLING_*`); many
                   GGUF files carry none (the built-in SmolLM2 file does not)

`SAMPLING_KEYS` is the one table of names: the request parameter, its generation_config.json key and
its GGUF key (`gguf_writer` writes the second as the third). `raw_sampling_defaults` returns the values
as found, keyed by the request parameter's name (a built-in model's recommended values where its file
has none: `models.builtin`); whether each is usable (type, range) is the server's check
(`server.generation_defaults`), since the ranges are the sampling parameters'. llama.cpp applies
`penalty_repeat` to a window of recent tokens; mlaserve's repetition_penalty covers every token seen. Other generation_config.json keys are not sampling
defaults mlaserve takes: `do_sample` is ignored as vLLM ignores it (a file that sets `temperature`
gets that temperature), `max_new_tokens` too. Torch-free: the HTTP server reads this.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from models.builtin import builtin_sampling_defaults, resolve_model_path
from models.loader.gguf_file import read_gguf_metadata
from models.loader.jsonfile import read_json

# (request parameter, generation_config.json key, GGUF metadata key)
SAMPLING_KEYS: tuple[tuple[str, str, str], ...] = (
    ("temperature", "temperature", "general.sampling.temp"),
    ("top_p", "top_p", "general.sampling.top_p"),
    ("top_k", "top_k", "general.sampling.top_k"),
    ("min_p", "min_p", "general.sampling.min_p"),
    ("repetition_penalty", "repetition_penalty", "general.sampling.penalty_repeat"),
)


def raw_sampling_defaults(model: str | Path) -> tuple[dict[str, Any], str | None]:
    """({request parameter: value as found}, where it was found, or None when nowhere) for a built-in
    name, an HF directory or a GGUF file. A key the file does not have (or sets to null) is left out; a
    built-in model's recommended values fill what its file leaves out. A generation_config.json that is
    missing gives nothing; one that is not a JSON object raises CheckpointError naming it."""
    path = resolve_model_path(model)
    if path.is_dir():
        gen_path = path / "generation_config.json"
        config = read_json(gen_path, required=False) or {}
        found = {name: config[key] for name, key, _ in SAMPLING_KEYS if config.get(key) is not None}
        where = str(gen_path)
    else:
        meta = read_gguf_metadata(path)
        found = {name: _float32_text(meta[key]) for name, _, key in SAMPLING_KEYS if meta.get(key) is not None}
        where = f"{path} (general.sampling.*)"
    sources = [where] if found else []
    builtin = builtin_sampling_defaults(str(model))
    if builtin is not None and set(builtin[0]) - set(found):
        found = {**builtin[0], **found}
        sources.append(builtin[1])
    return found, "; ".join(sources) or None


def gguf_sampling_metadata(generation_config: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """(GGUF key, type: "int32" or "float32", value) for each sampling value of a generation_config.json
    that a GGUF file can carry, as llama.cpp's converter writes them; values of the wrong type are left out."""
    out = []
    for name, hf_key, gguf_key in SAMPLING_KEYS:
        value = generation_config.get(hf_key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if name == "top_k":
            if isinstance(value, int):
                out.append((gguf_key, "int32", value))
        else:
            out.append((gguf_key, "float32", float(value)))
    return out


def _float32_text(value: Any) -> Any:
    """A GGUF float32 as the decimal it was written from (0.9, not 0.8999999761581421)."""
    return float(str(np.float32(value))) if isinstance(value, float) else value
