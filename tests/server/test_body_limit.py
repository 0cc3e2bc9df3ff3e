"""The request-body limit follows the model's context: by default 16 bytes per token of context, at least
1 MiB, so a prompt that fits the context fits the body; beyond it a 413 names `--max-request-bytes`."""

from __future__ import annotations

import json

import httpx
import pytest

from models.synthetic import write_checkpoint
from server.app import body_limit, build_app
from server.metrics import Metrics
from server.state import ServerState
from tests.server.server_process import ServerProcess


def pretty_prompt(num_tokens: int, token: int = 123) -> bytes:
    """A completions body whose prompt is `num_tokens` token ids, pretty-printed as many clients send JSON
    (one id per line, indented): about 13 bytes per token."""
    return json.dumps({"prompt": [token] * num_tokens, "max_tokens": 1}, indent=4).encode()


def asgi_client(context_length: int, fixed: int | None = None) -> httpx.AsyncClient:
    """The real app in-process; the engine is not started (a request that passes the body limit gets the
    503 "loading" of a server whose model is still loading), the context length is what it will report."""
    state = ServerState(model_name="m", metrics=Metrics("m"), context_length=context_length)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state, fixed)), base_url="http://test")


def test_the_derived_limit() -> None:
    assert body_limit(None, 4096) == 1 << 20  # the floor
    assert body_limit(None, 131072) == 16 * 131072
    assert body_limit(5000, 131072) == 5000  # the flag wins


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_long_context_takes_a_90_percent_prompt_and_refuses_2x(anyio_backend) -> None:
    context = 131072
    limit = body_limit(None, context)
    fits = pretty_prompt(int(0.9 * context))
    assert 1 << 20 < len(fits) <= limit  # over the old fixed 1 MiB, under the derived limit
    async with asgi_client(context) as client:
        ok = await client.post("/v1/completions", content=fits, headers={"content-type": "application/json"})
        assert ok.status_code == 503 and ok.json()["error"]["code"] == "loading"  # past the limit: the route answers
        big = await client.post("/v1/completions", content=b" " * (2 * limit),
                                headers={"content-type": "application/json"})
        assert big.status_code == 413
        err = big.json()["error"]
        assert err["code"] == "request_too_large" and "--max-request-bytes" in err["message"]
        assert str(limit) in err["message"]
    async with asgi_client(context, fixed=len(fits) - 1) as client:  # an explicit flag wins over the context
        small = await client.post("/v1/completions", content=fits, headers={"content-type": "application/json"})
        assert small.status_code == 413 and "set by --max-request-bytes" in small.json()["error"]["message"]


def test_served_model_answers_a_90_percent_prompt_and_refuses_a_2x_body(tmp_path) -> None:
    """Through a real server: context 4096 (the 1 MiB floor applies). A prompt of 90% of the context is
    answered; a body of twice the limit, declared or streamed without a length, is 413 naming the flag."""
    model = write_checkpoint(tmp_path / "m", "tiny-llama", seed=13)
    srv = ServerProcess(str(model), "--context-length", "4096", log=tmp_path / "log").wait_ready()
    try:
        body = pretty_prompt(int(0.9 * 4096), token=7)
        ok = httpx.post(srv.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                        timeout=120)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens"] == int(0.9 * 4096)
        big = httpx.post(srv.url + "/v1/completions", content=b" " * (2 << 20),
                         headers={"content-type": "application/json"}, timeout=60)
        assert big.status_code == 413 and "--max-request-bytes" in big.json()["error"]["message"]

        def chunks():  # no Content-Length: the limit is enforced while reading
            for _ in range(40):
                yield b" " * (64 << 10)

        streamed = httpx.post(srv.url + "/v1/completions", content=chunks(),
                              headers={"content-type": "application/json"}, timeout=60)
        assert streamed.status_code == 413
    finally:
        assert srv.stop() == 0, srv.log()
