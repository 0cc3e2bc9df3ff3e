"""Docker HEALTHCHECK: exit 0 when the server's /health answers 200, 1 otherwise.

Stdlib only, so the image needs no curl. `/health` stays open when an API key is set, and answers
503 while the model loads, while the server drains on SIGTERM, and after the engine died.

Where the server listens: the runtime file it writes once it has bound its port (`--runtime-file`,
whose variable MLASERVE_RUNTIME_FILE the images set to /tmp/mlaserve/server.json: {host, port, pid}),
so `docker run mlaserve:cpu --port 9000` is checked on 9000. A file whose pid is no longer running is
stale (a server killed before it could remove it) and ignored. Without a usable file: MLASERVE_PORT,
then 8000.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping

DEFAULT_RUNTIME_FILE = "/tmp/mlaserve/server.json"  # what the images set MLASERVE_RUNTIME_FILE to
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}  # bound everywhere: ask on loopback


def pid_running(pid: int) -> bool:
    """Whether process `pid` exists (one of another user counts: signal 0 is then refused, not unknown)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def server_address(environ: Mapping[str, str]) -> tuple[str, int]:
    """(host, port) to ask: the live server's runtime file, else MLASERVE_PORT on loopback, else 8000."""
    path = environ.get("MLASERVE_RUNTIME_FILE") or DEFAULT_RUNTIME_FILE
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
        pid, port, host = int(info["pid"]), int(info["port"]), str(info.get("host", ""))
        if pid > 0 and 0 < port < 65536 and pid_running(pid):
            return WILDCARDS.get(host, host), port
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # no file (not written yet, or no runtime file configured), or not ours: the fallbacks
    try:
        return "127.0.0.1", int(environ.get("MLASERVE_PORT") or 8000)
    except ValueError:
        return "127.0.0.1", 8000


def main() -> int:
    host, port = server_address(os.environ)
    url = f"http://[{host}]:{port}/health" if ":" in host else f"http://{host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=4) as resp:
            return 0 if resp.status == 200 else 1
    except (urllib.error.URLError, OSError, ValueError):
        return 1


if __name__ == "__main__":
    sys.exit(main())
