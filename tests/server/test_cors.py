"""CORS (`--allowed-origins`): a web page on an allowed origin can call the API and read every answer,
its errors included; preflights are answered before the API key is checked (a browser sends them
without one); an empty setting sends no CORS headers at all. The real app in-process, engine not started."""

from __future__ import annotations

import httpx
import pytest

from server.app import build_app
from server.args import ServerArgs
from server.metrics import Metrics
from server.state import ServerState

PAGE = "https://chat.example"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def client(origins: str, api_key: str | None = "k") -> httpx.AsyncClient:
    state = ServerState(model_name="m", metrics=Metrics("m"), api_key=api_key)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state, None, origins)), base_url="http://test")


def test_any_origin_is_the_default() -> None:
    assert ServerArgs().allowed_origins == "*"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_any_origin(anyio_backend) -> None:
    async with client("*") as c:
        pre = await c.options("/v1/chat/completions", headers=PREFLIGHT)
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == "*"
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        denied = await c.get("/v1/models", headers={"Origin": PAGE})  # no key: 401, readable by the page
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"
        assert denied.json()["error"]["code"] == "invalid_api_key"
        # past the key: the answer of a server whose model is loading, readable by the page
        ok = await c.get("/v1/models", headers={"Origin": PAGE, "Authorization": "Bearer k"})
        assert ok.status_code == 503 and ok.headers["access-control-allow-origin"] == "*"
        assert ok.json()["error"]["code"] == "loading" and ok.headers["retry-after"]
        # the ids the SDKs read (OpenAI's x-request-id, Anthropic's request-id) and Retry-After reach the page
        exposed = {h.strip().lower() for h in ok.headers["access-control-expose-headers"].split(",")}
        assert {"retry-after", "x-request-id", "request-id", "x-mlaserve-replica"} <= exposed


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_listed_origins_only(anyio_backend) -> None:
    async with client(f" {PAGE} , http://localhost:3000") as c:
        pre = await c.options("/v1/chat/completions", headers=PREFLIGHT)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == PAGE
        other = await c.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        err = other.json()["error"]  # in OpenAI's shape, as every error (Starlette's own was plain text)
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "cors_not_allowed", err
        assert "Disallowed CORS origin" in err["message"] and "--allowed-origins" in err["message"]
        plain = await c.get("/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in plain.headers


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_no_origins_no_headers(anyio_backend) -> None:
    async with client("") as c:
        pre = await c.options("/v1/chat/completions", headers=PREFLIGHT)
        assert pre.status_code in (401, 405) and "access-control-allow-origin" not in pre.headers
        resp = await c.get("/v1/models", headers={"Origin": PAGE, "Authorization": "Bearer k"})
        assert resp.status_code == 503 and "access-control-allow-origin" not in resp.headers  # loading
