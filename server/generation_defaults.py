"""The model's sampling defaults: what a request that leaves a sampling parameter out gets (vLLM's
`--generation-config auto`).

    model files --models.loader.generation_config.raw_sampling_defaults--> values as found (untrusted)
                --load_generation_defaults (type and range checks; bad keys ignored, named in a warning)-->
                GenerationDefaults (ServerState.generation_defaults, /v1/models, the start-up log)
    request     --server.protocol.to_sampling_params: `with_defaults(what the request sent, defaults)`-->
                SamplingParams

The parameters: temperature, top_p, top_k, min_p, repetition_penalty (`GENERATION_FIELDS`). A default
applies exactly when the request leaves the field out (or sends null, which means "the default" in
OpenAI's API, as vLLM reads it too); a value the request sends is used as sent, also when it equals
OpenAI's default (`"temperature": 1` stays 1). With `--generation-config none`, or for what the model
does not set, the defaults are OpenAI's (`OPENAI_DEFAULTS`, the engine's `SamplingParams` defaults).

A value is checked as a request's would be (`SamplingParams.validate`, the one range check): a model
file with `"temperature": "hot"` or `"top_p": 5` does not stop the server, the key is ignored and the
warning names it. `top_k` 0 means no limit, as in a request.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from models.loader.errors import CheckpointError
from models.loader.generation_config import SAMPLING_KEYS, raw_sampling_defaults
from scheduler.sampling_params import TOP_K_ALL, ParamError, SamplingParams

logger = logging.getLogger("mlaserve.server")

GENERATION_FIELDS: tuple[str, ...] = tuple(name for name, _, _ in SAMPLING_KEYS)
OPENAI_DEFAULTS: dict[str, Any] = {name: getattr(SamplingParams(), name) for name in GENERATION_FIELDS}


@dataclass(frozen=True)
class GenerationDefaults:
    """The checked sampling defaults the model sets (`values`: only those), and where they come from."""

    values: Mapping[str, Any] = field(default_factory=dict)
    source: str | None = None
    mode: str = "auto"  # --generation-config

    def in_force(self) -> dict[str, Any]:
        """Every generation field's default: the model's, else OpenAI's (what /v1/models shows)."""
        return {**OPENAI_DEFAULTS, **self.values}

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.mode == "none":
            return "OpenAI's (--generation-config none)"
        if not self.values:
            return "OpenAI's (the model sets none)"
        own = ", ".join(f"{k}={v}" for k, v in self.values.items())
        return f"{own} (from {self.source}); the others OpenAI's"


def checked_defaults(raw: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(usable values, one problem per key that is not): each value must have its parameter's type (a
    number; an integer for top_k) and pass the range check a request's value passes."""
    good: dict[str, Any] = {}
    problems: list[str] = []
    for name, value in raw.items():
        if name not in GENERATION_FIELDS:
            problems.append(f"{name}: not a sampling default mlaserve takes")
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{name}={value!r:.40}: expected a number")
            continue
        if name == "top_k" and not isinstance(value, int):
            problems.append(f"{name}={value!r}: expected an integer")
            continue
        try:
            value = (TOP_K_ALL if value == 0 else value) if name == "top_k" else float(value)
            SamplingParams(**{name: value}).validate(vocab_size=1)
        except OverflowError:  # an integer too large for a float
            problems.append(f"{name}={value!r:.40}: out of range")
            continue
        except ParamError as e:
            problems.append(f"{name}={value!r}: {e.message}")
            continue
        good[name] = value
    return good, problems


def load_generation_defaults(model: str, mode: str = "auto") -> GenerationDefaults:
    """The model's checked sampling defaults (`mode` "none": none). Never raises for what the files say:
    an unreadable source or a bad key is logged as a warning and ignored."""
    if mode == "none":
        return GenerationDefaults(mode=mode)
    try:
        raw, source = raw_sampling_defaults(model)
    except (CheckpointError, OSError) as e:
        logger.warning("sampling defaults: cannot read the model's (%s); using OpenAI's", e)
        return GenerationDefaults(mode=mode)
    values, problems = checked_defaults(raw)
    if problems:
        logger.warning("sampling defaults of %s: ignoring %s", source, "; ".join(problems))
    return GenerationDefaults(values, source if values else None, mode)


def with_defaults(given: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Every generation field's value for a request: what it sent (`given`: the fields present in its body
    and not null), else the model's default (`defaults`), else OpenAI's."""
    return {name: given[name] if given.get(name) is not None else defaults.get(name, OPENAI_DEFAULTS[name])
            for name in GENERATION_FIELDS}
