"""The request-body limit follows the model's context: by default 16 bytes per token of context, at least
1 MiB, so a prompt that fits the context fits the body; beyond it a 413 names `--max-request-bytes` and
the limit. An explicit --max-request-bytes always wins."""

from __future__ import annotations

import json

import httpx
import pytest

from models.synthetic import load_preset, write_checkpoint
from server.app import body_limit, build_app
from server.metrics import Metrics
from server.state import ServerState
from tests.server.server_process import ServerProcess

JSON = {"content-type": "application/json"}


def pretty_prompt(num_tokens: int, token: int = 123, max_tokens: int = 1) -> bytes:
    """A completions body whose prompt is `num_tokens` token ids, pretty-printed as many clients send JSON
    (one id per line, indented): about 13 bytes per token."""
    return json.dumps({"prompt": [token] * num_tokens, "max_tokens": max_tokens}, indent=4).encode()


def asgi_client(context_length: int, fixed: int | None = None) -> httpx.AsyncClient:
    """The real app in-process; the engine is not started (a request that passes the body limit gets the
    503 "loading" of a server whose model is still loading), the context length is what it will report
    (0: not known yet)."""
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
        ok = await client.post("/v1/completions", content=fits, headers=JSON)
        assert ok.status_code == 503 and ok.json()["error"]["code"] == "loading"  # past the limit: the route answers
        big = await client.post("/v1/completions", content=b" " * (2 * limit), headers=JSON)
        assert big.status_code == 413
        err = big.json()["error"]
        assert err["code"] == "request_too_large" and "--max-request-bytes" in err["message"]
        assert str(limit) in err["message"] and str(context) in err["message"], err
    async with asgi_client(context, fixed=len(fits) - 1) as client:  # an explicit flag wins over the context
        small = await client.post("/v1/completions", content=fits, headers=JSON)
        assert small.status_code == 413 and "set by --max-request-bytes" in small.json()["error"]["message"]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_while_loading_a_large_body_is_told_to_retry_not_that_it_is_too_large(anyio_backend) -> None:
    """Before the engine reports its context the derived limit is unknown: a body over the 1 MiB floor
    gets the 503 "loading" with Retry-After (it may well fit once loaded), never a 413."""
    async with asgi_client(0) as client:
        early = await client.post("/v1/completions", content=pretty_prompt(100_000), headers=JSON)
        assert early.status_code == 503 and early.headers.get("retry-after"), early.text
        assert early.json()["error"]["code"] == "loading"
    async with asgi_client(0, fixed=1000) as client:  # a fixed limit is known from the start
        assert (await client.post("/v1/completions", content=pretty_prompt(1000), headers=JSON)).status_code == 413


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_while_loading_the_model_list_says_loading(anyio_backend) -> None:
    """/v1/models is no readiness probe that lies: while the model loads it answers the 503 "loading" that
    the completion routes answer (it answered 200 seconds before they could serve)."""
    async with asgi_client(0) as client:
        for path in ("/v1/models", "/v1/models/m"):
            r = await client.get(path)
            assert r.status_code == 503 and r.headers.get("retry-after"), r.text
            assert r.json()["error"]["code"] == "loading"


def test_served_long_context_model_takes_a_90_percent_prompt_and_refuses_a_2x_body(tmp_path) -> None:
    """Through a real server whose model has a 131072-token context (16 x context = 2 MiB > the floor).
    A 90% prompt (1.3 MB of JSON) passes the limit and is read in full: it is answered with the context
    check's 400, which counts its tokens (asking for one token more than fits keeps the test from waiting
    minutes for a CPU prefill of 118k tokens). Twice the limit, declared or streamed without a length, is
    413 naming the flag and the limit."""
    context = 131072
    config = load_preset("tiny-llama")
    config["max_position_embeddings"] = context
    model = write_checkpoint(tmp_path / "m", config, seed=13)
    srv = ServerProcess(str(model), "--context-length", str(context), "--max-running-requests", "1",
                        "--max-total-tokens", str(context), log=tmp_path / "log").wait_ready()
    try:
        assert httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"] == context
        limit = 16 * context
        prompt_tokens = int(0.9 * context)
        body = pretty_prompt(prompt_tokens, token=7, max_tokens=context - prompt_tokens + 1)
        assert 1 << 20 < len(body) < limit
        ok = httpx.post(srv.url + "/v1/completions", content=body, headers=JSON, timeout=120)
        assert ok.status_code == 400, ok.text  # not 413
        err = ok.json()["error"]
        assert err["code"] == "context_length_exceeded" and f"has {prompt_tokens} prompt tokens" in err["message"]

        big = httpx.post(srv.url + "/v1/completions", content=b" " * (2 * limit), headers=JSON, timeout=60)
        assert big.status_code == 413, big.text
        err = big.json()["error"]
        assert err["code"] == "request_too_large" and "--max-request-bytes" in err["message"]
        assert f"limit of {limit} bytes" in err["message"], err

        def chunks():  # no Content-Length: the limit is enforced while reading
            for _ in range(2 * limit // (64 << 10)):
                yield b" " * (64 << 10)

        streamed = httpx.post(srv.url + "/v1/completions", content=chunks(), headers=JSON, timeout=60)
        assert streamed.status_code == 413 and "--max-request-bytes" in streamed.json()["error"]["message"]
    finally:
        assert srv.stop() == 0, srv.log()
