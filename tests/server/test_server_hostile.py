"""Malformed and hostile requests get a 4xx naming the field, under asyncio (uvicorn) and trio
(hypercorn), on both completion endpoints: integers beyond 64 bits, ``chat_template_kwargs``
that collide with the server's own template arguments, lengths past ``max_model_len``, bodies
nested too deep, limits a request can never meet (a 400, never a retryable 503). An exception
of the server's own code once generation has started stays a 500. The engine holds no request
afterwards."""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import httpx
import pytest
from helpers.serving import ONE_RUNNING_ONE_QUEUED, engine_full, serving

from engine_core import AsyncLLM, EngineConfig, SamplingParams
from engine_core._core.checks import json_nests_within
from engine_core._frontend.request_checks import check_request
from engine_core.errors import InvalidRequestError
from engine_core.server import _completions
from engine_core.server._errors import APIError, api_error_from
from engine_core.server._protocol import CompletionRequest
from engine_core.server._serving import MAX_BODY_DEPTH, decode_body

pytestmark = pytest.mark.anyio

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
BASES: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"prompt": "abc", "max_tokens": 2, "temperature": 0.0},
    CHAT: {"messages": HI, "max_tokens": 2, "temperature": 0.0},
}
BIG = 2**64  # one past what msgpack carries
CHAT_HI = "user: hi\nassistant:"  # the default template's rendering of HI


async def post(client: httpx.AsyncClient, path: str, body: Any) -> httpx.Response:
    with anyio.fail_after(10):
        return await client.post(path, json=body)


def error_of(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert isinstance(error, dict)
    return error


async def assert_idle(engine: AsyncLLM) -> None:
    """The engine holds no request (an abort reaches it between two steps)."""
    with anyio.fail_after(5):
        while (stats := await engine.get_stats()).num_running or stats.num_waiting:
            await anyio.sleep(0.005)


# -- 1. integers beyond 64 bits ------------------------------------------------------------------

# (extra fields, the param the 400 names), for both endpoints
HUGE_INTS: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": BIG}, "max_tokens"),
    ({"max_tokens": -BIG}, "max_tokens"),
    ({"top_k": BIG}, "top_k"),
    ({"seed": BIG}, "seed"),
    ({"seed": -BIG - 1}, "seed"),
    ({"priority": BIG}, "priority"),
    ({"priority": -BIG}, "priority"),
    ({"stop_token_ids": [1, BIG]}, "stop_token_ids"),
    ({"min_tokens": BIG}, "min_tokens"),
    ({"n": BIG, "temperature": 1.0}, "n"),
    ({"top_k": 10**400}, "top_k"),  # past what msgspec decodes into an int
]


async def test_integers_beyond_64_bits_are_a_400_naming_the_field() -> None:
    async with serving(multiprocess=False) as (client, engine):
        for path, base in BASES.items():
            for extra, param in HUGE_INTS:
                error = error_of(await post(client, path, {**base, **extra}))
                assert error["param"] == param, (path, extra, error)
                assert error["type"] == "invalid_request_error"
        prompts: list[Any] = [[1, BIG], [[1, 2], [3, -BIG]], [2**63], [-1]]
        for prompt in prompts:
            body = {**BASES[COMPLETIONS], "prompt": prompt}
            error = error_of(await post(client, COMPLETIONS, body))
            assert error["param"] == "prompt", (prompt, error)
        chat = {**BASES[CHAT], "max_completion_tokens": BIG}
        assert error_of(await post(client, CHAT, chat))["param"] == "max_completion_tokens"
        chat = {**BASES[CHAT], "logprobs": True, "top_logprobs": BIG}
        assert error_of(await post(client, CHAT, chat))["param"] == "top_logprobs"
        await assert_idle(engine)


# -- 2. chat_template_kwargs ---------------------------------------------------------------------


async def test_chat_template_kwargs_override_or_are_refused() -> None:
    async with serving(multiprocess=False) as (client, engine):
        base = BASES[CHAT]
        for name in ("messages", "chat_template", "tokenize"):
            body = {**base, "chat_template_kwargs": {name: []}}
            error = error_of(await post(client, CHAT, body))
            assert error["param"] == "chat_template_kwargs", error
            assert name in error["message"]
        bad_flag = {**base, "chat_template_kwargs": {"add_generation_prompt": "no"}}
        assert error_of(await post(client, CHAT, bad_flag))["param"] == "chat_template_kwargs"
        # As in vLLM, the template flags in chat_template_kwargs override the request's.
        plain = await post(client, CHAT, base)
        assert plain.json()["usage"]["prompt_tokens"] == len(CHAT_HI)
        body = {**base, "chat_template_kwargs": {"add_generation_prompt": False}}
        response = await post(client, CHAT, body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == len("user: hi\n")
        both = {**base, "chat_template_kwargs": {"continue_final_message": True}}
        assert error_of(await post(client, CHAT, both))["param"] == "continue_final_message"
        both["add_generation_prompt"] = False
        assert (await post(client, CHAT, both)).status_code == 200
        await assert_idle(engine)


async def test_chat_template_kwargs_reach_a_jinja_template() -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}{{ extra | default('') }}"
        "{% for i in range(count | default(0)) %}.{% endfor %}"
    )
    async with serving(multiprocess=False, settings={"chat_template": template}) as (client, _):
        base = BASES[CHAT]

        async def prompt_tokens(kwargs: dict[str, Any]) -> int:
            response = await post(client, CHAT, {**base, "chat_template_kwargs": kwargs})
            assert response.status_code == 200, response.text
            return int(response.json()["usage"]["prompt_tokens"])

        assert await prompt_tokens({}) == len("hi>")
        assert await prompt_tokens({"bos_token": "<s>", "extra": "!"}) == len("<s>hi>!")
        assert await prompt_tokens({"add_generation_prompt": False}) == len("hi")
        # A variable the template chokes on is the request's fault: a 400, not a 500.
        for kwargs in ({"count": "many"}, {"count": 10**9}, {"count": BIG - 1}):
            body = {**base, "chat_template_kwargs": kwargs}
            error = error_of(await post(client, CHAT, body))
            assert "chat template failed" in error["message"], error


# -- 3. lengths past max_model_len ---------------------------------------------------------------


async def test_lengths_past_the_context_are_a_400_naming_the_field() -> None:
    async with serving(multiprocess=False, max_model_len=64) as (client, engine):
        for path, base in BASES.items():
            body = {key: value for key, value in base.items() if key != "max_tokens"}
            error = error_of(await post(client, path, {**body, "min_tokens": 1_000_000}))
            assert error["param"] == "min_tokens", error  # completions: over the default 16
            error = error_of(await post(client, path, {**base, "max_tokens": 1_000_000}))
            assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
            assert "maximum context length is 64 tokens" in error["message"]
        chat = {**BASES[CHAT], "max_completion_tokens": 64 - len(CHAT_HI) + 1}
        assert error_of(await post(client, CHAT, chat))["param"] == "max_completion_tokens"
        chat = {"messages": HI, "min_tokens": 64 - len(CHAT_HI) + 1}
        error = error_of(await post(client, CHAT, chat))
        assert (error["param"], error["code"]) == ("min_tokens", "context_length_exceeded")
        exact = {**BASES[CHAT], "max_completion_tokens": 64 - len(CHAT_HI), "ignore_eos": True}
        response = await post(client, CHAT, exact)
        assert response.json()["usage"]["completion_tokens"] == 64 - len(CHAT_HI)
        # An explicit max_tokens that does not fit is refused even when it is OpenAI's default.
        long_prompt = {"prompt": "a" * 60, "max_tokens": 16, "temperature": 0.0}
        assert error_of(await post(client, COMPLETIONS, long_prompt))["param"] == "max_tokens"
        # Left out, it is what fits: 16 for completions (fewer if the prompt leaves less room),
        # the rest of the context for chat.
        del long_prompt["max_tokens"]
        response = await post(client, COMPLETIONS, {**long_prompt, "ignore_eos": True})
        choice = response.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("bcde", "length")
        short = {"prompt": "abc", "temperature": 0.0, "ignore_eos": True}
        usage = (await post(client, COMPLETIONS, short)).json()["usage"]
        assert usage["completion_tokens"] == 16
        unbounded = {"messages": HI, "temperature": 0.0, "ignore_eos": True}
        usage = (await post(client, CHAT, unbounded)).json()["usage"]
        assert usage["total_tokens"] == 64
        null = {"prompt": "abc", "max_tokens": None, "temperature": 0.0, "ignore_eos": True}
        usage = (await post(client, COMPLETIONS, null)).json()["usage"]
        assert usage["total_tokens"] == 64
        await assert_idle(engine)


# -- 4. nesting ----------------------------------------------------------------------------------


def nested(depth: int, inner: bytes = b"1") -> bytes:
    return b"[" * depth + inner + b"]" * depth


async def test_deep_json_is_a_400_and_cheap() -> None:
    async with serving(multiprocess=False) as (client, engine):
        for path in (COMPLETIONS, CHAT):
            for depth in (MAX_BODY_DEPTH, 5_000, 1_000_000):
                raw = b'{"model": null, "x": ' + nested(depth) + b"}"
                # CPU time of this thread, where both the client and the server run: a loaded
                # machine stretches the wall-clock time, not the work.
                started = time.thread_time()
                with anyio.fail_after(10):
                    response = await client.post(path, content=raw)
                assert time.thread_time() - started < 2.0
                error = error_of(response)
                assert f"deeper than {MAX_BODY_DEPTH} levels" in error["message"], error
                assert error["param"] is None  # x is no field
            deep_field = {**BASES[path], "stop": json.loads(nested(200, b'"x"'))}
            error = error_of(await post(client, path, deep_field))
            assert error["param"] == "stop", error
        not_json = b'{"prompt": "a", "x": ' + b"[" * 500 + b"}"
        error = error_of(await client.post(COMPLETIONS, content=not_json))
        assert "not valid JSON" in error["message"]
        # Brackets inside strings do not count.
        in_string = {**BASES[COMPLETIONS], "prompt": "[" * 1000 + '\\"{' * 100}
        assert (await post(client, COMPLETIONS, in_string)).status_code == 200
        await assert_idle(engine)


def test_nesting_check_is_exact() -> None:
    limit = 8
    assert json_nests_within(nested(limit), limit)
    assert not json_nests_within(nested(limit + 1), limit)
    assert json_nests_within(b'{"a": ' + nested(limit - 1) + b"}", limit)
    assert not json_nests_within(b'{"a": {"b": ' + nested(limit - 1) + b"}}", limit)
    wide = b"[" + b",".join([nested(limit - 1)] * 50) + b"]"
    assert json_nests_within(wide, limit)
    assert not json_nests_within(b"[" + wide + b"]", limit)
    # Strings hide brackets, escaped quotes and backslashes included.
    tricky = b'["[[[[[[[[[[", "\\"[[[[[[[[[[[", "\\\\", ' + nested(limit - 1) + b"]"
    assert json.loads(tricky)
    assert json_nests_within(tricky, limit)
    assert not json_nests_within(b'["\\\\", ' + nested(limit) + b"]", limit)


def test_nesting_check_takes_linear_time() -> None:
    size = 4 << 20
    bodies = [
        nested(size // 2, b""),
        b"[" + b"[]," * (size // 3) + b"[]]",
        b"[" + (nested(MAX_BODY_DEPTH - 1, b"") + b",") * (size // 256) + b"1]",
        b'["' + b'\\"[' * (size // 3) + b'"]',
    ]
    for body in bodies:
        started = time.thread_time()  # the work, however loaded the machine
        json_nests_within(body, MAX_BODY_DEPTH)
        assert time.thread_time() - started < 1.0  # about 0.05 s on one slow core


def test_decode_body_never_raises_but_api_errors() -> None:
    for raw in (nested(100_000), b"[" * 100_000, b'{"prompt": ' + nested(990) + b"}"):
        with pytest.raises(APIError) as info:
            decode_body(raw, CompletionRequest)
        assert info.value.status == 400


# -- 5. which field an error names ---------------------------------------------------------------


async def test_errors_name_the_field() -> None:
    async with serving(multiprocess=False) as (client, engine):
        for path, base in BASES.items():
            stop = {**base, "stop_token_ids": [100_000]}  # outside the byte vocabulary
            assert error_of(await post(client, path, stop))["param"] == "stop_token_ids"
            for missing in ("prompt", "messages"):
                if missing in base:
                    body = {key: value for key, value in base.items() if key != missing}
                    assert error_of(await post(client, path, body))["param"] == missing
        body = {**BASES[CHAT], "messages": [{"content": "no role"}]}
        error = error_of(await post(client, CHAT, body))
        assert error["param"] == "messages" and "role" in error["message"]
        for ids in ([300], [[1], [-1]]):
            body = {**BASES[COMPLETIONS], "prompt": ids}
            assert error_of(await post(client, COMPLETIONS, body))["param"] == "prompt"
        await assert_idle(engine)


async def test_server_errors_after_generation_started_are_500(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: Any) -> Any:
        raise ValueError("n is not what the server expected")  # names a field: not the client's

    async with serving(multiprocess=False) as (client, engine):
        monkeypatch.setattr(_completions, "_choices", broken)
        error = error_of(await post(client, COMPLETIONS, BASES[COMPLETIONS]), 500)
        assert error["type"] == "server_error"
        monkeypatch.setattr(_completions._CompletionStream, "events", broken)
        stream = {**BASES[COMPLETIONS], "stream": True}
        assert error_of(await post(client, COMPLETIONS, stream), 500)["type"] == "server_error"
        await assert_idle(engine)


def test_value_errors_are_the_clients_only_while_admitting() -> None:
    fields = CompletionRequest.__struct_fields__
    error = api_error_from(
        ValueError("n must be at most 128"), fields=fields, prompt_field="prompt", admitting=True
    )
    assert error is not None and (error.status, error.param) == (400, "n")
    late = api_error_from(
        ValueError("n must be at most 128"), fields=fields, prompt_field="prompt", admitting=False
    )
    assert late is None
    engine = api_error_from(
        InvalidRequestError("stop_token_ids [9] are outside the vocabulary"),
        fields=fields,
        prompt_field="messages",
        admitting=False,
    )
    assert engine is not None and engine.param == "stop_token_ids"


# -- 6. limits that can never be met -------------------------------------------------------------


async def test_limits_never_met_are_400_even_with_a_full_queue() -> None:
    async with serving(**ONE_RUNNING_ONE_QUEUED) as (client, engine):
        long = {"prompt": "abc", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with anyio.fail_after(15):
            async with engine_full(
                client, engine, running=long, queued=BASES[COMPLETIONS]
            ) as queued:
                # The queue is full: what could fit later is a 503 ...
                full = error_of(await post(client, COMPLETIONS, BASES[COMPLETIONS]), 503)
                assert full["code"] == "retry_later"
                # ... what never could is a 400.
                sampled = {"temperature": 1.0}
                cases: list[tuple[str, dict[str, Any], str, str]] = [
                    (COMPLETIONS, {"n": 129, **sampled}, "n", "(max_n)"),
                    (CHAT, {"n": 129, **sampled}, "n", "(max_n)"),
                    (COMPLETIONS, {"n": 3, **sampled}, "n", "max_queued_requests"),
                    (CHAT, {"n": 3, **sampled}, "n", "max_queued_requests"),
                    (COMPLETIONS, {"prompt": ["a", "b", "c"]}, "prompt", "3 prompts"),
                    (COMPLETIONS, {"max_tokens": 10**6}, "max_tokens", "context length"),
                ]
                for path, extra, param, message in cases:
                    error = error_of(await post(client, path, {**BASES[path], **extra}))
                    assert error["param"] == param, (extra, error)
                    assert message in error["message"], (extra, error)
        assert queued[0].status_code == 200
        await assert_idle(engine)


def test_generate_refuses_an_n_the_queue_never_admits() -> None:
    config = EngineConfig(max_num_seqs=2, max_queued_requests=3)
    assert check_request(config, SamplingParams(n=5, temperature=1.0)).n == 5
    with pytest.raises(ValueError, match=r"n must be at most 5 \(max_num_seqs \+ max_queued"):
        check_request(config, SamplingParams(n=6, temperature=1.0))
    unlimited = EngineConfig(max_num_seqs=2)
    assert check_request(unlimited, SamplingParams(n=6, temperature=1.0)).n == 6


async def test_many_prompts_are_refused_before_tokenizing() -> None:
    async with serving(multiprocess=False) as (client, engine):
        body = {"prompt": ["a"] * 257, "max_tokens": 1}
        error = error_of(await post(client, COMPLETIONS, body))
        assert error["param"] == "prompt" and "257 prompts" in error["message"]
        body = {"prompt": ["a"] * 3, "n": 128, "temperature": 1.0, "max_tokens": 1}
        assert error_of(await post(client, COMPLETIONS, body))["param"] == "prompt"
        body = {"prompt": ["a"] * 256, "max_tokens": 1}
        assert len((await post(client, COMPLETIONS, body)).json()["choices"]) == 256
        await assert_idle(engine)
