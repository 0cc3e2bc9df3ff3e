"""Docker HEALTHCHECK: exit 0 when the server's /health answers 200, 1 otherwise.

Stdlib only, so the image needs no curl. `/health` stays open when an API key is set, and answers
503 while the model loads, while the server drains on SIGTERM, and after the engine died.
The port comes from MLASERVE_PORT, so set the port by that variable rather than by `--port`.
"""

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("MLASERVE_PORT", "8000")
    url = f"http://127.0.0.1:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=4) as resp:
            return 0 if resp.status == 200 else 1
    except (urllib.error.URLError, OSError, ValueError):
        return 1


if __name__ == "__main__":
    sys.exit(main())
