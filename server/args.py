"""`mlaserve serve` settings: flags generated from the `ServerArgs` and `EngineArgs` dataclasses.

Each settings field declared with `engine.args.flag(...)` is a flag `--<name>` and an environment
variable `MLASERVE_<NAME>` (`--max-total-tokens` <-> `MLASERVE_MAX_TOTAL_TOKENS`), with the field's
default, help, choices and range check: those live on the field, once. A flag given on the command
line wins over its variable, which wins over the default.

Environment values go through the very parser and checks of their flag, before anything starts: an
environment value is never handed to argparse as a default (argparse checks neither the type nor the
choices of a default), so a bad one ends the command with one line naming the variable (exit 2), never
a traceback or a server that binds its port and then dies. A variable that a flag on the command line
overrides is not used, so a bad value there does not stop the command: it is named in a warning (it is
still a mistake, and would be used the day the flag is dropped). Constraints between settings are
checked in `combination_problem`, after both sources are merged.

Every integer setting must fit in 64 bits, as a request's seed must (`scheduler.sampling_params`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NoReturn

from engine.args import MIN_CONTEXT, EngineArgs, FlagSpec, flag, internal, non_empty, non_negative, omnikv_file, positive
from engine.cgroups import usable_cpus
from server.chat_template import ChatTemplateError, load_chat_template
from server.reasoning import REASONING_PARSERS
from server.tool_parsers import TOOL_PARSERS

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # logging's and uvicorn's names


def parse_bool(s: str) -> bool:
    """A boolean from a flag or variable: 1/0, true/false, yes/no, on/off in any case; nothing else."""
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false, yes/no, on/off, 1/0), got {s!r}")


def port_number(value: int) -> str | None:
    return None if 1 <= value <= 65535 else "must be a port number, 1..65535"


def chat_template_value(value: str | None) -> str | None:
    """A --chat-template that reads as a template that compiles (an empty value: the model's)."""
    if value is None or not value.strip():
        return None
    try:
        load_chat_template(value)
    except ChatTemplateError as e:
        return str(e)
    return None


def runtime_file_value(value: str | None) -> str | None:
    """A --runtime-file that can be written, found before anything loads: not a directory, not another kind
    of file (the file is replaced, then removed at exit: a FIFO, a device such as /dev/stdout, or a file of
    the user's was lost), in a directory that exists or can be made under one that takes a file (tried)."""
    if value is None or not value.strip():
        return None
    path = Path(value).absolute()
    if path.is_dir():
        return "is a directory (give a file path, e.g. /tmp/mlaserve/server.json)"
    if path.is_symlink():
        return "is a symbolic link (it would be replaced, then removed at exit); give the path of a file"
    if path.exists():
        if not path.is_file():
            return "exists and is not a regular file (it would be replaced, then removed at exit); give a new path"
        try:
            text = path.read_text().strip()  # (empty: `mktemp`'s, taken as it is)
            held = json.loads(text) if text else {}
        except (OSError, ValueError):
            text, held = "?", None
        if text and not (isinstance(held, dict) and {"host", "port", "pid"} <= held.keys()):
            return "exists and is not a runtime file a server wrote (it would be replaced, then removed at exit); " \
                   "remove it or give a new path"
    existing = next(p for p in path.parents if p.exists())  # "/" at worst
    if not existing.is_dir():
        return f"cannot be created: {existing} is not a directory"
    try:  # (where its folders are still to be made, the folder they go in)
        with tempfile.NamedTemporaryFile(dir=existing, prefix=f".{path.name}."):
            pass
    except OSError as e:
        return f"cannot be written in {existing} ({e.strerror or e})"
    return None


_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s,]+")


def model_name_value(value: str) -> str | None:
    """A --served-model-name clients can send back as `model`: empty (the default) or printable, not blank."""
    if value and (not value.strip() or not value.isprintable()):
        return "must be printable and not blank (it is the `model` clients send), or empty for the model's name"
    return None


def api_key_value(value: str | None) -> str | None:
    """A key a client can send: HTTP drops a header value's leading and trailing whitespace, so a key with
    some (a Secret or file's trailing newline) would lock every client out."""
    if value and value != value.strip():
        return ("the key has whitespace at its start or end (a trailing newline, from a file or Secret?), which "
                "no HTTP header can carry, so no client could match it: remove it" if value.strip() else
                "the key is only whitespace, which no client can send: give a key, or leave it empty for none")
    if value and not all(" " <= c < "\x7f" for c in value):
        # (httpx, and with it the OpenAI SDK, sends ASCII header values only; a stray byte broke every request)
        return ("the key has a character that is not printable ASCII, which clients cannot send in a header: use "
                "letters, digits and punctuation")
    return None


def origins_value(value: str) -> str | None:
    """A --allowed-origins that a browser's Origin header can match: "*", or origins as scheme://host[:port]
    (no path: an origin never ends in "/", so "http://localhost:3000/" would never match)."""
    for origin in (o.strip() for o in value.split(",")):
        if origin and origin != "*" and not _ORIGIN.fullmatch(origin):
            # said after the value (Flag.parse): a list's bad entry is named, a lone one is the value
            what = "is not an origin" if origin == value.strip() else f"holds {origin!r}, which is not an origin"
            return f"{what}: give '*' or scheme://host[:port] without a path, e.g. http://localhost:3000"
    return None


GENERATION_CONFIG_MODES = ("auto", "none")

# the range of an integer setting: what a request's seed may be (scheduler.sampling_params), a signed or
# an unsigned 64-bit integer; past it no engine message carries the value
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1

# checks whose problem is a whole sentence that names the value (a file's reader names the file), so
# that the value is not said twice
SELF_NAMING_CHECKS = frozenset({omnikv_file, api_key_value})  # (the key: not echoed)


@dataclass(frozen=True)
class ServerArgs:
    host: str = flag("127.0.0.1", "address to listen on", check=non_empty, metavar="ADDR")
    port: int = flag(8000, "port to listen on", check=port_number, metavar="PORT")
    api_key: str | None = flag(None, "require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on /v1 routes, "
                               "/tokenize and /detokenize (empty: no key)", check=api_key_value,
                               metavar="KEY", default_text="no key")
    allowed_origins: str = flag("*", "origins a web page may call the API from (CORS): '*' for any, a "
                                "comma-separated list (https://app.example,http://localhost:3000), or empty for "
                                "none (no CORS headers, browsers refuse cross-origin calls)", check=origins_value,
                                metavar="ORIGINS")
    served_model_name: str | None = flag(None, "model id shown by /v1/models (empty: the default)", metavar="NAME",
                                         check=model_name_value, default_text="the model's name")
    # None: derived from the context length once the model is known (server.launch)
    max_request_bytes: int | None = flag(None, "largest request body accepted, 413 beyond", check=positive,
                                         metavar="BYTES",
                                         default_text="16 bytes per token of the context length, at least 1 MiB")
    read_timeout: float = flag(60.0, "seconds a client has to send a request's headers, and at most between two reads "
                               "of its body; past them the connection is closed (a 408 when the headers or body did "
                               "not come whole), so stalled or slowloris clients cannot hold connections open",
                               check=positive, metavar="SECONDS")
    write_timeout: float = flag(60.0, "seconds an answer may wait on a client that does not read it, counted once "
                                "the buffers are full (the client's window, the kernel's send buffer, the server's "
                                "64 KB); past them the connection is dropped and the request aborted",
                                check=positive, metavar="SECONDS")
    stream_keepalive: float = flag(15.0, "seconds a stream may go without sending anything (queued, or in a long "
                                   "prefill) before it sends a keep-alive (an SSE comment, which event parsers "
                                   "skip), so that proxies and clients with read timeouts do not cut it; 0: never", check=non_negative, metavar="SECONDS")
    shutdown_timeout: float = flag(30.0, "seconds running requests get to finish after SIGTERM/SIGINT before they "
                                   "are ended with an error", check=non_negative, metavar="SECONDS")
    log_level: str = flag("info", "logging level", choices=LOG_LEVELS)
    runtime_file: str | None = flag(None, "once listening, write {host, port, pid} as JSON to this file (removed at "
                                    "exit), so that a health check finds the port the server really bound (the "
                                    "images set /tmp/mlaserve/server.json; empty: no file)", check=runtime_file_value,
                                    metavar="PATH", default_text="no file")
    tool_call_parser: str = flag("auto", "how tool calls are read from the model's output ('auto': the format "
                                 "its chat template uses)", choices=("auto", *sorted(TOOL_PARSERS)))
    reasoning_parser: str = flag("auto", "how a chat answer's reasoning (<think>...</think>) is split into "
                                 "message.reasoning_content: deepseek_r1, qwen3, kimi_k2, none, or auto (what the chat "
                                 "template writes); glm45 is vLLM's name for qwen3's reading", choices=REASONING_PARSERS)
    generation_config: str = flag("auto", "sampling defaults of requests that leave temperature, top_p, top_k, "
                                  "min_p or repetition_penalty out: auto (the model's: generation_config.json, a GGUF's "
                                  "general.sampling.* keys, a built-in model's recommended ones; OpenAI's for the rest) "
                                  "or none (OpenAI's)", choices=GENERATION_CONFIG_MODES)
    chat_template: str | None = flag(None, "chat template to use instead of the model's: a Jinja file, or the template "
                                     "itself (a value with '{', '}' or a newline); checked to compile at start",
                                     check=chat_template_value, metavar="FILE|TEMPLATE", default_text="the model's")
    dp: int = flag(1, "data-parallel replicas: N engine processes behind this server, each with the whole model, its "
                   "own KV cache and a share of the CPUs, one at least (on CUDA: its own GPUs); a request goes to the "
                   "replica that served its prompt's prefix unless that one is much busier", check=positive, metavar="N")
    engine: EngineArgs = internal("the engine's settings: flags of their own", default_factory=EngineArgs)


@dataclass(frozen=True)
class Flag:
    """One settings field as a flag: where it lives and how a string becomes its value."""

    owner: type  # ServerArgs or EngineArgs
    field: str
    spec: FlagSpec
    kind: type  # str, int, float or bool (the field's type without None)
    default: Any

    @property
    def name(self) -> str:
        return self.spec.name or self.field.replace("_", "-")

    @property
    def env(self) -> str:
        return "MLASERVE_" + self.name.upper().replace("-", "_")

    @property
    def metavar(self) -> str:
        if self.spec.metavar:
            return self.spec.metavar
        if self.spec.choices:
            return "{" + ",".join(self.spec.choices) + "}"
        return {int: "N", float: "X", bool: "BOOL"}.get(self.kind, self.field.upper())

    @property
    def help(self) -> str:
        """The field's help, its variable and its default, as `--help` prints them."""
        default = self.spec.default_text or (str(self.default).lower() if self.kind is bool else self.default)
        return f"{self.spec.help} [{self.env}] (default: {default})".replace("%", "%%")

    def parse(self, text: str) -> Any:
        """The value of `text`, or ValueError saying what is wrong with it (flags and variables alike). An empty
        value of a flag that is unset by default (`--omnikv-config ''`) leaves it unset, as a template that
        fills in an empty value means."""
        if text == "" and self.default is None:
            return None
        try:
            value = (self.spec.parse or (parse_bool if self.kind is bool else self.kind))(text)
        except ValueError as e:
            raise ValueError(str(e) if self.kind is bool or self.spec.parse else
                             f"expected {'an integer' if self.kind is int else 'a number'}, got {text!r}") from None
        if self.spec.choices and value not in self.spec.choices:
            raise ValueError(f"invalid choice {text!r} (choose from {', '.join(self.spec.choices)})")
        if self.kind is int and not INT64_MIN <= value <= UINT64_MAX:
            bound = f"at most {UINT64_MAX}" if value > 0 else f"at least {INT64_MIN}"
            raise ValueError(f"{text!r} must fit in 64 bits ({bound})")
        problem = self.spec.check(value) if self.spec.check else None
        if problem:
            # a check's problem is said after the value ("'0' must be > 0"), unless it names the value
            # itself, as a file's reader does ("cannot read the OmniKV config /x.json: ...")
            names_it = repr(text) in problem or self.spec.check in SELF_NAMING_CHECKS
            raise ValueError(problem if names_it else f"{text!r} {problem}")
        return value


def flags_of(cls: type, only: Iterable[str] | None = None) -> list[Flag]:
    """The flags of a settings dataclass's fields, in field order (`only`: these fields)."""
    hints = typing.get_type_hints(cls)
    wanted = set(only) if only is not None else None
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("flag")
        if spec is None or (wanted is not None and f.name not in wanted):
            continue
        kinds = [k for k in typing.get_args(hints[f.name]) or (hints[f.name],) if k is not type(None)]
        assert len(kinds) == 1 and kinds[0] in (str, int, float, bool), f"{cls.__name__}.{f.name}: unsupported type"
        assert f.default is not None or spec.default_text, f"{cls.__name__}.{f.name}: say what None means"
        out.append(Flag(cls, f.name, spec, kinds[0], f.default))
    assert wanted is None or wanted == {f.field for f in out}, f"{cls.__name__} has no flag {wanted}"
    return out


SERVE_FLAGS: list[Flag] = [*flags_of(EngineArgs, ["model"]), *flags_of(ServerArgs),
                           *(f for f in flags_of(EngineArgs) if f.field != "model")]


class BadSetting(Exception):
    """A flag or environment value that cannot be used; the message names it."""


def environment_values(flags: Iterable[Flag], environ: Mapping[str, str],
                       overridden: Iterable[str] = ()) -> tuple[dict[str, Any], list[str]]:
    """({field: value} of the flags set in the environment, parsed and checked like flags; warnings).
    BadSetting naming the variable for the first bad one, unless its field is in `overridden` (given on
    the command line, so the variable is not used): that one gets a warning instead."""
    skip = frozenset(overridden)
    out, warnings = {}, []
    for f in flags:
        text = environ.get(f.env)
        if text is None:  # (set empty, it means what the flag given empty means: Flag.parse)
            continue
        try:
            value = f.parse(text)
        except ValueError as e:  # the message names the value (Flag.parse), as argparse's does a flag's
            if f.field not in skip:
                raise BadSetting(f"{f.env}: {e}") from None
            warnings.append(f"{f.env} is ignored, as --{f.name} on the command line wins; its value would be "
                            f"refused: {e}")
            continue
        if f.field not in skip:
            out[f.field] = value
    return out, warnings


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag]) -> None:
    """`--<name>` for each flag, parsed by `Flag.parse`. Nothing is stored for a flag not given (the
    caller fills in the variable or the field's default), so a given flag can be told from the rest."""
    for f in flags:
        def typed(text: str, f: Flag = f) -> Any:
            try:
                return f.parse(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None

        kw: dict[str, Any] = {"type": typed, "dest": f.field, "default": argparse.SUPPRESS, "help": f.help,
                              "metavar": f.metavar}
        if f.kind is bool:
            kw.update(nargs="?", const=True)  # `--disable-cuda-graph` or `--disable-cuda-graph false`
        parser.add_argument(f"--{f.name}", **kw)


def model_problem(model: str) -> str | None:
    """What makes `model` (a --model value) no model, found before anything loads or binds: neither a
    built-in name nor a path; a directory that is not an HF model directory (no config.json: a .gguf in it
    is named, to pass instead; no tokenizer.json); a file that is not a GGUF. None: it can be loaded (its
    contents are checked then, see `mlaserve.model_check.load_model_checked`)."""
    from models.builtin import resolve_model_path

    try:
        path = resolve_model_path(model)
    except FileNotFoundError as e:
        return str(e)
    try:
        if path.is_dir():
            if not (path / "config.json").is_file():
                ggufs = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
                hint = ("pass --model a built-in name, a .gguf file or a directory holding config.json" if not ggufs
                        else f"to use the GGUF file in it, pass --model {ggufs[0]}" if len(ggufs) == 1 else
                        f"to use one of its {len(ggufs)} GGUF files, pass it as --model (e.g. --model {ggufs[0]})")
                return f"{model} is a directory without config.json, so not an HF model directory: {hint}"
            if not (path / "tokenizer.json").is_file() and not (path / "tiktoken.model").is_file():  # (Kimi's)
                return (f"the HF model directory {model} has no tokenizer.json: copy the model's tokenizer.json "
                        "beside its config.json")
            return _config_problem(model, path / "config.json")
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        return f"cannot read the model {model}: {e.strerror or e}"
    if magic != b"GGUF":
        return (f"{model} is not a GGUF file (it does not start with 'GGUF'): pass --model a .gguf file, an HF "
                "model directory or a built-in name")
    return _gguf_problem(model, path)


def _gguf_problem(model: str, path: Path) -> str | None:
    """A GGUF whose header, metadata or tensor table the loader would refuse (every file of a split model,
    or another part than the first given), said before anything starts: only the headers are read."""
    from models.loader.errors import CheckpointError
    from models.loader.gguf_file import open_gguf

    try:
        open_gguf(path).close()
    except CheckpointError as e:
        return f"cannot load the model {model}: {str(e).removeprefix(f'{path}: ')}"  # (named once)
    return None


def _config_problem(model: str, config_json: Path) -> str | None:
    """A config.json the loader would refuse (not JSON, an architecture or a setting not served), or no weight
    files beside it, said before anything starts: the engine would fail the same way after the server had
    bound its port."""
    from models.config import config_from_hf_dict
    from models.loader.errors import CheckpointError
    from models.loader.jsonfile import read_json
    from models.loader.quantization import scheme_from_config
    from models.loader.weight_files import find_shards

    try:
        config = read_json(config_json)
        config_from_hf_dict(config, str(config_json))  # as the loader reads it
        scheme_from_config(config, config_json)  # a quantization method not read
        find_shards(config_json.parent)  # weight files there (safetensors; a shard index's files all present)
    except (OSError, CheckpointError) as e:
        return f"cannot load the model {model}: {str(e).removeprefix(f'{config_json.parent}: ')}"  # (named once)
    return None


def _model_header(model: str) -> Callable[[str, str], Any] | None:
    """A reader of the model's sizes from its config.json or GGUF header, before anything loads: `get(hf_key,
    gguf_key)`; None when the model cannot be read here (`model_problem` and the loader report that)."""
    import json

    from models.builtin import resolve_model_path
    from models.loader.gguf_file import read_gguf_metadata

    try:
        path = resolve_model_path(model)
        if path.is_dir():
            cfg = json.loads((path / "config.json").read_text())
            if not isinstance(cfg, dict):
                return None
            return lambda hf, _gguf: cfg.get(hf)
        meta = read_gguf_metadata(path)
        arch = meta.get("general.architecture")
        return lambda _hf, gguf: meta.get(f"{arch}.{gguf}")
    except (OSError, ValueError, RecursionError):
        return None


MAX_PLANNED_LAYERS = 1 << 16  # layers a header may claim for the OmniKV check before the weights are read


def omnikv_problem(model: str, config: str | None) -> str | None:
    """What makes the OmniKV config the server would use (--omnikv-config's, else the one shipped for a
    built-in model) not fit the model, read from its header before anything loads: the engine would find
    it only after the weights had loaded."""
    from models.omnikv_config import OmniKVConfig

    get = _model_header(model)
    layers = None if get is None else get("num_hidden_layers", "block_count")
    # a count no file holds is the loader's to refuse (against the tensors): the plan takes memory by layer, and a
    # header's 2^31 took all of it before that check
    if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= MAX_PLANNED_LAYERS:
        return None
    try:
        OmniKVConfig.for_model(model, layers, config)
    except ValueError as e:
        return f"{e}{'' if config is None else f' (--omnikv-config {config})'}"
    return None


def device_problem(device: str, dp: int, node_ranks: int) -> str | None:
    """What this machine lacks for --device and the processes asked of it, found before any starts. On
    a CPU: a CPU of its own for each --dp replica (past that every replica was given every CPU, and
    `--dp 100000` started forking 100,000 engines). On CUDA: a torch that sees GPUs, and the `dp *
    node_ranks` GPUs from --device's index on (one per rank: `--tp / --nnodes` ranks per replica); asked
    of a `python -c` child, since this process never imports torch. None where it cannot tell."""
    import subprocess

    if device == "cpu":
        cpus = len(usable_cpus())
        if dp > cpus:
            return (f"--dp {dp} asks for more replicas than the {cpus} CPU(s) this server may use: each replica "
                    f"needs one of its own (" + (f"use --dp {cpus} or fewer)" if cpus > 1 else "leave --dp out: one replica)"))
        return None
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0, torch.__version__)"
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        count, version = r.stdout.split()[-2:]
        gpus = int(count)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None  # the engine reports what it finds
    base = int(device.partition(":")[2] or 0)
    if gpus == 0:
        return (f"--device {device}: torch {version} sees no CUDA device on this machine (a CPU build of torch, no "
                "GPU, or CUDA_VISIBLE_DEVICES empty); use --device cpu")
    need = dp * node_ranks
    if base + need > gpus:
        return (f"--device {device} with --dp {dp} and {node_ranks} rank(s) on this node needs GPUs {base} to "
                f"{base + need - 1} (one per rank); torch sees {gpus} on this machine")
    return None


def _split_sizes(model: str) -> dict[str, int] | None:
    """What a split divides, read before anything loads: attention heads, routed experts, and the intermediate
    sizes of the dense MLPs (0: every layer is MoE), of each routed expert and of the shared experts. An HF
    directory's through its typed config (its keys and defaults as the loader reads them: DeepSeek's
    `n_routed_experts`, the Qwen MoEs' `num_experts`, Mixtral's `num_local_experts`), a GGUF's from its header.
    None where the model cannot be read here (`model_problem` and the loader report that)."""
    from models.builtin import resolve_model_path
    from models.config import config_from_hf_dict
    from models.loader.errors import CheckpointError
    from models.loader.gguf_file import read_gguf_metadata

    try:
        path = resolve_model_path(model)
        if path.is_dir():
            cfg = config_from_hf_dict(json.loads((path / "config.json").read_text()))
            moe = cfg.moe
            dense = moe is None or any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
            return {"heads": cfg.num_attention_heads, "experts": moe.num_experts if moe else 0,
                    "dense": cfg.intermediate_size if dense else 0, "expert": moe.intermediate_size if moe else 0,
                    "shared": moe.shared_size if moe else 0}
        meta = read_gguf_metadata(path)
    except (OSError, ValueError, RecursionError, CheckpointError, TypeError, AttributeError):
        return None
    arch = meta.get("general.architecture")

    def get(key: str) -> int:
        v = meta.get(f"{arch}.{key}")
        return v if isinstance(v, int) and not isinstance(v, bool) else 0

    experts, ff = get("expert_count"), get("feed_forward_length")
    expert_ff = get("expert_feed_forward_length") or ff  # (Mixtral's `llama` files: the experts are ff wide)
    # DeepSeek's lead of dense layers; the other MoE architectures have experts in every layer
    dense = ff if not experts or get("leading_dense_block_count") else 0
    shared = get("expert_shared_feed_forward_length") or get("expert_shared_count") * expert_ff
    return {"heads": get("attention.head_count"), "experts": experts, "dense": dense,
            "expert": expert_ff if experts else 0, "shared": shared if experts else 0}


def parallel_problem(model: str, ranks: int, *, heads_split: bool, ep: bool) -> str | None:
    """What the model's sizes forbid of a split over `ranks` processes (--tp, or --dp with
    --dp-attention), read before any process starts (`_split_sizes`): attention heads (`heads_split`: --tp),
    the dense MLPs' intermediate size, and per MoE either each routed expert's intermediate size or, with `ep`,
    the number of routed experts, and the shared experts' size (whole on every rank with --dp-attention and
    --ep). None when it divides (or when the model cannot be read here)."""
    if ranks <= 1:
        return None
    got = _split_sizes(model)
    if got is None:
        return None
    if ep and not got["experts"]:
        return "--ep partitions routed experts, and this model has none (a dense model): leave --ep at 1"
    sizes = []
    if heads_split:
        sizes.append((got["heads"], "number of attention heads"))
    if got["dense"]:
        sizes.append((got["dense"], "dense MLPs' intermediate size"))
    if got["experts"]:
        sizes.append((got["experts"], "number of routed experts") if ep else
                     (got["expert"], "routed experts' intermediate size"))
    if got["shared"] and (heads_split or not ep):
        sizes.append((got["shared"], "shared experts' intermediate size"))
    for size, what in sizes:
        if size and size % ranks:
            how = "choose a --tp that divides it" if heads_split else "choose a --dp that divides it"
            if heads_split and what == "number of attention heads":
                how += "; --dp with --dp-attention keeps attention whole"
            return f"the model's {what} ({size}) is not divisible by the {ranks} ranks it would be split over: {how}"
    return None


def refuse(prog: str, message: str) -> NoReturn:
    """Ends the command as argparse does for a bad flag (exit 2), in one line."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (exit 2), like a bad environment value's: the usage
    (dozens of flags) would bury the message, and `--help` is one flag away."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            message += _peer_flag_hints(message.split(":", 1)[1].split(), self)
        refuse(self.prog, f"{message} (see {self.prog} --help)")


_THREADS = ("(a thread per CPU this process may use, as taskset or a cgroup's quota allow; "
            "MLASERVE_CPP_EXPERTS_THREADS=N sets it)")
#: Flags of vLLM, SGLang and llama.cpp's server that users type from habit -> the flag that does the nearest
#: thing here. Named in the error, not taken as aliases: their meanings differ in details (vLLM's
#: --gpu-memory-utilization is a share of all the device's memory, --mem-fraction one of the free memory
#: left for the KV cache).
PEER_FLAGS = {"--max-model-len": "--context-length", "--ctx-size": "--context-length", "-c": "--context-length",
              "--context-size": "--context-length", "-m": "--model", "--model-path": "--model",
              "--gpu-memory-utilization": "--mem-fraction", "--mem-fraction-static": "--mem-fraction",
              "--tensor-parallel-size": "--tp", "--tp-size": "--tp", "--data-parallel-size": "--dp",
              "--dp-size": "--dp", "--max-num-seqs": "--max-running-requests", "-np": "--max-running-requests",
              "--parallel": "--max-running-requests", "--max-num-batched-tokens": "--chunked-prefill-size",
              "--kv-cache-dtype": "--kv-dtype", "--chat-template-file": "--chat-template",
              "--enable-prefix-caching": "(on by default; --disable-prefix-cache turns it off)",
              "--api-keys": "--api-key", "-t": _THREADS, "--threads": _THREADS}


def _peer_flag_hints(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """'; --max-model-len is --context-length here' for the peers' flags among `unknown` whose nearest flag this
    parser has; a bare first word a model name (vLLM's `vllm serve MODEL`)."""
    known = {opt for action in parser._actions for opt in action.option_strings}
    hints = []
    for word in unknown:
        name = word.split("=", 1)[0]
        ours = PEER_FLAGS.get(name)
        if ours is not None and (ours.startswith("(") or ours in known):
            hints.append(f"{name} {ours}" if ours.startswith("(") else f"{name} is {ours} here")
    if unknown and not unknown[0].startswith("-") and "--model" in known and not hints:
        hints.append(f"the model is given as --model {unknown[0]}")
    return "; " + "; ".join(dict.fromkeys(hints)) if hints else ""


@dataclass
class Parsed:
    """Parsed settings and where each came from: `--<name>`, `MLASERVE_<NAME>` or (absent) the default."""

    ns: argparse.Namespace
    source: dict[str, str]
    flags: dict[str, Flag]

    def describe(self, field: str) -> str:
        """A setting as the user gave it, for messages: `--device cpu (the default)`, `MLASERVE_DEVICE='cpu'`."""
        f, value, source = self.flags[field], getattr(self.ns, field), self.source.get(field)
        if source == f.env:
            return f"{f.env}={value!r}"
        shown = f"--{f.name}" if value is True else f"--{f.name} {value}"  # a switch as it is typed
        return shown + ("" if source else " (the default)")


def parse_settings(prog: str, description: str, flags: list[Flag], argv: list[str],
                   environ: Mapping[str, str] | None = None,
                   extra: Callable[[argparse.ArgumentParser], None] | None = None) -> Parsed:
    """Parses `argv` against `flags` (and `extra` arguments), then every flag's variable. A bad value,
    in a flag or a variable, exits 2 with a message naming it (a bad variable that a flag overrides: a
    warning); `--help` works whatever the environment."""
    parser = OneLineParser(
        prog=prog, description=f"{description} Every setting can also be given by the environment variable "
        "in brackets, checked like the flag; a flag on the command line wins.")
    add_flags(parser, flags)
    if extra is not None:
        extra(parser)
    ns = parser.parse_args(argv)
    try:
        from_env, warnings = environment_values(flags, os.environ if environ is None else environ,
                                                overridden=[f.field for f in flags if f.field in vars(ns)])
    except BadSetting as e:
        refuse(prog, str(e))
    for warning in warnings:
        print(f"{prog}: warning: {warning}", file=sys.stderr)
    source = {}
    for f in flags:
        if f.field in vars(ns):
            source[f.field] = f"--{f.name}"
        elif f.field in from_env:
            setattr(ns, f.field, from_env[f.field])
            source[f.field] = f.env
        else:
            setattr(ns, f.field, f.default)
    return Parsed(ns, source, {f.field: f for f in flags})


def parse_flags(prog: str, description: str, flags: list[Flag], argv: list[str],
                environ: Mapping[str, str] | None = None,
                extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """`parse_settings`' values alone (for commands with no constraints between settings)."""
    return parse_settings(prog, description, flags, argv, environ, extra).ns


def worker_threads_problem(environ: Mapping[str, str]) -> str | None:
    """MLASERVE_CPP_EXPERTS_THREADS, read by the worker pool rather than a flag, checked as a flag's value is."""
    threads = environ.get("MLASERVE_CPP_EXPERTS_THREADS", "").strip()
    if threads and not (threads.isdigit() and int(threads) > 0):
        return (f"MLASERVE_CPP_EXPERTS_THREADS={threads!r} must be a whole number of threads above 0 (or unset: a "
                "thread per CPU the process may use)")
    return None


def combination_problem(parsed: Parsed, environ: Mapping[str, str]) -> str | None:
    """The first broken constraint between settings, naming how each was given, or None. (A setting's
    own type, choices and range are checked by its flag spec; this is what no single field can say.)"""
    ns = parsed.ns
    triton = [f for f in ("attention_backend", "expert_backend") if getattr(ns, f) == "triton"]
    if triton and not ns.device.startswith("cuda") and environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return (f"{' and '.join(parsed.describe(f) for f in triton)} need{'s' if len(triton) == 1 else ''} "
                f"--device cuda, not {parsed.describe('device')}: the Triton kernels run on NVIDIA GPUs; on CPU use "
                "the torch backends (and --expert-backend cpp)")
    if ns.dp > 1 and ns.nnodes > 1:
        return (f"{parsed.describe('dp')} does not run with {parsed.describe('nnodes')}: data-parallel replicas "
                "are one machine's (run one server per machine)")
    if ns.tp % ns.nnodes:
        return f"{parsed.describe('tp')} must be a multiple of {parsed.describe('nnodes')} (the same ranks on each node)"
    if ns.node_rank >= ns.nnodes:
        return f"{parsed.describe('node_rank')} must be below {parsed.describe('nnodes')}"
    if ns.nnodes > 1 and ns.master_port == 0:
        return f"{parsed.describe('nnodes')} needs --master-port: every node must know where rank 0 listens"
    if ns.dp_attention:
        if ns.dp < 2:
            return f"{parsed.describe('dp_attention')} needs --dp N > 1, not {parsed.describe('dp')}: its ranks are the replicas"
        if ns.tp > 1:
            return (f"{parsed.describe('dp_attention')} runs each replica's attention whole: {parsed.describe('tp')} "
                    "must be 1 (the MLP/MoE layers are split over the --dp replicas)")
        if ns.ep not in (1, ns.dp):
            return (f"{parsed.describe('ep')} must be 1 or the --dp size ({ns.dp}) under --dp-attention: experts are "
                    "partitioned over the replicas")
    elif ns.ep not in (1, ns.tp):
        return f"{parsed.describe('ep')} must be 1 or the --tp size ({ns.tp}): experts are partitioned over the tp ranks"
    if (ns.cpu_weight_dtype == "float32" and ns.dtype not in ("auto", "float32") and ns.cpu_kernels == "native"
            and ns.device == "cpu"):
        return (f"{parsed.describe('cpu_weight_dtype')} holds every weight in fp32 for an exact forward, which "
                f"{parsed.describe('dtype')} would round: drop --dtype (or use --cpu-weight-dtype bf16)")
    if ns.max_total_tokens and ns.max_total_tokens < MIN_CONTEXT:
        return (f"{parsed.describe('max_total_tokens')} leaves too few KV slots to serve any request (at least "
                f"{MIN_CONTEXT}); leave it out for --mem-fraction to size the cache")
    if ns.max_total_tokens and ns.max_total_tokens < ns.page_size:
        return (f"{parsed.describe('page_size')} is larger than {parsed.describe('max_total_tokens')}: the KV cache "
                "holds whole pages; lower --page-size or raise --max-total-tokens")
    if ns.dp > 1 and ns.tp > 1 and ns.master_port != 0:
        return (f"{parsed.describe('dp')} with --tp needs --master-port 0, not {parsed.describe('master_port')}: each "
                "replica's ranks meet on a free port of their own")
    if (ns.tp > 1 or ns.dp_attention) and ns.node_rank == 0 and ns.master_port and ns.master_port == getattr(ns, "port", None):
        return (f"{parsed.describe('master_port')} is the HTTP {parsed.describe('port')} too: the ranks' rendezvous "
                "needs a port of its own (0: any free one, on one node)")
    return None


def _settings(cls: type, ns: argparse.Namespace, **more: Any) -> Any:
    return cls(**{f.field: getattr(ns, f.field) for f in flags_of(cls)}, **more)


# The MLASERVE_* variables that are not settings flags, and who reads them: the C++ expert pool
# (cpp_experts: its kernel, threads, wait policy, pinning and library), a rank process's settings from
# its parent (engine.ranks), the benchmarks' peers and models (bench/), and docker compose's build and
# model folder (docker/compose.yaml, read on the host). A test checks that every
# MLASERVE_* name in the code is a flag's variable or listed here.
OTHER_VARIABLES = frozenset({
    "MLASERVE_CPP_EXPERTS_KERNEL", "MLASERVE_CPP_EXPERTS_THREADS", "MLASERVE_CPP_EXPERTS_WAIT",
    "MLASERVE_CPP_EXPERTS_PIN", "MLASERVE_CPP_EXPERTS_LIB", "MLASERVE_RANK_SPEC",
    "MLASERVE_LLAMA_CPP_BIN", "MLASERVE_LLAMA_CPP_SRC", "MLASERVE_PEERS_DIR", "MLASERVE_KT_PYTHON",
    "MLASERVE_BENCH_MODELS", "MLASERVE_DOCKERFILE", "MLASERVE_MODELS_DIR",
})


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each MLASERVE_* variable that nothing reads (a misspelt setting would otherwise be
    ignored without a word), with the closest known name."""
    import difflib

    known = {f.env for f in SERVE_FLAGS} | OTHER_VARIABLES
    out = []
    for name in sorted(k for k in environ if k.startswith("MLASERVE_") and k not in known):
        close = difflib.get_close_matches(name, sorted(known), n=1)
        out.append(f"{name} is not a variable mlaserve reads, so it is ignored"
                   + (f" (did you mean {close[0]}?)" if close else ""))
    return out


def parse_serve_args(argv: list[str], environ: Mapping[str, str] | None = None) -> ServerArgs:
    """`mlaserve serve`'s settings from `argv` and the environment (`os.environ` unless given); exits 2
    on any bad value or combination, before anything is started."""
    prog = "mlaserve serve"
    env = os.environ if environ is None else environ
    parsed = parse_settings(prog, "Serve a model over an OpenAI-compatible HTTP API.", SERVE_FLAGS, argv, env)
    problem = worker_threads_problem(env) or combination_problem(parsed, env)
    if problem:
        refuse(prog, problem)
    for warning in unknown_variables(env):
        print(f"{prog}: warning: {warning}", file=sys.stderr)
    ns = parsed.ns
    engine = _settings(EngineArgs, ns)
    args = _settings(ServerArgs, ns, engine=engine)
    # empty means unset: a compose file or Dockerfile may pass a variable with no value
    return dataclasses.replace(args, api_key=args.api_key or None, served_model_name=args.served_model_name or None,
                               runtime_file=args.runtime_file if args.runtime_file and args.runtime_file.strip()
                               else None,
                               chat_template=args.chat_template if args.chat_template and args.chat_template.strip()
                               else None)
