"""Fields a request sends are never dropped silently: vLLM's extensions are served, a field the
server does not know is ignored with one warning per request naming it, or refused (400) under
``strict_request_fields``. Under asyncio and trio, on the mock (byte tokenizer: greedy counts
up from the last prompt byte, "abc" continues "def...")."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from helpers.serving import serving

pytestmark = pytest.mark.anyio

VLLM_FIELDS: dict[str, Any] = {
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.1,
    "ignore_eos": True,
    "min_tokens": 1,
    "skip_special_tokens": False,
    "include_stop_str_in_output": True,
    "stop_token_ids": [0],
    "allowed_token_ids": list(range(97, 123)),
    "bad_words": ["q"],
    "prompt_logprobs": 1,
}
"""vLLM's extensions that clients send, each with a value the engine serves."""


@pytest.fixture(scope="module")
async def client(anyio_backend: str) -> AsyncIterator[httpx.AsyncClient]:
    async with serving(multiprocess=False) as (client, _):
        yield client


@pytest.fixture(scope="module")
async def strict(anyio_backend: str) -> AsyncIterator[httpx.AsyncClient]:
    async with serving(settings={"strict_request_fields": True}, multiprocess=False) as (c, _):
        yield c


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "engine_core.server" and r.levelno == logging.WARNING
    ]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_unknown_fields_get_one_warning_naming_them(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture, endpoint: str
) -> None:
    prompt: dict[str, Any] = (
        {"prompt": "abc"}
        if endpoint == "/v1/completions"
        else {"messages": [{"role": "user", "content": "abc"}]}
    )
    body = {"model": "mock", **prompt, "max_tokens": 3, "temperature": 0}
    with caplog.at_level(logging.WARNING, logger="engine_core.server"):
        response = await client.post(endpoint, json={**body, "max_token": 5, "frobnicate": 1})
        assert response.status_code == 200, response.text
        assert _warnings(caplog) == [
            f"{endpoint}: ignored the request fields this server does not know: 'max_token', "
            "'frobnicate'"
        ]
        caplog.clear()
        response = await client.post(endpoint, json={**body, **VLLM_FIELDS})
        assert response.status_code == 200, response.text
        assert _warnings(caplog) == []  # every extension is served


async def test_strict_request_fields_refuse_them(strict: httpx.AsyncClient) -> None:
    body = {"model": "mock", "prompt": "abc", "max_token": 5}
    response = await strict.post("/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("max_token", "unknown_field")
    assert error["message"].startswith("unknown field 'max_token'")
    del body["max_token"]
    response = await strict.post("/v1/completions", json={**body, **VLLM_FIELDS})
    assert response.status_code == 200, response.text


async def test_allowed_token_ids_and_bad_words(client: httpx.AsyncClient) -> None:
    async def complete(**fields: Any) -> httpx.Response:
        body = {"model": "mock", "prompt": "abc", "max_tokens": 6, "temperature": 0, **fields}
        return await client.post("/v1/completions", json=body)

    assert (await complete()).json()["choices"][0]["text"] == "defghi"
    allowed = await complete(allowed_token_ids=[ord("x"), ord("y")])
    assert set(allowed.json()["choices"][0]["text"]) <= {"x", "y"}
    banned = (await complete(bad_words=["e", "g"])).json()["choices"][0]["text"]
    assert len(banned) == 6 and not {"e", "g"} & set(banned)
    response = await complete(bad_words=["ef"])
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "bad_words"
