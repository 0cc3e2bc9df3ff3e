"""`mlaserve serve`'s flags, generated from the ServerArgs/EngineArgs fields, and their MLASERVE_* twins:
every bad value is refused the same way from either source, before anything starts."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time

import pytest

from engine.args import EngineArgs
from server.args import SERVE_FLAGS, Flag, ServerArgs, parse_serve_args
from tests.server.server_process import REPO, free_port

INTERNAL = {(EngineArgs, "max_prefill_tokens"), (ServerArgs, "engine")}  # derived or nested, not flags


def bad_values(f: Flag) -> list[str]:
    """Values this flag must refuse (none for free-form strings such as --host or --api-key)."""
    if f.spec.choices:
        return ["bogus"]
    if f.kind is bool:
        return ["maybe"]
    if f.kind is int:
        return ["many", "1.5"] + (["0" if f.spec.check.__name__ == "positive" else "-1"] if f.spec.check else [])
    if f.kind is float:
        return ["lots"] + (["-1"] if f.spec.check else [])
    if f.spec.check:  # a checked string
        return ["tpu:x"]
    return []


CASES = [(f, v) for f in SERVE_FLAGS for v in bad_values(f)]


def test_every_setting_field_is_a_flag() -> None:
    names = {(f.owner, f.field) for f in SERVE_FLAGS}
    for cls in (EngineArgs, ServerArgs):
        for field in dataclasses.fields(cls):
            assert (cls, field.name) in names or (cls, field.name) in INTERNAL, f"{cls.__name__}.{field.name}"
    # every flag has something it refuses, unless it is a free-form string
    free = {f.name for f in SERVE_FLAGS if not bad_values(f)}
    assert free == {"model", "host", "api-key", "served-model-name"}


@pytest.mark.parametrize(("flag", "value"), CASES, ids=[f"{f.name}={v}" for f, v in CASES])
def test_bad_flag_value_exits_2_naming_the_flag(flag: Flag, value: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse_serve_args([f"--{flag.name}", value], environ={})
    assert info.value.code == 2
    assert f"--{flag.name}" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value"), CASES, ids=[f"{f.env}={v}" for f, v in CASES])
def test_bad_environment_value_exits_2_naming_the_variable(flag: Flag, value: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse_serve_args([], environ={flag.env: value})
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag.env in err[0] and repr(value) in err[0], err


def test_environment_values_are_used_and_flags_win() -> None:
    env = {"MLASERVE_PORT": "9001", "MLASERVE_DTYPE": "bfloat16", "MLASERVE_DISABLE_PREFIX_CACHE": "yes",
           "MLASERVE_SHUTDOWN_TIMEOUT": "2.5", "MLASERVE_MAX_QUEUED_REQUESTS": "0", "MLASERVE_KV_DTYPE": "float16"}
    args = parse_serve_args([], environ=env)
    assert (args.port, args.shutdown_timeout) == (9001, 2.5)
    assert (args.engine.dtype, args.engine.disable_prefix_cache, args.engine.max_queued_requests,
            args.engine.kv_dtype) == ("bfloat16", True, 0, "float16")
    args = parse_serve_args(["--port", "9002", "--dtype", "float32", "--disable-prefix-cache", "false"], environ=env)
    assert (args.port, args.engine.dtype, args.engine.disable_prefix_cache) == (9002, "float32", False)
    assert parse_serve_args(["--disable-cuda-graph"], environ={}).engine.disable_cuda_graph is True


def test_defaults_are_the_fields_defaults() -> None:
    args = parse_serve_args([], environ={})
    assert args == ServerArgs(engine=dataclasses.replace(EngineArgs(), max_prefill_tokens=8192))
    assert args.max_request_bytes is None  # derived from the context once the model is known
    chunked = parse_serve_args(["--chunked-prefill-size", "10000"], environ={})
    assert chunked.engine.max_prefill_tokens == 10000  # a step's prefill budget holds at least one chunk


def test_help_names_each_variable_and_default(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_serve_args(["--help"], environ={})
    help_text = " ".join(capsys.readouterr().out.split())
    for f in SERVE_FLAGS:
        assert f"--{f.name}" in help_text and f"[{f.env}]" in help_text


def test_triton_backends_need_cuda(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse_serve_args(["--attention-backend", "triton"], environ={})
    assert info.value.code == 2 and "--device cuda" in capsys.readouterr().err


def test_a_bad_variable_stops_serve_before_it_binds_the_port() -> None:
    port = free_port()
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mlaserve.cli", "serve", "--port", str(port)], cwd=REPO,
                          env={**os.environ, "MLASERVE_DTYPE": "bogus"}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and time.monotonic() - t0 < 30
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "MLASERVE_DTYPE='bogus'" in lines[0] and "float32" in lines[0], proc.stderr
    with socket.socket() as s:  # nobody listened on it
        assert s.connect_ex(("127.0.0.1", port)) != 0
