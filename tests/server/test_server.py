"""The OpenAI-compatible server, in this process's event loop, under asyncio and trio.

One server (in-process mock engine, byte tokenizer) is shared per runtime and HTTP server
(uvicorn and hypercorn under asyncio, hypercorn under trio); the official
``openai`` client drives it from a worker thread (its sync client works under both runtimes).
With the byte tokenizer, greedy decoding counts up from the last prompt byte: "abc" continues
"def...", and the chat template "user: hi\\nassistant:" continues ";<=>..." (":" is 58).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import httpx
import openai
import pytest
from helpers.serving import served
from helpers.tool_servers import in_thread
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

import engine_core
from engine_core import AsyncLLM
from engine_core.server import ServerSettings

pytestmark = pytest.mark.anyio

T = TypeVar("T")
API_KEY = "test-key"
MODEL = "mock-model"
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
CHAT_HI = "user: hi\nassistant:"
LN2 = math.log(2)


@pytest.fixture(scope="module")
def anyio_backend(stack: tuple[str, str]) -> str:
    return stack[0]


@dataclass
class Server:
    url: str
    engine: AsyncLLM
    clients: list[openai.OpenAI] = field(default_factory=list)
    """Every client made, closed with the server (their pooled sockets with them)."""

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        client = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=10.0
        )
        self.clients.append(client)
        return client


@pytest.fixture(scope="module")
async def server(stack: tuple[str, str]) -> AsyncIterator[Server]:
    settings = ServerSettings(
        port=0,
        api_key=API_KEY,
        served_model_names=(MODEL,),
        max_request_body_bytes=4096,
        http_server=stack[1],  # type: ignore[arg-type]
    )
    async with served(
        [settings],
        multiprocess=False,
        max_model_len=1024,
        backend_options={"latency": {"step_s": 0.001}},
    ) as ([url], engine):
        server = Server(url, engine)
        try:
            yield server
        finally:
            for client in server.clients:
                client.close()


async def complete(server: Server, **kwargs: Any) -> Completion:
    """A completion by the served model, of "abc" unless ``prompt`` is given."""
    return await in_thread(
        server.client().completions.create, **{"model": MODEL, "prompt": "abc", **kwargs}
    )


async def chat(server: Server, **kwargs: Any) -> ChatCompletion:
    """A chat completion by the served model, of ``HI`` unless ``messages`` are given."""
    return await in_thread(
        server.client().chat.completions.create, **{"model": MODEL, "messages": HI, **kwargs}
    )


async def complete_stream(server: Server, **kwargs: Any) -> list[Completion]:
    """Every chunk of a streamed :func:`complete`."""
    client = server.client()
    kwargs = {"model": MODEL, "prompt": "abc", **kwargs, "stream": True}
    return await in_thread(lambda: list(client.completions.create(**kwargs)))


async def chat_stream(server: Server, **kwargs: Any) -> list[ChatCompletionChunk]:
    """Every chunk of a streamed :func:`chat`."""
    client = server.client()
    kwargs = {"model": MODEL, "messages": HI, **kwargs, "stream": True}
    return await in_thread(lambda: list(client.chat.completions.create(**kwargs)))


async def wait_idle(engine: AsyncLLM) -> None:
    """Until the engine holds no request (an abort reaches it between two steps)."""
    with anyio.fail_after(5):
        while (stats := await engine.get_stats()).num_running or stats.num_waiting:
            await anyio.sleep(0.005)


async def metric_values(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The server's metrics now, by (name, sorted labels)."""
    response = await in_thread(httpx.get, f"{server.url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def error_body(info: pytest.ExceptionInfo[openai.APIStatusError]) -> dict[str, Any]:
    """The OpenAI error object of a failed call."""
    body = info.value.body
    assert isinstance(body, dict)
    return body


# -- completions ---------------------------------------------------------------------------------


async def test_completion(server: Server) -> None:
    result = await complete(server, max_tokens=5, temperature=0)
    assert [c.text for c in result.choices] == ["defgh"]
    assert result.choices[0].finish_reason == "length"
    assert result.model == MODEL and result.object == "text_completion"
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (3, 5)
    assert result.usage.total_tokens == 8


async def test_completion_stream_with_usage(server: Server) -> None:
    chunks = await complete_stream(
        server, max_tokens=6, temperature=0, stream_options={"include_usage": True}
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "defghi"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 6, 9)


async def test_completion_batch_token_ids_and_echo(server: Server) -> None:
    batch = await complete(server, prompt=["abc", "xyz"], max_tokens=3, temperature=0)
    assert [(c.index, c.text) for c in batch.choices] == [(0, "def"), (1, "{|}")]
    assert batch.usage is not None and batch.usage.prompt_tokens == 6
    ids = await complete(server, prompt=[97, 98, 99], max_tokens=2, temperature=0)
    assert ids.choices[0].text == "de"
    echo = await complete(server, max_tokens=2, temperature=0, echo=True)
    assert echo.choices[0].text == "abcde"


async def test_completion_stop_string(server: Server) -> None:
    result = await complete(server, max_tokens=10, temperature=0, stop=["g"])
    assert result.choices[0].text == "def"
    assert result.choices[0].finish_reason == "stop"
    # "g" was generated (it completed the stop string) and is counted; it is not shown.
    assert result.usage is not None and result.usage.completion_tokens == 4


async def test_completion_logprobs(server: Server) -> None:
    result = await complete(server, max_tokens=3, temperature=0, logprobs=2)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == ["d", "e", "f"]
    assert logprobs.token_logprobs == pytest.approx([-LN2] * 3)
    # The mock's synthetic distribution: rank r has logprob -r * ln 2, the greedy token rank 1.
    assert logprobs.top_logprobs == [
        pytest.approx({"d": -LN2, "e": -2 * LN2}),
        pytest.approx({"e": -LN2, "f": -2 * LN2}),
        pytest.approx({"f": -LN2, "g": -2 * LN2}),
    ]
    assert logprobs.text_offset == [0, 1, 2]
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in await complete_stream(server, max_tokens=3, temperature=0, logprobs=2):
        streamed = chunk.choices[0].logprobs
        if streamed is not None:
            tokens += streamed.tokens or []
            offsets += streamed.text_offset or []
    assert (tokens, offsets) == (["d", "e", "f"], [0, 1, 2])


async def test_completion_text_offset_counts_only_text_that_appears(server: Server) -> None:
    # The mock counts up from byte 254: 255 (an invalid byte), <s> and </s> (special tokens,
    # skipped in the text), then bytes 0 and 1.
    expected_tokens = ["\ufffd", "<s>", "</s>", "\x00", "\x01"]
    kwargs: dict[str, Any] = {
        "prompt": [254],
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": 0,
        "extra_body": {"ignore_eos": True},
    }
    result = await complete(server, **kwargs)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None
    assert result.choices[0].text == "\ufffd\x00\x01"
    assert logprobs.tokens == expected_tokens
    assert logprobs.text_offset == [0, 1, 1, 1, 2]
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in await complete_stream(server, **kwargs):
        streamed = chunk.choices[0].logprobs
        if streamed is not None:
            tokens += streamed.tokens or []
            offsets += streamed.text_offset or []
    assert (tokens, offsets) == (expected_tokens, [0, 1, 1, 1, 2])


async def test_completion_n2_sampled(server: Server) -> None:
    sampled: dict[str, Any] = {
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 7,
        "n": 2,
        "extra_body": {"ignore_eos": True},
    }
    result = await complete(server, **sampled)
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert result.usage is not None and result.usage.completion_tokens == 12
    # Each completion has its own seed (7 and 8), so they differ.
    assert result.choices[0].text != result.choices[1].text
    again = await complete(server, **sampled)
    assert [c.text for c in again.choices] == [c.text for c in result.choices]


# -- chat ----------------------------------------------------------------------------------------


async def test_chat(server: Server) -> None:
    result = await chat(server, max_completion_tokens=4, temperature=0)
    choice = result.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ";<=>"
    assert choice.finish_reason == "length" and result.object == "chat.completion"
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(CHAT_HI), 4)


async def test_chat_stream_n2_with_usage(server: Server) -> None:
    chunks = await chat_stream(
        server,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_tokens=5,
        temperature=0.7,
        seed=3,
        n=2,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    roles = []
    finishes = {}
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            if choice.delta.role is not None:
                roles.append((choice.index, choice.delta.role))
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert roles == [(0, "assistant"), (1, "assistant")]
    assert finishes == {0: "length", 1: "length"}
    assert len(texts[0]) == len(texts[1]) == 5  # the byte tokenizer: one character a token
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(CHAT_HI), 10)


async def test_chat_logprobs(server: Server) -> None:
    result = await chat(server, max_tokens=2, temperature=0, logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [(t.token, t.bytes) for t in content] == [(";", [59]), ("<", [60])]
    assert [t.logprob for t in content] == pytest.approx([-LN2, -LN2])
    assert [[(x.token, round(x.logprob, 6)) for x in t.top_logprobs] for t in content] == [
        [(";", round(-LN2, 6)), ("<", round(-2 * LN2, 6))],
        [("<", round(-LN2, 6)), ("=", round(-2 * LN2, 6))],
    ]


async def test_chat_stream_stop(server: Server) -> None:
    text, reason = "", None
    for chunk in await chat_stream(server, max_tokens=20, temperature=0, stop=">?"):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    assert (text, reason) == (";<=", "stop")


async def test_async_client_stream(server: Server, anyio_backend: str) -> None:
    """A client streaming in the server's own event loop: the openai async client under
    asyncio (where it runs), httpx's async client under trio."""
    if anyio_backend == "asyncio":
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=10.0
        ) as client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=3, temperature=0, stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    else:
        body = {"model": MODEL, "messages": HI, "max_tokens": 3, "temperature": 0, "stream": True}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with (
            httpx.AsyncClient(timeout=10.0) as client,
            client.stream(
                "POST", f"{server.url}/v1/chat/completions", json=body, headers=headers
            ) as response,
        ):
            assert response.status_code == 200
            events = [line async for line in response.aiter_lines() if line]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
    assert text == ";<="


async def test_structured_outputs(server: Server) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    result = await chat(
        server,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    content = result.choices[0].message.content
    assert content is not None and isinstance(json.loads(content)["a"], int)
    assert result.choices[0].finish_reason == "stop"
    digits = await complete(
        server,
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
    )
    assert re.fullmatch("[0-9]{3}", digits.choices[0].text)
    cases: list[tuple[str, dict[str, Any]]] = [
        ("structured_outputs", {"structured_outputs": {"regex": "[0-9"}}),  # fails in the engine
        ("structured_outputs", {"structured_outputs": {"regex": "a", "choice": ["b"]}}),
        ("response_format", {"response_format": {"type": "xml"}}),
        (
            "response_format",
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        ),
    ]
    for param, extra in cases:
        with pytest.raises(openai.BadRequestError) as info:
            await chat(server, extra_body=extra)
        assert error_body(info)["param"] == param, extra


# -- errors --------------------------------------------------------------------------------------


async def test_bad_parameter_is_400_naming_it(server: Server) -> None:
    cases: list[tuple[str, dict[str, Any]]] = [
        ("temperature", {"temperature": 3.5}),
        ("temperature", {"temperature": "hot"}),
        ("n", {"n": 0}),
        ("top_p", {"top_p": 0}),
        ("max_tokens", {"max_tokens": 0}),
        ("logprobs", {"logprobs": 50}),
    ]
    for param, extra in cases:
        with pytest.raises(openai.BadRequestError) as info:
            await complete(server, extra_body=extra)  # bypasses the client's own type checks
        assert info.value.status_code == 400
        body = error_body(info)
        assert body["param"] == param, (param, body)
        assert param in body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        await chat(server, max_completion_tokens=0)
    assert error_body(info)["param"] == "max_completion_tokens"


async def test_prompt_too_long_and_bad_json(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await complete(server, prompt="x" * 1024, max_tokens=1)
    assert error_body(info)["param"] == "prompt"
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    response = await in_thread(
        httpx.post, f"{server.url}/v1/completions", content=b"{not json", headers=headers
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_api_key_is_required_on_v1(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        await in_thread(server.client(api_key="wrong").completions.create, model=MODEL, prompt="a")
    assert info.value.status_code == 401
    assert error_body(info)["code"] == "invalid_api_key"
    missing = await in_thread(httpx.get, f"{server.url}/v1/models")
    assert missing.status_code == 401
    assert (await in_thread(httpx.get, f"{server.url}/health")).status_code == 200


async def test_unknown_model_is_404(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await complete(server, model="nope", prompt="a")
    assert error_body(info)["code"] == "model_not_found"


async def test_body_over_limit_is_413(server: Server) -> None:
    response = await in_thread(
        httpx.post,
        f"{server.url}/v1/completions",
        json={"model": MODEL, "prompt": "x" * 5000},
        headers={"authorization": f"Bearer {API_KEY}"},
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


async def test_paused_engine_is_503(server: Server) -> None:
    await server.engine.pause_generation(mode="abort")
    try:
        with pytest.raises(openai.InternalServerError) as info:
            await complete(server)
        assert info.value.status_code == 503
        assert error_body(info)["code"] == "retry_later"
        with pytest.raises(openai.InternalServerError) as info:  # a batch: every prompt fails
            await complete(server, prompt=["a", "b"])
        assert info.value.status_code == 503
    finally:
        await server.engine.resume_generation()
    done = await complete(server, max_tokens=1, temperature=0)
    assert done.choices[0].text == "d"


# -- other endpoints -----------------------------------------------------------------------------


async def test_models_version_health(server: Server) -> None:
    models = await in_thread(server.client().models.list)
    assert [m.id for m in models.data] == [MODEL]
    version = await in_thread(httpx.get, f"{server.url}/version")
    assert version.json() == {"version": engine_core.__version__}
    missing = await in_thread(httpx.get, f"{server.url}/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong_method = await in_thread(httpx.get, f"{server.url}/v1/completions")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == "method_not_allowed"


async def test_closing_a_stream_aborts_the_request(server: Server) -> None:
    before = await metric_values(server)

    def read_two_chunks_and_close() -> int:
        stream = server.client().chat.completions.create(
            model=MODEL, messages=HI, max_tokens=900, temperature=0, stream=True
        )
        seen = 0
        for _ in stream:
            seen += 1
            if seen == 2:
                break
        stream.close()
        return seen

    assert await in_thread(read_two_chunks_and_close) == 2
    await wait_idle(server.engine)
    stats = await server.engine.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_kv_blocks) == (
        0,
        0,
        stats.num_kv_blocks,
    )
    after = await metric_values(server)
    key = ("engine_core_request_success_total", (("finished_reason", "abort"),))
    assert after[key] - before.get(key, 0.0) == 1
    generated = ("engine_core_generation_tokens_total", ())
    assert 2 <= after[generated] - before[generated] < 900


async def test_metrics_count_the_requests_made(server: Server) -> None:
    before = await metric_values(server)
    await complete(server, max_tokens=4, temperature=0)
    await complete(server, prompt="abcd", max_tokens=9, temperature=0, stop="g")
    await chat_stream(server, max_tokens=3, temperature=0)
    after = await metric_values(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("engine_core_prompt_tokens_total") == 3 + 4 + len(CHAT_HI)
    # "abcd" stops at "g": e, f, g were generated.
    assert delta("engine_core_generation_tokens_total") == 4 + 3 + 3
    assert delta("engine_core_request_success_total", finished_reason="length") == 2
    assert delta("engine_core_request_success_total", finished_reason="stop") == 1
    for histogram in ("time_to_first_token", "e2e_request_latency"):
        assert delta(f"engine_core_{histogram}_seconds_count") == 3
    # 4 + 3 + 3 tokens: one gap fewer than tokens per request.
    assert delta("engine_core_inter_token_latency_seconds_count") == 3 + 2 + 2
    assert after[("engine_core_num_requests_running", ())] == 0
    assert after[("engine_core_kv_cache_usage_perc", ())] == 0
    for name in (
        "engine_core_num_requests_waiting",
        "engine_core_prefix_cache_hit_rate",
        "engine_core_num_preemptions_total",
        "engine_core_prefix_cache_queries_total",
    ):
        assert (name, ()) in after
