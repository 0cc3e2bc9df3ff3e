"""OmniKV's settings and the per-layer plan they imply (torch-free: the server and the engine's flags
read it; `mlaserve calibrate-omnikv` writes it).

OmniKV (ICLR 2025) keeps every token's KV and decodes most layers over a small, dynamically chosen
subset of the context. The plan, for a model of L layers and filter layers f_1 < … < f_m (m ≤ 3):
  FULL    layers before f_1, and the layer right after each filter layer (on a GPU host that layer
          hides the transfer of the selected rows; `full_after_filter` turns it off)
  FILTER  f_i: full attention, then the selection of the tokens the layers below it attend to
  SPARSE  every other layer: attention over the selection of the closest filter layer above it

Selection, for one decode token at position n - 1 (context n) at a filter layer — the one definition
the torch reference (`kernels.attention.omnikv`), the C++ kernels and the Triton kernels implement:
  * window: the filter layer's queries of the request's last `window` decode steps, this one
    included (the prompt's queries are not kept, so prefill never pays for them; early steps have
    fewer); weight alpha_i of the i-th of the W' queries present (i = 1 … W', W' the newest):
    `last_token` 1 for the newest only, `uniform` 1 each, `exponential` 2^(i - W');
  * probabilities: per window query and head h, softmax_j(scale · q_h · k_j) over the positions j
    the query saw (GQA reads the KV head of h; MLA the absorbed query against the latent rows, one
    row serving every head);
  * importance(j) = sum_i alpha_i · max_h P_ih(j);
  * kept: the first `sink_tokens` and the last `recent_tokens` positions, plus the k most important
    of the positions between them (ties go to the earlier position), k = `budget_tokens` if set,
    else ceil(`budget_ratio` · n); positions sorted ascending. When k covers every candidate, the
    selection is the whole context and the layer computes exactly what full attention computes.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

import configs

ALPHA_MODES = ("last_token", "uniform", "exponential")
OMNIKV_MODES = ("auto", "on", "off")  # the server default --omnikv: auto = contexts of at least min_context
MAX_FILTER_LAYERS = 3
MAX_WINDOW = 16
MAX_TOKENS = 2**31 - 1  # a token count beyond any context (the native kernels take int64; a file may say 1e30)

# Layer roles (ints: the C++ plan takes them as they are).
FULL, FILTER, SPARSE = 0, 1, 2

_MAX_CONFIG_BYTES = 1 << 20  # a config is a few hundred bytes


def unreadable_file(path: str | Path, max_bytes: int) -> str | None:
    """What keeps an existing `path` from being read as a text file here, else None (also when it is
    missing: the read says so): a FIFO would block the read and /dev/zero fill the memory."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    return f"is over {max_bytes >> 20} MiB" if st.st_size > max_bytes else None


def first_filter_default(num_layers: int) -> int:
    """Where the first filter layer goes unless the user says: a fifth of the depth (never layer 0).
    Every layer before it attends fully, so this sets most of the decode cost (`mlaserve
    calibrate-omnikv --first-filter` chooses the rest of the plan around it)."""
    return max(1, num_layers // 5)


@dataclass(frozen=True)
class LayerPlan:
    """Per layer: its role, and for a SPARSE layer the index (into filter_layers) of its filter."""

    roles: tuple[int, ...]
    source: tuple[int, ...]  # -1 where the layer reads no selection

    @property
    def num_filters(self) -> int:
        return sum(1 for r in self.roles if r == FILTER)

    @cached_property
    def has_sparse(self) -> bool:
        """Whether some layer decodes over a selection (filter layers at the top leave none: then OmniKV
        changes nothing). Cached: the runner asks at every decode step."""
        return SPARSE in self.roles


@dataclass(frozen=True)
class OmniKVConfig:
    filter_layers: tuple[int, ...]
    budget_ratio: float = 0.1
    budget_tokens: int | None = None  # a count instead of a ratio of the context
    window: int = 1
    alpha: str = "last_token"
    sink_tokens: int = 4
    recent_tokens: int = 64
    min_context: int = 2048  # --omnikv auto: requests whose context reaches this use OmniKV
    full_after_filter: bool = True
    # what wrote it (calibrate-omnikv): the model, the text, the per-layer table; not read back
    calibration: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        problems = self._type_problems()  # a file's 1.5 or "no" must not be read as 1 or True
        if problems:
            raise ValueError("OmniKV config: " + "; ".join(problems))
        object.__setattr__(self, "filter_layers", tuple(self.filter_layers))
        problems = self.problems()
        if problems:
            raise ValueError("OmniKV config: " + "; ".join(problems))

    def _type_problems(self) -> list[str]:
        """The fields whose JSON type is wrong (a bool is not an integer here, nor an integer-valued float)."""
        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        out = []
        fl = self.filter_layers
        if not isinstance(fl, (list, tuple)) or not all(is_int(x) for x in fl):
            out.append(f"filter_layers must be a list of layer numbers (integers), got {fl!r}")
        if not (is_int(self.budget_ratio) or isinstance(self.budget_ratio, float)):
            out.append(f"budget_ratio must be a number, got {self.budget_ratio!r}")
        for name in ("budget_tokens", "window", "sink_tokens", "recent_tokens", "min_context"):
            value = getattr(self, name)
            if not is_int(value) and not (name == "budget_tokens" and value is None):
                out.append(f"{name} must be an integer{' or null' if name == 'budget_tokens' else ''}, got {value!r}")
        if not isinstance(self.alpha, str):
            out.append(f"alpha must be a string, got {self.alpha!r}")
        if not isinstance(self.full_after_filter, bool):
            out.append(f"full_after_filter must be true or false, got {self.full_after_filter!r}")
        if self.calibration is not None and not isinstance(self.calibration, dict):
            out.append("calibration must be an object (what calibrate-omnikv measured)")
        return out

    def problems(self, num_layers: int | None = None) -> list[str]:
        """What is wrong with these settings (for a model of `num_layers` layers when given)."""
        out = []
        fl = self.filter_layers
        if not 1 <= len(fl) <= MAX_FILTER_LAYERS:
            out.append(f"filter_layers must name 1 to {MAX_FILTER_LAYERS} layers, got {list(fl)}")
        if list(fl) != sorted(set(fl)) or any(x < 0 for x in fl):
            out.append(f"filter_layers must be distinct, ascending and >= 0, got {list(fl)}")
        if num_layers is not None and fl and fl[-1] >= num_layers:
            out.append(f"filter layer {fl[-1]} is outside the model's {num_layers} layers")
        if not 0.0 < self.budget_ratio <= 1.0:
            out.append(f"budget_ratio must be in (0, 1], got {self.budget_ratio}")
        if self.budget_tokens is not None and self.budget_tokens < 1:
            out.append(f"budget_tokens must be >= 1, got {self.budget_tokens}")
        if not 1 <= self.window <= MAX_WINDOW:
            out.append(f"window must be in [1, {MAX_WINDOW}], got {self.window}")
        if self.alpha not in ALPHA_MODES:
            out.append(f"alpha must be one of {', '.join(ALPHA_MODES)}, got {self.alpha!r}")
        if self.sink_tokens < 0 or self.recent_tokens < 1:
            out.append("sink_tokens must be >= 0 and recent_tokens >= 1 (the newest token is always kept)")
        if self.min_context < 1:
            out.append(f"min_context must be >= 1, got {self.min_context}")
        for name in ("budget_tokens", "sink_tokens", "recent_tokens", "min_context"):
            value = getattr(self, name)
            if value is not None and value > MAX_TOKENS:
                out.append(f"{name} must be at most {MAX_TOKENS} (more tokens than any context), got {value}")
        return out

    # ---- the plan ----
    def plan(self, num_layers: int) -> LayerPlan:
        problems = self.problems(num_layers)
        if problems:
            raise ValueError("OmniKV config: " + "; ".join(problems))
        roles, source = [FULL] * num_layers, [-1] * num_layers
        current = -1
        for layer in range(num_layers):
            if layer in self.filter_layers:
                roles[layer] = FILTER
                current = self.filter_layers.index(layer)
            elif current >= 0 and not (self.full_after_filter and layer - 1 in self.filter_layers):
                roles[layer], source[layer] = SPARSE, current
        return LayerPlan(tuple(roles), tuple(source))

    @property
    def window_size(self) -> int:
        """Queries kept per filter layer (1 with `last_token`: only the current one is read)."""
        return 1 if self.alpha == "last_token" else self.window

    def alpha_weights(self, present: int) -> list[float]:
        """Weights of the `present` newest window queries, oldest first (the last is the current query)."""
        if self.alpha == "last_token":
            return [0.0] * (present - 1) + [1.0]
        if self.alpha == "uniform":
            return [1.0] * present
        return [2.0 ** (i - present) for i in range(1, present + 1)]

    def budget_for(self, context: int) -> int:
        """k: tokens chosen by importance (besides the sink and recent ones) for a context of `context`."""
        if self.budget_tokens is not None:
            return self.budget_tokens
        return math.ceil(self.budget_ratio * context)

    def is_sparse_for(self, context: int) -> bool:
        """Whether a selection can leave anything out for this context (else every layer is full)."""
        return self.budget_for(context) + self.sink_tokens + self.recent_tokens < context

    # ---- files ----
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "OmniKV config") -> OmniKVConfig:
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        if "filter_layers" not in data:
            raise ValueError(f"{source}: filter_layers is required (run mlaserve calibrate-omnikv to choose them)")
        if data.get("budget_ratio", 0) is None and data.get("budget_tokens") is not None:  # unset, as a written
            # config's unused budget_tokens is null
            data = {k: v for k, v in data.items() if k != "budget_ratio"}
        try:
            return cls(**data)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{source}: {err}") from None

    @classmethod
    def load(cls, path: str | Path) -> OmniKVConfig:
        from models.builtin import user_path

        file = user_path(path)
        try:
            problem = unreadable_file(file, _MAX_CONFIG_BYTES)
            if problem:
                raise ValueError(f"the OmniKV config {path} {problem}: not an OmniKV config")
            text = file.read_text(encoding="utf-8-sig")  # (an editor's byte-order mark is not an error)
        except OSError as err:
            raise ValueError(f"cannot read the OmniKV config {path}: {err.strerror}") from None
        except UnicodeDecodeError as err:
            raise ValueError(f"the OmniKV config {path} is not UTF-8 text: {err.reason} at byte {err.start}") from None
        try:
            data = json.loads(text)
        except ValueError as err:  # (not JSON, or an integer past Python's digit limit)
            raise ValueError(f"the OmniKV config {path} is not JSON: {err}") from None
        except RecursionError:
            raise ValueError(f"the OmniKV config {path} nests too deeply to be an OmniKV config") from None
        return cls.from_dict(data, str(path))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["filter_layers"] = list(self.filter_layers)
        if out["calibration"] is None:
            del out["calibration"]
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def for_model(cls, model: str, num_layers: int, path: str | None = None) -> tuple[OmniKVConfig, str]:
        """The config a server uses, and where it came from: `path` when given, else the calibrated one
        shipped for a built-in model (configs/omnikv/<name>.json; named, or its file by path), else `default_for`."""
        from models.builtin import builtin_name_of

        builtin = builtin_name_of(model)
        if path is not None:
            cfg, origin = cls.load(path), path
        else:
            shipped = Path(configs.__file__).parent / "omnikv" / f"{builtin}.json" if builtin else None
            if shipped is not None and shipped.is_file():
                cfg, origin = cls.load(shipped), f"calibrated for {builtin} (shipped)"
            else:
                cfg, origin = cls.default_for(num_layers), "uncalibrated default (run mlaserve calibrate-omnikv)"
        cfg.plan(num_layers)  # raises naming the problem when the layers do not fit this model
        return cfg, origin

    @classmethod
    def default_for(cls, num_layers: int) -> OmniKVConfig:
        """Filter layers when nobody calibrated the model: one at a fifth of the depth, one at the middle
        (never layer 0, and at most as many as the depth allows). Calibration does better. A model too
        shallow for that to leave a layer to decode sparsely (4 layers or fewer) gets one filter layer, and
        where even that leaves none, no full layer after it."""
        picks = sorted({first_filter_default(num_layers), max(1, num_layers // 2)} & set(range(1, max(num_layers - 1, 1))))
        first = cls(filter_layers=tuple(picks) or (0,))
        for cfg in (first, cls(filter_layers=first.filter_layers[:1]),
                    cls(filter_layers=first.filter_layers[:1], full_after_filter=False)):
            if cfg.plan(num_layers).has_sparse:
                return cfg
        return first  # one layer: nothing to decode sparsely (the engine says so)


def model_label(model: str) -> str:
    """A built-in name as it is (and a built-in model's file by path: the same model); a path by its last
    component (a .gguf without the suffix, a split model's first file without its part number; a Hugging Face
    cache snapshot by its repository's name): the name a calibrated config records (`calibration.model`), which
    a server compares, ignoring case, with the model it serves, and the name a server serves by default."""
    from models.builtin import builtin_name_of, user_path

    builtin = builtin_name_of(model)
    if builtin is not None:
        return builtin
    path = user_path(model)
    if path.name in ("", ".", ".."):
        path = path.resolve()
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.split("--")[-1]  # a Hugging Face cache snapshot: its repository's name
    from models.loader.gguf_file import gguf_stem

    return gguf_stem(path.name)
