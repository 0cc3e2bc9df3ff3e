"""`mlaserve serve`'s flags, generated from the ServerArgs/EngineArgs fields, and their MLASERVE_* twins:
every bad value is refused the same way from either source, before anything starts; every good value
arrives, and a flag beats its variable.

The tables below name every flag: a new settings field without a row here fails
`test_the_tables_cover_every_flag`, so its bad values get tested both ways too."""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engine.args import ATTENTION_BACKENDS, CPU_WEIGHT_DTYPES, DTYPES, EXPERT_BACKENDS, HYBRID_GRAPH_MODES, EngineArgs
from mlaserve.cli import main as cli_main
from server.args import OTHER_VARIABLES, SERVE_FLAGS, Flag, ServerArgs, parse_serve_args
from tests.server.server_process import REPO, free_port

BY_NAME = {f.name: f for f in SERVE_FLAGS}

# values each flag must refuse; [] only for free-form strings where empty means "the default"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "omnikv"
TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
BAD: dict[str, list[str]] = {
    "model": ["", " "],
    "host": [""],
    "port": ["http", "0", "65536", "80.5"],
    "api-key": ["sekret\n", " sekret", "   ", "cl\u00e9", "k\udcfe", "k\x01"],
    "allowed-origins": ["localhost:3000", "http://localhost:3000/", "https://a.example/app", "*, ftp//x"],
    "served-model-name": ["  ", "a\nb"],
    "max-request-bytes": ["1MiB", "0"],
    "shutdown-timeout": ["soon", "-1", "nan"],
    "stream-keepalive": ["often", "-1", "nan"],
    "read-timeout": ["soon", "0", "-1", "nan"],
    "write-timeout": ["soon", "0", "-1", "nan"],
    "log-level": ["verbose", "INFO"],
    # a directory, under a file, a device (replaced, then removed at exit), a file not a server's, no folder to make
    "runtime-file": [str(TEMPLATES), f"{TEMPLATES}/qwen2_5.jinja/server.json", "/dev/null",
                     f"{TEMPLATES}/qwen2_5.jinja", "/proc/mlaserve-none/server.json"],
    "tool-call-parser": ["qwen", "HERMES", ""],
    "generation-config": ["vllm", "AUTO", "", "/models/m"],
    "chat-template": [f"{TEMPLATES}/missing.jinja", "template.j2", str(TEMPLATES), "{% if %}", "{{ messages"],
    "dp": ["two", "0", "-1", "1.5"],
    "device": ["tpu", "cuda:x", "cpu:0", ""],
    "dtype": ["bogus", "fp16"],
    "kv-dtype": ["bogus"],
    "attention-backend": ["flash"],
    "expert-backend": ["bogus"],
    "cpu-kernels": ["native-ish", "NATIVE"],
    "cpu-weight-dtype": ["q4_k", "fp32"],
    "context-length": ["4k", "0", "-1", "31"],
    "max-running-requests": ["many", "0"],
    "max-queued-requests": ["lots", "-1"],
    "max-total-tokens": ["1.5", "0", str(2**64)],
    "mem-fraction": ["half", "0", "1.5", "nan"],
    "chunked-prefill-size": ["big", "0"],
    "page-size": ["x", "0"],
    "cuda-graph-max-bs": ["x", "-1"],
    "disable-cuda-graph": ["maybe", "2", ""],
    "hybrid-graph-mode": ["sometimes"],
    "disable-prefix-cache": ["maybe"],
    "scheduling-policy": ["lifo", "PRIORITY"],
    "seed": ["random", "1.5", str(2**64), str(-(2**63) - 1), "99999999999999999999999"],
    "watchdog-timeout": ["soon", "-1", "nan"],
    "startup-timeout": ["soon", "-1", "nan"],
    "grammar-compile-timeout": ["soon", "-1", "nan"],
    "rank-timeout": ["soon", "0", "-1", "nan"],
    "omnikv": ["maybe", "ON"],
    "omnikv-bank": ["maybe", "2"],
    "omnikv-config": [f"{FIXTURES}/missing.json", f"{FIXTURES}/unknown_field.json"],
    "tp": ["two", "0", "1.5"],
    "ep": ["x", "0"],
    "nnodes": ["x", "0"],
    "node-rank": ["x", "-1"],
    "master-addr": ["", " "],
    "master-port": ["x", "-1", "65536"],
    "dp-attention": ["maybe", "2"],
    "reasoning-parser": ["o1", "DeepSeek_R1", ""],
    "speculative-config": ["ngram", '{"method": "eagle"}', '{"method": "ngram", "num_speculative_tokens": 0}'],
}
FREE_FORM: set[str] = set()

# (variable's text, its value, flag's text, its value): the variable's value is not the default, the flag's
# is not the variable's
GOOD: dict[str, tuple[str, Any, str, Any]] = {
    "model": ("m-env", "m-env", "m-flag", "m-flag"),
    "host": ("0.0.0.0", "0.0.0.0", "::1", "::1"),
    "port": ("9001", 9001, "65535", 65535),
    "api-key": ("k1", "k1", "k2", "k2"),
    "allowed-origins": ("http://localhost:3000", "http://localhost:3000", "", ""),
    "served-model-name": ("env-name", "env-name", "flag-name", "flag-name"),
    "max-request-bytes": ("1024", 1024, "2048", 2048),
    "shutdown-timeout": ("2.5", 2.5, "0", 0.0),
    "stream-keepalive": ("0", 0.0, "2.5", 2.5),
    "read-timeout": ("2.5", 2.5, "7", 7.0),
    "write-timeout": ("3.5", 3.5, "9", 9.0),
    "log-level": ("critical", "critical", "debug", "debug"),
    "runtime-file": ("/tmp/mlaserve/env.json", "/tmp/mlaserve/env.json", "run/flag.json", "run/flag.json"),
    "tool-call-parser": ("hermes", "hermes", "deepseek_v3", "deepseek_v3"),
    "generation-config": ("none", "none", "auto", "auto"),
    "chat-template": (f"{TEMPLATES}/qwen2_5.jinja", f"{TEMPLATES}/qwen2_5.jinja",
                      "{{ messages[0]['content'] }}", "{{ messages[0]['content'] }}"),
    "dp": ("2", 2, "3", 3),
    "device": ("cuda:1", "cuda:1", "cuda", "cuda"),
    "dtype": ("bfloat16", "bfloat16", "float32", "float32"),
    "kv-dtype": ("float16", "float16", "bfloat16", "bfloat16"),
    "attention-backend": ("triton", "triton", "torch", "torch"),
    "expert-backend": ("cpp", "cpp", "triton", "triton"),
    "cpu-kernels": ("torch", "torch", "native", "native"),
    "cpu-weight-dtype": ("bf16", "bf16", "float32", "float32"),
    "context-length": ("256", 256, "4096", 4096),
    "max-running-requests": ("8", 8, "1", 1),
    "max-queued-requests": ("0", 0, "5", 5),
    "max-total-tokens": ("4096", 4096, "100", 100),
    "mem-fraction": ("1", 1.0, "0.05", 0.05),
    "chunked-prefill-size": ("512", 512, "16", 16),
    "page-size": ("64", 64, "2", 2),
    "cuda-graph-max-bs": ("0", 0, "8", 8),
    "disable-cuda-graph": ("YES", True, "off", False),
    "hybrid-graph-mode": ("split", "split", "host-nodes", "host-nodes"),
    "disable-prefix-cache": ("On", True, "0", False),
    "scheduling-policy": ("priority", "priority", "fcfs", "fcfs"),
    "seed": ("-3", -3, "42", 42),
    "watchdog-timeout": ("60", 60.0, "0", 0.0),
    "startup-timeout": ("1200", 1200.0, "0", 0.0),
    "grammar-compile-timeout": ("5", 5.0, "0", 0.0),
    "rank-timeout": ("30", 30.0, "2.5", 2.5),
    "omnikv": ("auto", "auto", "on", "on"),
    "omnikv-bank": ("yes", True, "off", False),
    "omnikv-config": (f"{FIXTURES}/two_filters.json", f"{FIXTURES}/two_filters.json",
                      f"{FIXTURES}/window.json", f"{FIXTURES}/window.json"),
    "tp": ("2", 2, "4", 4),
    "ep": ("4", 4, "1", 1),
    "nnodes": ("2", 2, "4", 4),
    "node-rank": ("1", 1, "3", 3),
    "master-addr": ("10.0.0.1", "10.0.0.1", "node0", "node0"),
    "master-port": ("29500", 29500, "0", 0),
    "dp-attention": ("yes", True, "false", False),
    "reasoning-parser": ("qwen3", "qwen3", "none", "none"),
    "speculative-config": ('{"method": "ngram"}', '{"method": "ngram"}',
                           '{"method": "ngram", "num_speculative_tokens": 5}',
                           '{"method": "ngram", "num_speculative_tokens": 5}'),
}
# what a row's values need beside them to be a valid combination (--ep N needs --tp N, and so on)
ROW_ENV = {"ep": {"MLASERVE_TP": "4"}, "dp-attention": {"MLASERVE_DP": "2"}, "nnodes": {"MLASERVE_TP": "4", "MLASERVE_MASTER_PORT": "29500"},
           "node-rank": {"MLASERVE_TP": "4", "MLASERVE_NNODES": "4", "MLASERVE_MASTER_PORT": "29500"}}
# the triton backends need a CUDA device; every GOOD row is parsed with this underneath
BASE_ENV = {"MLASERVE_DEVICE": "cuda"}

CASES = [(BY_NAME[name], v) for name, values in BAD.items() if name in BY_NAME for v in values]
# an empty value of a flag unset by default leaves it unset (test_empty_values_are_unset_where_...)
FLAG_CASES = [(f, v) for f, v in CASES if not (v == "" and f.default is None)]


SECRETS = {"api-key"}  # a bad value is not echoed: the key would reach a log


def named_once(value: str, message: str, flag: Flag | None = None) -> bool:
    """Whether `message` names `value` (quoted, or as a path a file's reader names) and not twice; for a
    secret, whether it leaves the value out."""
    if flag is not None and flag.name in SECRETS:
        return not value.strip() or value.strip() not in message
    quoted = message.count(repr(value))
    return quoted == 1 or quoted == 0 and bool(value) and message.count(value) == 1


def value_of(args: ServerArgs, flag: Flag) -> Any:
    return getattr(args.engine if flag.owner is EngineArgs else args, flag.field)


def test_every_setting_field_is_a_flag_or_marked_internal() -> None:
    flagged = [(f.owner, f.field) for f in SERVE_FLAGS]
    assert len(flagged) == len(set(flagged))
    for cls in (EngineArgs, ServerArgs):
        for field in dataclasses.fields(cls):
            is_flag, is_internal = "flag" in field.metadata, bool(field.metadata.get("internal"))
            assert is_flag != is_internal, f"{cls.__name__}.{field.name}: a flag, or internal with a reason"
            assert ((cls, field.name) in flagged) == is_flag, f"{cls.__name__}.{field.name} missing from serve"
    assert len({f.name for f in SERVE_FLAGS}) == len({f.env for f in SERVE_FLAGS}) == len(SERVE_FLAGS)


def test_the_tables_cover_every_flag() -> None:
    assert set(BAD) == set(GOOD) == set(BY_NAME)
    assert {name for name, values in BAD.items() if not values} == FREE_FORM
    for name, (env_text, env_value, flag_text, flag_value) in GOOD.items():
        # so that a variable ignored, or a flag losing to its variable, shows
        assert env_value != BY_NAME[name].default and flag_value != env_value, name


def test_empty_values_are_unset_where_the_flag_is_unset_by_default() -> None:
    """Deployment templates write empty values for what they leave unset (compose's `${X:-}`, Helm's `| quote`):
    an empty value of a flag unset by default, as a variable or on the command line, leaves it unset (an empty
    `MLASERVE_OMNIKV_CONFIG` read the current directory as the config, `--speculative-config ''` was not JSON).
    An empty value keeps its meaning where it has one (`MLASERVE_ALLOWED_ORIGINS=`: no CORS, not the default
    `*`), and is refused where it has none (`MLASERVE_PORT=`, `MLASERVE_DEVICE=` on a CUDA image's
    environment would otherwise run on the CPU), never quietly replaced by the default."""
    base = parse_serve_args([], environ={})
    unset_by_default = [f for f in SERVE_FLAGS if f.default is None]
    assert {"omnikv-config", "speculative-config", "context-length"} <= {f.name for f in unset_by_default}
    for f in unset_by_default:
        assert value_of(parse_serve_args([], environ={f.env: ""}), f) == value_of(base, f), f.env
        assert value_of(parse_serve_args([f"--{f.name}", ""], environ={}), f) == value_of(base, f), f.name
    assert parse_serve_args([], environ={"MLASERVE_ALLOWED_ORIGINS": ""}).allowed_origins == ""
    for env in ("MLASERVE_PORT", "MLASERVE_DEVICE", "MLASERVE_HOST"):
        with pytest.raises(SystemExit):
            parse_serve_args([], environ={env: ""})


@pytest.mark.parametrize(("flag", "value"), FLAG_CASES, ids=[f"{f.name}={v!r}" for f, v in FLAG_CASES])
def test_bad_flag_value_exits_2_naming_the_flag(flag: Flag, value: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        parse_serve_args([f"--{flag.name}", value], environ={})
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --{flag.name}:" in err and named_once(value, err, flag), err
    assert len(err.strip().splitlines()) == 1 and "--help" in err, err  # one line, not the whole usage


@pytest.mark.parametrize(("flag", "value"), FLAG_CASES, ids=[f"{f.env}={v!r}" for f, v in FLAG_CASES])
def test_bad_environment_value_exits_2_naming_the_variable(flag: Flag, value: str,
                                                           capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        parse_serve_args([], environ={flag.env: value})
    assert info.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mlaserve serve: error: {flag.env}: "), err
    assert named_once(value, err[0], flag), err
    assert not captured.out
    for choice in flag.spec.choices or ():  # the allowed values are listed
        assert choice in err[0]


@pytest.mark.parametrize("name", GOOD)
def test_a_good_variable_arrives_and_a_flag_beats_it(name: str) -> None:
    flag = BY_NAME[name]
    env_text, env_value, flag_text, flag_value = GOOD[name]
    environ = {**BASE_ENV, **ROW_ENV.get(name, {}), flag.env: env_text}
    assert value_of(parse_serve_args([], environ=environ), flag) == env_value
    assert value_of(parse_serve_args([f"--{flag.name}", flag_text], environ=environ), flag) == flag_value


def test_a_bare_boolean_flag_means_true() -> None:
    for name in ("disable-cuda-graph", "disable-prefix-cache"):
        flag = BY_NAME[name]
        assert value_of(parse_serve_args([f"--{name}"], environ={flag.env: "false"}), flag) is True


def test_a_bad_variable_under_its_flag_is_a_warning_not_an_error(capsys: pytest.CaptureFixture) -> None:
    """The flag wins (as --help says), so the variable is not used: a bad value there is named in a warning
    and does not stop the command; without the flag it does."""
    args = parse_serve_args(["--port", "8001"], environ={"MLASERVE_PORT": "eighty", "MLASERVE_DTYPE": "float32"})
    assert args.port == 8001 and args.engine.dtype == "float32"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mlaserve serve: warning: MLASERVE_PORT is ignored, as --port on the command line wins; its value "
                   "would be refused: expected an integer, got 'eighty'"], err
    with pytest.raises(SystemExit) as info:
        parse_serve_args([], environ={"MLASERVE_PORT": "eighty"})
    assert info.value.code == 2 and "MLASERVE_PORT: expected an integer, got 'eighty'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # another bad variable is still an error
        parse_serve_args(["--port", "8001"], environ={"MLASERVE_PORT": "eighty", "MLASERVE_DTYPE": "fp8"})
    assert info.value.code == 2 and "MLASERVE_DTYPE: invalid choice 'fp8'" in capsys.readouterr().err


def test_a_misspelt_variable_is_named_with_the_one_meant(capsys: pytest.CaptureFixture) -> None:
    args = parse_serve_args([], environ={"MLASERVE_MAX_RUNINGG_REQUESTS": "4", "MLASERVE_PORT": "8123",
                                         "MLASERVE_CPP_EXPERTS_THREADS": "2"})
    assert args.engine.max_running_requests == EngineArgs.max_running_requests and args.port == 8123
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mlaserve serve: warning: MLASERVE_MAX_RUNINGG_REQUESTS is not a variable mlaserve reads, so it "
                   "is ignored (did you mean MLASERVE_MAX_RUNNING_REQUESTS?)"], err


def test_every_mlaserve_variable_in_the_code_is_known() -> None:
    """Each MLASERVE_* name the project reads or documents (outside the tests) is a flag's variable or in
    OTHER_VARIABLES, so that `serve` never warns about a variable something does read."""
    import re

    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    files = listed.stdout.split()
    known = {f.env for f in SERVE_FLAGS} | OTHER_VARIABLES
    seen: dict[str, str] = {}
    for name in files:
        path = Path(REPO) / name
        if name.startswith("tests/") or not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        for var in re.findall(r"MLASERVE_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")):
            seen.setdefault(var, name)
    assert "MLASERVE_CPP_EXPERTS_WAIT" in seen and "MLASERVE_MAX_TOTAL_TOKENS" in seen, seen
    assert {v: f for v, f in seen.items() if v not in known} == {}


def test_empty_key_and_name_mean_the_default() -> None:
    args = parse_serve_args([], environ={"MLASERVE_API_KEY": "", "MLASERVE_SERVED_MODEL_NAME": "",
                                         "MLASERVE_CHAT_TEMPLATE": "", "MLASERVE_RUNTIME_FILE": ""})
    assert args.api_key is None and args.served_model_name is None and args.chat_template is None
    assert args.runtime_file is None


def test_defaults_are_the_fields_defaults() -> None:
    args = parse_serve_args([], environ={})
    assert args == ServerArgs()
    assert args.max_request_bytes is None  # derived from the context once the model is known
    # prefill: on a CPU a step's budget is one chunk (running streams wait for one chunk at most); on a GPU a
    # step takes several requests' chunks, at least one whole
    assert (args.engine.prefill_chunk(), args.engine.prefill_budget()) == (512, 512)
    gpu = parse_serve_args(["--device", "cuda"], environ={}).engine
    assert (gpu.prefill_chunk(), gpu.prefill_budget()) == (2048, 8192)
    for device, budget in (("cpu", 10000), ("cuda:1", 10000)):
        chunked = parse_serve_args(["--chunked-prefill-size", "10000", "--device", device], environ={}).engine
        assert (chunked.prefill_chunk(), chunked.prefill_budget()) == (10000, budget)
    small = parse_serve_args(["--chunked-prefill-size", "64"], environ={}).engine
    assert small.prefill_budget() == 64


def test_settings_pickle_for_the_engine_process() -> None:
    args = parse_serve_args(["--dtype", "float32", "--seed", "7"], environ={})
    assert pickle.loads(pickle.dumps(args)) == args


def test_help_names_each_flag_variable_and_default(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        parse_serve_args(["--help"], environ={"MLASERVE_DTYPE": "bogus"})  # help works whatever the environment
    assert info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "None" not in help_text  # a derived default is said in words
    for f in SERVE_FLAGS:
        default = f.spec.default_text or (str(f.default).lower() if f.kind is bool else str(f.default))
        assert f"--{f.name}" in help_text and f"[{f.env}] (default: {default})" in help_text, f.name


def test_choice_lists_match_the_implementations() -> None:
    """The torch-free lists in engine.args against the registries the engine process uses."""
    import executor.cuda_graph_runner
    import kernels.attention
    import models.experts
    import models.loader.load
    import models.native

    assert DTYPES == ("auto", *models.loader.load.DTYPES)
    assert CPU_WEIGHT_DTYPES == models.native.CPU_WEIGHT_DTYPES
    assert ATTENTION_BACKENDS == kernels.attention.BACKENDS
    assert EXPERT_BACKENDS == models.experts.EXPERT_BACKENDS
    assert HYBRID_GRAPH_MODES == executor.cuda_graph_runner.HYBRID_GRAPH_MODES


@pytest.mark.parametrize("flags", [["--attention-backend", "triton"], ["--expert-backend", "triton"]])
def test_triton_backends_need_cuda(flags: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        parse_serve_args(flags, environ={})
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and f"{flags[0]} triton needs --device cuda" in err[0], err
    assert parse_serve_args(flags, environ={"TRITON_INTERPRET": "1"}).engine.device == "cpu"  # the CPU interpreter
    assert parse_serve_args([*flags, "--device", "cuda:0"], environ={}).engine.device == "cuda:0"


@pytest.mark.parametrize("flags,message", [
    (["--max-total-tokens", "8"], "--max-total-tokens 8 leaves too few KV slots to serve any request (at least 32)"),
])
def test_settings_no_request_could_use_are_refused(flags: list[str], message: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    """A cache too small for any request (the server said ready, then refused every request) and
    speculative decoding with pages (it was turned off with a warning, the help saying it is not taken): one
    line, exit 2, before the model loads."""
    with pytest.raises(SystemExit) as info:
        parse_serve_args(flags, environ={})
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and message in err[0], err
    assert parse_serve_args(["--max-total-tokens", "32"], environ={}).engine.max_total_tokens == 32


@pytest.mark.parametrize("flags,named,message", [
    (["--dp", "2", "--tp", "2", "--nnodes", "2", "--master-port", "29500"], ("--dp 2", "--nnodes 2"),
     "data-parallel replicas are one machine's"),
    (["--dp", "2", "--tp", "2", "--master-port", "29500"], ("--dp 2", "--master-port 29500"), "needs --master-port 0"),
])
def test_dp_combinations_are_refused(flags: list[str], named: tuple[str, ...], message: str,
                                     capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        parse_serve_args(flags, environ={})
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and message in err[0], err
    assert all(n in err[0] for n in named), err
    assert parse_serve_args(flags[:2], environ={}).dp == 2  # alone it is fine, and so with --tp on a free port
    assert parse_serve_args(["--dp", "2", "--tp", "2"], environ={}).engine.tp == 2


@pytest.mark.parametrize("flags", [["--tp", "2"], ["--dp", "2", "--dp-attention"]])
def test_omnikv_and_its_bank_combine_with_split_ranks(flags: list[str]) -> None:
    """Each rank selects with the others (--tp) or alone (--dp-attention) and keeps its own bank
    (tests/server/test_tensor_parallel_e2e.py serves them)."""
    engine = parse_serve_args([*flags, "--omnikv", "on", "--omnikv-bank"], environ={}).engine
    assert engine.omnikv == "on" and engine.omnikv_bank


def test_float32_weights_refuse_a_rounding_dtype(capsys: pytest.CaptureFixture) -> None:
    """`--cpu-weight-dtype float32` promises an exact forward: a bf16 `--dtype` would round its norms and
    activations, so the pair is refused; `auto` and float32 are what it means, and the torch forward
    (which ignores the weight dtype) takes any."""
    with pytest.raises(SystemExit) as info:
        parse_serve_args(["--cpu-weight-dtype", "float32", "--dtype", "bfloat16"], environ={})
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and "--cpu-weight-dtype float32" in err[0], err
    assert "--dtype bfloat16" in err[0], err
    for dtype in ("auto", "float32"):
        assert parse_serve_args(["--cpu-weight-dtype", "float32", "--dtype", dtype], environ={}).engine.dtype == dtype
    flags = ["--cpu-weight-dtype", "float32", "--dtype", "bfloat16", "--cpu-kernels", "torch"]
    assert parse_serve_args(flags, environ={}).engine.dtype == "bfloat16"


def test_dp_with_nodes_from_the_environment_names_the_variables(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        parse_serve_args([], environ={"MLASERVE_DP": "3", "MLASERVE_TP": "2", "MLASERVE_NNODES": "2",
                                      "MLASERVE_MASTER_PORT": "29500"})
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and "MLASERVE_DP=3" in err[0] and "MLASERVE_NNODES=2" in err[0], err


def test_a_combination_from_the_environment_names_the_variables(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        parse_serve_args([], environ={"MLASERVE_ATTENTION_BACKEND": "triton", "MLASERVE_DEVICE": "cpu"})
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert "MLASERVE_ATTENTION_BACKEND='triton'" in err[0] and "MLASERVE_DEVICE='cpu'" in err[0], err


def test_generate_shares_the_engine_flags(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    for var in [v for v in os.environ if v.startswith("MLASERVE_")]:
        monkeypatch.delenv(var)
    with pytest.raises(SystemExit) as info:
        cli_main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert info.value.code == 0
    for name in ("model", "device", "dtype"):
        assert f"[{BY_NAME[name].env}] (default: {BY_NAME[name].default})" in help_text
    assert "{" + ",".join(DTYPES) + "}" in help_text
    monkeypatch.setenv("MLASERVE_DTYPE", "bogus")
    with pytest.raises(SystemExit) as info:
        cli_main(["generate", "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and err == [
        "mlaserve generate: error: MLASERVE_DTYPE: invalid choice 'bogus' (choose from "
        + ", ".join(DTYPES) + ")"]
    monkeypatch.delenv("MLASERVE_DTYPE")
    for argv in (["--device", "tpu"], ["--max-tokens", "0"]):
        with pytest.raises(SystemExit) as info:
            cli_main(["generate", "--prompt", "hi", *argv])
        assert info.value.code == 2 and f"argument {argv[0]}:" in capsys.readouterr().err


def test_a_bad_variable_stops_serve_before_it_binds_the_port() -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLASERVE_")}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "mlaserve.cli", "serve", "--port", str(port)], cwd=REPO,
                            env={**env, "MLASERVE_DTYPE": "bogus"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    listened = False
    try:
        while proc.poll() is None and time.monotonic() - t0 < 30:  # watch the port while it runs
            with socket.socket() as s:
                listened |= s.connect_ex(("127.0.0.1", port)) == 0
            time.sleep(0.01)
    finally:
        if proc.poll() is None:  # it started serving: stop it (and its engine) rather than leak it
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    out, err = proc.communicate()
    assert proc.returncode == 2 and time.monotonic() - t0 < 30 and not listened
    lines = err.strip().splitlines()
    assert lines == ["mlaserve serve: error: MLASERVE_DTYPE: invalid choice 'bogus' (choose from "
                     + ", ".join(DTYPES) + ")"], err
    assert not out


def test_a_host_that_does_not_resolve_stops_serve_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture) -> None:
    """Refused before the model loads, in one line naming --host (uvicorn's own error names nothing)."""
    for k in [k for k in os.environ if k.startswith("MLASERVE_")]:
        monkeypatch.delenv(k)
    assert cli_main(["serve", "--host", "999.1.1.1", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlaserve serve: error: --host '999.1.1.1' is not an address"), err


def test_the_seed_has_the_range_of_a_request_seed(capsys: pytest.CaptureFixture) -> None:
    """--seed and a request's `seed` fit in 64 bits alike: each edge is taken or refused by both."""
    from scheduler.sampling_params import SamplingParams

    for seed in (-(2**63) - 1, -(2**63), -1, 0, 2**63, 2**64 - 1, 2**64, 10**23):
        try:
            SamplingParams(seed=seed).validate(vocab_size=100)
            request_ok = True
        except ValueError:
            request_ok = False
        try:
            flag_ok = parse_serve_args(["--seed", str(seed)], environ={}).engine.seed == seed
        except SystemExit as e:
            assert e.code == 2
            flag_ok = False
        assert flag_ok == request_ok, seed
    capsys.readouterr()
    with pytest.raises(SystemExit):
        parse_serve_args(["--seed", "99999999999999999999999"], environ={})
    assert capsys.readouterr().err.strip() == ("mlaserve serve: error: argument --seed: '99999999999999999999999' must "
                                               "fit in 64 bits (at most 18446744073709551615) (see mlaserve serve "
                                               "--help)")


@pytest.mark.parametrize(("name", "value", "says"), [
    ("allowed-origins", "foo", "'foo' is not an origin: give '*'"),
    ("allowed-origins", "http://a.example, foo", "'http://a.example, foo' holds 'foo', which is not an origin"),
    ("omnikv-config", "/x.json", "cannot read the OmniKV config /x.json: No such file or directory"),
    ("port", "0", "'0' must be a port number"),
])
def test_a_message_names_the_value_once(name: str, value: str, says: str, capsys: pytest.CaptureFixture) -> None:
    flag = BY_NAME[name]
    with pytest.raises(SystemExit):
        parse_serve_args([f"--{name}", value], environ={})
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mlaserve serve: error: argument --{name}: {says}") and named_once(value, err), err
    with pytest.raises(SystemExit):
        parse_serve_args([], environ={flag.env: value})
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mlaserve serve: error: {flag.env}: {says}") and named_once(value, err), err


def test_a_split_the_models_sizes_do_not_divide_is_named_before_anything_starts(tmp_path):
    """--tp (heads, MLP, each expert's rows) and --dp-attention (MLP, experts) split sizes read from the
    model's config.json or GGUF header, before a rank process starts (each used to load the model and
    fail with a traceback)."""
    import json

    import gguf

    from server.args import parallel_problem

    def hf(name: str, **config) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"vocab_size": 320, "hidden_size": 96, "num_hidden_layers": 2,
                                                   **config}))
        return d

    llama = hf("llama", model_type="llama", num_attention_heads=4, intermediate_size=128)
    assert parallel_problem(str(llama), 2, heads_split=True, ep=False) is None
    heads = parallel_problem(str(llama), 3, heads_split=True, ep=False)
    assert "number of attention heads (4)" in heads and "--dp-attention keeps attention whole" in heads
    mlp = parallel_problem(str(llama), 3, heads_split=False, ep=False)  # dp attention: the MLPs are split
    assert "intermediate size (128)" in mlp and "choose a --dp that divides it" in mlp and "--tp" not in mlp
    assert "has none (a dense model)" in parallel_problem(str(llama), 2, heads_split=True, ep=True)
    # each MoE family's own keys for its experts (DeepSeek's n_routed_experts, the Qwen MoEs' num_experts,
    # Mixtral's num_local_experts, absent: 8): --ep was refused for the latter as a dense model
    moe = hf("moe", model_type="qwen3_moe", num_attention_heads=6, num_key_value_heads=2, intermediate_size=100,
             num_experts=8, moe_intermediate_size=48)
    assert parallel_problem(str(moe), 3, heads_split=True, ep=False) is None  # no dense layer: 100 is not split
    assert "number of routed experts (8)" in parallel_problem(str(moe), 3, heads_split=True, ep=True)
    assert parallel_problem(str(moe), 1, heads_split=True, ep=True) is None
    assert parallel_problem(str(moe), 2, heads_split=True, ep=True) is None
    assert "routed experts' intermediate size (48)" in parallel_problem(str(moe), 5, heads_split=False, ep=False)
    mixtral = hf("mixtral", model_type="mixtral", num_attention_heads=6, num_key_value_heads=2, intermediate_size=40)
    assert parallel_problem(str(mixtral), 2, heads_split=True, ep=True) is None
    assert "number of routed experts (8)" in parallel_problem(str(mixtral), 3, heads_split=False, ep=True)
    qwen2 = hf("qwen2moe", model_type="qwen2_moe", num_attention_heads=6, num_key_value_heads=2, num_experts=6,
               moe_intermediate_size=48, shared_expert_intermediate_size=40, mlp_only_layers=[1], intermediate_size=60)
    assert "shared experts' intermediate size (40)" in parallel_problem(str(qwen2), 3, heads_split=True, ep=True)
    assert "dense MLPs' intermediate size (60)" in parallel_problem(str(qwen2), 8, heads_split=False, ep=True)
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_head_count(4)
    writer.add_expert_count(6)
    writer.add_expert_feed_forward_length(32)
    writer.add_leading_dense_block_count(1)
    writer.add_feed_forward_length(100)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "intermediate size (100)" in parallel_problem(str(path), 8, heads_split=False, ep=True)
    assert "number of attention heads (4)" in parallel_problem(str(path), 8, heads_split=True, ep=False)
    assert "number of routed experts (6)" in parallel_problem(str(path), 4, heads_split=True, ep=True)
    assert parallel_problem(str(path), 2, heads_split=True, ep=True) is None


def test_the_architecture_map_routes_every_flag() -> None:
    """docs/architecture.md §7 says where each flag goes: every serve flag has its row there, and the
    table names no flag that is gone."""
    import re

    text = (REPO / "docs" / "architecture.md").read_text()
    table = text[text.index("## 7. Flags"):text.index("## 8.")]
    rows = [line for line in table.splitlines() if line.startswith("| `--")]
    named = {m for line in rows for m in re.findall(r"`--([a-z0-9-]+)", line.split(" | ")[0])}
    assert named == {f.name for f in SERVE_FLAGS}, (sorted({f.name for f in SERVE_FLAGS} - named),
                                                    sorted(named - {f.name for f in SERVE_FLAGS}))


def test_a_page_larger_than_the_cache_is_refused(capsys: pytest.CaptureFixture) -> None:
    """The cache holds whole pages: a page past --max-total-tokens was one page of cache instead, silently
    larger than asked for."""
    with pytest.raises(SystemExit) as info:
        parse_serve_args(["--max-total-tokens", "4096", "--page-size", "5000"], environ={})
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert "--page-size 5000 is larger than --max-total-tokens 4096" in err[0], err
    assert parse_serve_args(["--max-total-tokens", "4096", "--page-size", "4096"], environ={}).engine.page_size == 4096


@pytest.mark.parametrize("value", ["abc", "0", "-3", "1.5"])
def test_a_bad_worker_thread_count_is_refused(value: str, capsys: pytest.CaptureFixture) -> None:
    """Read by the worker pool, not a flag: a bad value was ignored without a word (the default ran)."""
    with pytest.raises(SystemExit) as info:
        parse_serve_args([], environ={"MLASERVE_CPP_EXPERTS_THREADS": value})
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err.startswith(f"mlaserve serve: error: MLASERVE_CPP_EXPERTS_THREADS={value!r} "
                                                   "must be a whole number"), err
    assert parse_serve_args([], environ={"MLASERVE_CPP_EXPERTS_THREADS": " 3 "}).engine is not None


@pytest.mark.parametrize("argv,hint", [
    (["--max-model-len", "4096"], "--max-model-len is --context-length here"),
    (["--gpu-memory-utilization=0.9", "--tensor-parallel-size", "2"],
     "--gpu-memory-utilization is --mem-fraction here; --tensor-parallel-size is --tp here"),
    (["-np", "4"], "-np is --max-running-requests here"),
    (["smollm2-135m-instruct"], "the model is given as --model smollm2-135m-instruct"),
    (["-t", "4"], "MLASERVE_CPP_EXPERTS_THREADS=N sets it"),
])
def test_a_peer_servers_flag_names_ours(argv: list[str], hint: str, capsys: pytest.CaptureFixture) -> None:
    """vLLM's, SGLang's and llama.cpp's flags typed from habit (and vLLM's positional model) are refused, as
    unknown flags are, with the flag that does the nearest thing here named in the one line; an unknown
    flag of no peer gets no hint."""
    with pytest.raises(SystemExit) as info:
        parse_serve_args(argv, environ={})
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and "unrecognized arguments" in err[0] and hint in err[0], err
    with pytest.raises(SystemExit):
        parse_serve_args(["--bogus", "1"], environ={})
    err = capsys.readouterr().err.strip()
    assert err.endswith("unrecognized arguments: --bogus 1 (see mlaserve serve --help)"), err


def test_every_peer_flag_names_a_flag_of_serve() -> None:
    from server.args import PEER_FLAGS, SERVE_FLAGS

    ours = {f"--{f.name}" for f in SERVE_FLAGS}
    assert all(target.startswith("(") or target in ours for target in PEER_FLAGS.values()), PEER_FLAGS


def test_a_runtime_file_a_server_left_may_be_replaced(tmp_path: Path) -> None:
    """A runtime file a killed server left (JSON with host, port and pid) is replaced by the next one; a FIFO
    at the path is refused (it was replaced by a file, then removed)."""
    left = tmp_path / "server.json"
    left.write_text('{"host": "127.0.0.1", "port": 8000, "pid": 1}')
    assert parse_serve_args(["--runtime-file", str(left)], environ={}).runtime_file == str(left)
    (tmp_path / "empty").touch()  # `--runtime-file "$(mktemp)"`
    assert parse_serve_args(["--runtime-file", str(tmp_path / "empty")], environ={}).runtime_file
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(SystemExit):
        parse_serve_args(["--runtime-file", str(tmp_path / "link")], environ={})
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(SystemExit):
        parse_serve_args(["--runtime-file", str(tmp_path / "fifo")], environ={})


def test_a_header_claiming_billions_of_layers_is_left_to_the_loader(tmp_path: Path) -> None:
    """The OmniKV fit check planned the layers a header claimed before the weights were read: 2^31 - 1 of them
    took all the memory there was (the OOM killer ended `serve`, nothing said). Run with 2 GB of address space."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2147483647}')
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
            "from server.args import omnikv_problem; "
            f"assert omnikv_problem({str(model)!r}, None) is None; "
            f"assert omnikv_problem({str(model)!r}, {str(FIXTURES / 'two_filters.json')!r}) is None; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
