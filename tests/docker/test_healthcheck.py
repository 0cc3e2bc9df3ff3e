"""docker/healthcheck.py follows the port the server really bound: the entrypoint command of
docker/Dockerfile, with its ENV, run here with `--port` on the command line (as `docker run mlaserve:cpu
--port P` does) is healthy on P while serving and unhealthy once stopped; and how the check reads the
runtime file (live, stale, missing, unreadable)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from models.synthetic import write_checkpoint
from tests.docker.test_docker_files import DOCKER, env_of, stages
from tests.server.server_process import _stop_with_parent, free_port

HEALTHCHECK = DOCKER / "healthcheck.py"
VENV_BIN = Path(sys.executable).parent


def _healthcheck_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mlaserve_healthcheck", HEALTHCHECK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hc = _healthcheck_module()


def _runtime_stage() -> list[tuple[str, str]]:
    return stages(DOCKER / "Dockerfile")[-1]


def _check(env: dict[str, str]) -> int:
    """The HEALTHCHECK as the image runs it: the script alone, with the container's environment."""
    return subprocess.run([sys.executable, str(HEALTHCHECK)], env=env, timeout=30).returncode


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tinyllama"), "tiny-llama", seed=5)


def test_the_images_point_the_check_at_the_runtime_file() -> None:
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        env = env_of(stages(DOCKER / dockerfile)[-1])
        assert env["MLASERVE_RUNTIME_FILE"] == hc.DEFAULT_RUNTIME_FILE, dockerfile


def test_the_entrypoint_with_a_flag_given_port_is_healthy_there(model_dir: Path, tmp_path: Path) -> None:
    runtime = _runtime_stage()
    entrypoint = json.loads([a for w, a in runtime if w == "ENTRYPOINT"][-1])
    cmd = [json.loads(a) for w, a in runtime if w == "CMD"]
    port = free_port()
    env = {**os.environ, **env_of(runtime)}  # the image's ENV: host 0.0.0.0, MLASERVE_PORT=8000, the runtime file
    env.update({
        "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}",  # the image's /opt/venv/bin is this venv's bin
        "MLASERVE_MODEL": str(model_dir),  # as `-e MLASERVE_MODEL=/models/...` would
        "MLASERVE_RUNTIME_FILE": str(tmp_path / "run" / "server.json"),
        # the variable names a port nothing listens on (not 8000, which this machine may use for something
        # else): the check must follow the flag, not the variable
        "MLASERVE_PORT": str(free_port()),
    })
    assert env["MLASERVE_HOST"] == "0.0.0.0"
    runtime_file = Path(env["MLASERVE_RUNTIME_FILE"])
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([*entrypoint, *(cmd[-1] if cmd else []), "--port", str(port), "--log-level", "warning"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_stop_with_parent)
    try:
        deadline = time.monotonic() + 180
        while _check(env) != 0:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "not healthy in 180 s: " + (tmp_path / "server.log").read_text()
            time.sleep(0.5)
        info = json.loads(runtime_file.read_text())
        assert info == {"host": "0.0.0.0", "port": port, "pid": proc.pid}
        assert hc.server_address(env) == ("127.0.0.1", port)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        log.close()
    assert rc == 0, (tmp_path / "server.log").read_text()
    assert not runtime_file.exists(), "the runtime file outlived its server"
    assert _check(env) == 1


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.mark.parametrize(("content", "env", "expected"), [
    (lambda: {"host": "0.0.0.0", "port": 9123, "pid": os.getpid()}, {"MLASERVE_PORT": "8001"}, ("127.0.0.1", 9123)),
    (lambda: {"host": "::", "port": 9124, "pid": os.getpid()}, {}, ("::1", 9124)),
    (lambda: {"host": "10.1.2.3", "port": 9125, "pid": os.getpid()}, {}, ("10.1.2.3", 9125)),
    (lambda: {"host": "0.0.0.0", "port": 9126, "pid": _dead_pid()}, {"MLASERVE_PORT": "8001"}, ("127.0.0.1", 8001)),
    (lambda: "{not json", {"MLASERVE_PORT": "8002"}, ("127.0.0.1", 8002)),
    (lambda: {"port": 9127}, {}, ("127.0.0.1", 8000)),  # no pid: not a file the server wrote
    (lambda: None, {}, ("127.0.0.1", 8000)),  # no file at all
    (lambda: None, {"MLASERVE_PORT": "x"}, ("127.0.0.1", 8000)),
], ids=["live", "ipv6-wildcard", "host", "stale", "garbage", "no-pid", "missing", "bad-port-variable"])
def test_where_the_check_asks(tmp_path: Path, content, env: dict[str, str], expected: tuple[str, int]) -> None:
    path = tmp_path / "server.json"
    value = content()
    if value is not None:
        path.write_text(value if isinstance(value, str) else json.dumps(value))
    assert hc.server_address({**env, "MLASERVE_RUNTIME_FILE": str(path)}) == expected
