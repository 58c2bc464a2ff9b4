"""``/v1/completions`` with ``echo`` and ``logprobs`` as vLLM serves it (what ``lm-eval``'s
``local-completions`` sends for every loglikelihood task): the prompt's tokens and their logprobs
lead the columns, the first ``null``; ``max_tokens`` 0 answers the prompt alone. Whole and
streamed, under asyncio and trio, on the mock (byte tokenizer), checked against the offline
engine's prompt logprobs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from helpers.serving import serving

from engine_core import LLM, SamplingParams

pytestmark = pytest.mark.anyio

PROMPTS = [list(b"the cat sat"), list(b"a dog")]


@pytest.fixture(scope="module")
async def client(anyio_backend: str) -> AsyncIterator[httpx.AsyncClient]:
    async with serving(multiprocess=False) as (client, _):
        yield client


@pytest.fixture(scope="module")
def offline() -> list[list[dict[int, float] | None]]:
    """Each prompt's logprobs as the offline engine gives them: {token id: logprob} of the top
    candidate and the prompt's own token at each position."""
    with LLM(backend="mock", tokenizer="byte") as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
            use_tqdm=False,
        )
    result = []
    for out in outs:
        assert out.prompt_logprobs is not None
        result.append(
            [
                None if p is None else {t: lp.logprob for t, lp in p.items()}
                for p in out.prompt_logprobs
            ]
        )
    return result


def _body(**fields: Any) -> dict[str, Any]:
    """What lm-eval's local-completions sends for a batch of loglikelihood requests."""
    return {
        "model": "mock",
        "prompt": PROMPTS,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
        "seed": 1234,
        **fields,
    }


def _check_prompt_columns(
    logprobs: dict[str, Any], prompt: list[int], expected: list[dict[int, float] | None]
) -> None:
    assert logprobs["tokens"][: len(prompt)] == [chr(t) for t in prompt]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position, token_id in enumerate(prompt[1:], start=1):
        want = expected[position]
        assert want is not None
        assert logprobs["token_logprobs"][position] == want[token_id]
        top = logprobs["top_logprobs"][position]
        assert max(top.values()) == max(want.values())
        assert top[chr(token_id)] == want[token_id]


@pytest.mark.parametrize("max_tokens", [0, 1])
async def test_echo_with_logprobs_leads_with_the_prompt(
    client: httpx.AsyncClient, offline: list[list[dict[int, float] | None]], max_tokens: int
) -> None:
    response = await client.post("/v1/completions", json=_body(max_tokens=max_tokens))
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for choice, prompt, expected in zip(choices, PROMPTS, offline, strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + max_tokens
        assert choice["text"][: len(prompt)] == bytes(prompt).decode()
        assert len(choice["text"]) == len(prompt) + max_tokens
        assert logprobs["text_offset"] == list(range(len(prompt) + max_tokens))
        _check_prompt_columns(logprobs, prompt, expected)
        assert choice["finish_reason"] == "length"
        # lm-eval's reading: the continuation's logprobs are [ctxlen:-1] of the echoed columns.
        assert all(isinstance(x, float) for x in logprobs["token_logprobs"][1:])


async def test_echo_with_logprobs_streamed(
    client: httpx.AsyncClient, offline: list[list[dict[int, float] | None]]
) -> None:
    body = _body(max_tokens=1, prompt=PROMPTS[0], stream=True)
    columns: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    text = ""
    async with client.stream("POST", "/v1/completions", json=body) as stream:
        async for line in stream.aiter_lines():
            if not line.startswith("data: {"):
                continue
            (choice,) = json.loads(line.removeprefix("data: "))["choices"]
            text += choice["text"]
            for name, values in columns.items():
                values += (choice["logprobs"] or {}).get(name, [])
    assert text[:-1] == bytes(PROMPTS[0]).decode() and len(text) == len(PROMPTS[0]) + 1
    assert len(columns["tokens"]) == len(PROMPTS[0]) + 1
    _check_prompt_columns({**columns}, PROMPTS[0], offline[0])


async def test_prompt_logprobs_as_vllm_gives_them(
    client: httpx.AsyncClient, offline: list[list[dict[int, float] | None]]
) -> None:
    body = {"model": "mock", "prompt": PROMPTS[1], "max_tokens": 1, "prompt_logprobs": 1}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPTS[1])
    for position, token_id in enumerate(PROMPTS[1][1:], start=1):
        entry = entries[position][str(token_id)]
        assert entry["logprob"] == offline[1][position][token_id]  # type: ignore[index]
        assert entry["decoded_token"] == chr(token_id)
    chat = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    response = await client.post("/v1/chat/completions", json={**chat, "prompt_logprobs": 0})
    assert response.status_code == 200, response.text
    entries = response.json()["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:])


async def test_max_tokens_zero_needs_echo(client: httpx.AsyncClient) -> None:
    body = {"model": "mock", "prompt": "abc", "max_tokens": 0}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
    response = await client.post("/v1/completions", json={**body, "echo": True})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "abc"
