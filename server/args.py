"""`mlaserve serve` settings: flags generated from the `ServerArgs` and `EngineArgs` dataclasses.

Each settings field declared with `engine.args.flag(...)` is a flag `--<name>` and an environment
variable `MLASERVE_<NAME>` (`--max-total-tokens` <-> `MLASERVE_MAX_TOTAL_TOKENS`), with the field's
default, help, choices and range check: those live on the field, once. A flag given on the command
line wins over its variable, which wins over the default. Environment values are parsed and checked
exactly like flags, before anything starts: a bad one ends the command with one line naming the
variable (exit 2), never a traceback or a server that binds its port and then dies.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from engine.args import EngineArgs, FlagSpec, flag, non_negative, positive


def parse_bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false, yes/no, on/off, 1/0), got {s!r}")


def port_number(value: int) -> str | None:
    return None if 1 <= value <= 65535 else "must be a port number, 1..65535"


@dataclass(frozen=True)
class ServerArgs:
    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(8000, "port to listen on", check=port_number)
    api_key: str | None = flag(None, "require `Authorization: Bearer KEY` on /v1 routes")
    served_model_name: str | None = flag(None, "model id shown by /v1/models (default: the model's name)")
    max_request_bytes: int | None = flag(None, "largest request body accepted, 413 beyond (default: 16 bytes per "
                                         "token of the context length, at least 1 MiB)", check=positive)
    shutdown_timeout: float = flag(30.0, "seconds running requests get to finish after SIGTERM/SIGINT before they "
                                   "are ended with an error", check=non_negative)
    log_level: str = flag("info", "logging level", choices=("debug", "info", "warning", "error"))
    engine: EngineArgs = dataclasses.field(default_factory=EngineArgs)


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

    def parse(self, text: str) -> Any:
        """The value of `text`, or ValueError saying what is wrong with it."""
        try:
            value = (self.spec.parse or (parse_bool if self.kind is bool else self.kind))(text)
        except ValueError as e:
            raise ValueError(str(e) if self.kind is bool or self.spec.parse else
                             f"expected {'an integer' if self.kind is int else 'a number'}, got {text!r}") from None
        if self.spec.choices and value not in self.spec.choices:
            raise ValueError(f"invalid choice {text!r} (choose from {', '.join(self.spec.choices)})")
        problem = self.spec.check(value) if self.spec.check else None
        if problem:
            raise ValueError(f"{text!r} {problem}")
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
        out.append(Flag(cls, f.name, spec, kinds[0], f.default))
    return out


SERVE_FLAGS: list[Flag] = [*flags_of(EngineArgs, ["model"]), *flags_of(ServerArgs),
                           *(f for f in flags_of(EngineArgs) if f.field != "model")]


class BadSetting(Exception):
    """A flag or environment value that cannot be used; the message names it."""


def environment_defaults(flags: Iterable[Flag], environ: typing.Mapping[str, str]) -> dict[str, Any]:
    """{field: value} of the flags set in the environment, parsed and checked like flags; BadSetting
    naming the variable for the first bad one."""
    out = {}
    for f in flags:
        text = environ.get(f.env)
        if text is None:
            continue
        try:
            out[f.field] = f.parse(text)
        except ValueError as e:
            raise BadSetting(f"{f.env}={text!r}: {e}") from None
    return out


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag], defaults: dict[str, Any]) -> None:
    """`--<name>` for each flag; the default shown is the field's, the default used is `defaults`' when set."""
    for f in flags:
        def typed(text: str, f: Flag = f) -> Any:
            try:
                return f.parse(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None

        kw: dict[str, Any] = {"type": typed, "dest": f.field, "default": defaults.get(f.field, f.default),
                              "help": f"{f.spec.help} [{f.env}] (default: {f.default})"}
        if f.spec.choices:
            kw["metavar"] = "{" + ",".join(f.spec.choices) + "}"
        if f.kind is bool:
            kw.update(nargs="?", const=True)
        parser.add_argument(f"--{f.name}", **kw)


def parse_flags(prog: str, description: str, flags: list[Flag], argv: list[str],
                environ: typing.Mapping[str, str] | None = None,
                extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """Parses `argv` against `flags` (and `extra` arguments), environment values first. A bad value, in a
    flag or a variable, exits 2 with one line naming it."""
    parser = argparse.ArgumentParser(
        prog=prog, description=f"{description} Every setting can also be given by the environment variable "
        "in brackets; a flag on the command line wins.")
    try:
        defaults = environment_defaults(flags, os.environ if environ is None else environ)
    except BadSetting as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    add_flags(parser, flags, defaults)
    if extra is not None:
        extra(parser)
    return parser.parse_args(argv)


def _settings(cls: type, ns: argparse.Namespace, **more: Any) -> Any:
    return cls(**{f.field: getattr(ns, f.field) for f in flags_of(cls)}, **more)


def parse_serve_args(argv: list[str], environ: typing.Mapping[str, str] | None = None) -> ServerArgs:
    ns = parse_flags("mlaserve serve", "Serve a model over an OpenAI-compatible HTTP API.", SERVE_FLAGS, argv,
                     environ)
    gpu_only = [f"--{flag}-backend triton" for flag, value in (("attention", ns.attention_backend),
                                                               ("expert", ns.expert_backend)) if value == "triton"]
    env = os.environ if environ is None else environ
    if gpu_only and not ns.device.startswith("cuda") and env.get("TRITON_INTERPRET", "0") in ("", "0"):
        print(f"mlaserve serve: error: {' and '.join(gpu_only)} need{'' if len(gpu_only) > 1 else 's'} --device cuda "
              "(the Triton kernels run on NVIDIA GPUs); on CPU use the torch backends (and --expert-backend cpp)",
              file=sys.stderr)
        raise SystemExit(2)
    engine = _settings(EngineArgs, ns, max_prefill_tokens=max(ns.chunked_prefill_size, EngineArgs.max_prefill_tokens))
    args = _settings(ServerArgs, ns, engine=engine)
    return dataclasses.replace(args, api_key=args.api_key or None)
