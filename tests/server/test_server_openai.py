"""Where the server answers as OpenAI's API does, driven by the official ``openai`` client under
asyncio (uvicorn) and trio (hypercorn): model retrieval, ``n > 1`` at temperature 0,
``logit_bias``, ``stream_options`` without a stream, unknown chat roles, the SDK's ``parse()``
at its default temperature, vLLM's ``disable_any_whitespace``, ``/tokenize`` and
``/detokenize``.

The engine is the in-process mock with the byte tokenizer: greedy decoding counts up from the
last prompt byte ("abc" continues "def...", the chat prompt "user: hi\\nassistant:" continues
";<=>...").
"""

from __future__ import annotations

import functools
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx
import openai
import pydantic
import pytest
from helpers.serving import served, serving
from openai.types.chat import ChatCompletionMessageParam

from engine_core.server import ServerSettings

pytestmark = pytest.mark.anyio

T = TypeVar("T")
API_KEY = "test-key"
MODEL = "org/mock-model"
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture(
    scope="module",
    params=[("asyncio", "uvicorn"), ("trio", "hypercorn")],
    ids=lambda stack: "-".join(stack),
)
def stack(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def anyio_backend(stack: tuple[str, str]) -> str:
    return stack[0]


@dataclass
class Server:
    url: str
    client: openai.OpenAI
    http: httpx.Client

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A blocking client call in a worker thread, off the server's event loop."""
        with anyio.fail_after(20):
            return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


@pytest.fixture(scope="module")
async def server(stack: tuple[str, str]) -> AsyncIterator[Server]:
    settings = ServerSettings(
        port=0,
        api_key=API_KEY,
        served_model_names=(MODEL, "second"),
        http_server=stack[1],  # type: ignore[arg-type]
    )
    async with served([settings], multiprocess=False, max_model_len=256) as ([url], _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=10)
        http = httpx.Client(
            base_url=url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=10
        )
        try:
            yield Server(url, client, http)
        finally:
            client.close()
            http.close()


def error_of(info: pytest.ExceptionInfo[openai.APIStatusError]) -> dict[str, Any]:
    body = info.value.body
    assert isinstance(body, dict)
    return body


async def test_retrieve_a_model(server: Server) -> None:
    for name in (MODEL, "second"):  # MODEL holds a slash, which the client percent-encodes
        card = await server.call(server.client.models.retrieve, name)
        assert (card.id, card.object, card.owned_by) == (name, "model", "engine-core")
    with pytest.raises(openai.NotFoundError) as info:
        await server.call(server.client.models.retrieve, "nope")
    assert error_of(info)["code"] == "model_not_found"
    anonymous = await server.call(httpx.get, f"{server.url}/v1/models/second")
    assert anonymous.status_code == 401


async def test_n_with_temperature_zero_gives_identical_choices(server: Server) -> None:
    chat = await server.call(
        server.client.chat.completions.create,
        model=MODEL,
        messages=HI,
        n=3,
        temperature=0,
        max_tokens=3,
    )
    assert [(c.index, c.message.content) for c in chat.choices] == [
        (0, ";<="),
        (1, ";<="),
        (2, ";<="),
    ]
    completion = await server.call(
        server.client.completions.create,
        model=MODEL,
        prompt="abc",
        n=2,
        temperature=0,
        max_tokens=2,
    )
    assert [c.text for c in completion.choices] == ["de", "de"]


async def test_spaces_between_special_tokens_is_a_request_field(server: Server) -> None:
    # logit_bias forces the byte tokenizer's BOS (256, "<s>"), a special token kept in the text.
    texts = []
    for spaces in (True, False):
        completion = await server.call(
            server.client.completions.create,
            model=MODEL,
            prompt="abc",
            max_tokens=3,
            temperature=0,
            logit_bias={"256": 100},
            extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": spaces},
        )
        texts.append(completion.choices[0].text)
    assert texts == ["<s> <s> <s>", "<s><s><s>"]


async def test_stream_options_without_a_stream_is_a_400(server: Server) -> None:
    for create, extra in (
        (server.client.completions.create, {"prompt": "abc"}),
        (server.client.chat.completions.create, {"messages": HI}),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            await server.call(
                create, model=MODEL, max_tokens=2, stream_options={"include_usage": True}, **extra
            )
        error = error_of(info)
        assert error["param"] == "stream_options"
        assert "stream" in error["message"]


async def test_unknown_chat_role_is_a_400(server: Server) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as info:
        await server.call(
            server.client.chat.completions.create,
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=2,
        )
    error = error_of(info)
    assert error["param"] == "messages"
    assert "messages[1].role" in error["message"] and "'wizard'" in error["message"]
    for role in ("system", "developer"):
        ok = await server.call(
            server.client.chat.completions.create,
            model=MODEL,
            messages=[{"role": role, "content": "be brief"}, *HI],  # type: ignore[list-item]
            max_tokens=1,
            temperature=0,
        )
        assert ok.choices[0].message.content == ";"


async def test_logit_bias(server: Server) -> None:
    e, x = ord("e"), ord("x")
    completion = await server.call(
        server.client.completions.create,
        model=MODEL,
        prompt=["abc", "abc"],
        max_tokens=4,
        temperature=0,
        logit_bias={str(e): -100, str(x): 100},
    )
    assert [c.text for c in completion.choices] == ["xxxx", "xxxx"]
    chat = await server.call(
        server.client.chat.completions.create,
        model=MODEL,
        messages=HI,
        max_tokens=3,
        temperature=0,
        logit_bias={str(ord(";")): -100},
    )
    assert chat.choices[0].message.content == "<=>"
    for bias, piece in (
        ({"e": 1}, "logit_bias keys must be token ids, got 'e'"),
        ({"-1": 1}, "logit_bias keys must be token ids, got '-1'"),
        ({"9" * 20: 1}, "logit_bias keys must be token ids in [0, 2**63 - 1]"),
        ({"5": 101}, "logit_bias values must be in [-100, 100], got 101.0 for token 5"),
        ({"258": 1}, "logit_bias token ids [258] are outside the vocabulary (size 258)"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            await server.call(
                server.client.completions.create,
                model=MODEL,
                prompt="abc",
                max_tokens=2,
                logit_bias=bias,
            )
        error = error_of(info)
        assert error["param"] == "logit_bias", error
        assert piece in error["message"], error


async def test_tokenize_and_detokenize_in_vllms_shapes(server: Server) -> None:
    post = server.http.post
    tokenized = await server.call(post, "/tokenize", json={"model": MODEL, "prompt": "abc"})
    assert tokenized.status_code == 200
    assert tokenized.json() == {"count": 3, "max_model_len": 256, "tokens": [97, 98, 99]}
    chat = await server.call(
        post, "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert chat.json()["tokens"] == list(b"user: hi\nassistant:")
    # Longer than the context: counted, not refused (clients use it to check the length).
    long = await server.call(post, "/tokenize", json={"prompt": "x" * 300})
    assert (long.json()["count"], long.json()["max_model_len"]) == (300, 256)
    detokenized = await server.call(post, "/detokenize", json={"tokens": [97, 98, 99, 257]})
    assert detokenized.status_code == 200
    assert detokenized.json() == {"prompt": "abc</s>"}
    for path, body, status, param in (
        ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
        ("/tokenize", {"model": MODEL}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "return_token_strs": True}, 400, "return_token_strs"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "a"}]}, 400, "messages"),
        ("/detokenize", {"tokens": [97, 258]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ):
        response = await server.call(post, path, json=body)
        assert response.status_code == status, (path, body, response.text)
        assert response.json()["error"]["param"] == param, (path, body, response.text)
    anonymous = await server.call(httpx.post, f"{server.url}/tokenize", json={"prompt": "a"})
    assert anonymous.status_code == 401


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int


async def test_the_sdks_parse_completes_at_the_default_temperature(server: Server) -> None:
    pytest.importorskip("llguidance")
    for seed in (None, 1, 2, 3):
        completion = await server.call(
            server.client.chat.completions.parse,
            model=MODEL,
            messages=HI,
            response_format=Person,
            max_tokens=200,
            seed=seed,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)
        assert completion.usage is not None and completion.usage.completion_tokens <= 100


SCHEMA = Person.model_json_schema() | {"additionalProperties": False}


def _outside_strings(text: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


async def test_disable_any_whitespace_per_request(server: Server) -> None:
    pytest.importorskip("llguidance")
    spaced = []
    for compact in (False, True):
        for seed in range(8):  # the mock gives whitespace little weight: a few seeds draw some
            completion = await server.call(
                server.client.completions.create,
                model=MODEL,
                prompt="abc",
                max_tokens=200,
                seed=seed,
                extra_body={
                    "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": compact}
                },
            )
            text = completion.choices[0].text
            Person.model_validate_json(text)
            spaced.append((compact, bool(re.search(r"\s", _outside_strings(text)))))
    assert (False, True) in spaced
    assert (True, True) not in spaced


async def test_disable_any_whitespace_as_the_servers_default() -> None:
    pytest.importorskip("llguidance")
    async with serving(multiprocess=False, settings={"disable_any_whitespace": True}) as (
        client,
        _,
    ):
        for seed in range(5):
            response = await client.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 200,
                    "seed": seed,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "person", "schema": SCHEMA},
                    },
                },
            )
            assert response.status_code == 200, response.text
            text = response.json()["choices"][0]["message"]["content"]
            Person.model_validate_json(text)
            assert not re.search(r"\s", _outside_strings(text)), text
