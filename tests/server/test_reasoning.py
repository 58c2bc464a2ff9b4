"""Reasoning output (``--reasoning-parser``) through the official ``openai`` client, under
asyncio and trio: the thinking in ``reasoning_content``, whole and streamed, its tokens in the
usage, and grammars (a JSON schema, a tool grammar) applied after it ends."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from helpers.tool_servers import (
    ANSWER_SCHEMA,
    FORCED_REASONING_CHARS,
    MODEL,
    SCHEMAS,
    TOOLS,
    WEATHER_ARGS,
    ToolServers,
    in_thread,
)

pytestmark = pytest.mark.anyio

THOUGHT = "\nThe user asks 2+2.\n"
ANSWER = "The answer is 4."


async def reply(
    servers: ToolServers, server: str, text: str, stream: bool, **kwargs: Any
) -> tuple[str | None, str | None, int, Any]:
    """(reasoning, content, reasoning tokens, the whole choice or the streamed chunks)."""
    client = servers.client(server)
    messages: Any = [{"role": "user", "content": text}]
    if not stream:
        result = await in_thread(
            client.chat.completions.create, model=MODEL, messages=messages, **kwargs
        )
        message = result.choices[0].message
        usage = result.usage
        assert usage is not None and usage.completion_tokens_details is not None
        reasoning_tokens = usage.completion_tokens_details.reasoning_tokens or 0
        return (
            getattr(message, "reasoning_content", None),
            message.content,
            reasoning_tokens,
            result.choices[0],
        )
    chunks = await in_thread(
        lambda: list(
            client.chat.completions.create(
                model=MODEL,
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
                **kwargs,
            )
        )
    )
    reasoning = content = ""
    for chunk in chunks:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    return (
        reasoning or None,
        content or None,
        usage.completion_tokens_details.reasoning_tokens or 0,
        chunks,
    )


def _tokens(text: str) -> int:
    return len(text.encode())  # the byte tokenizer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("server", "prompt", "thinking"),
    [
        ("hermes", "think", f"<think>{THOUGHT}</think>"),  # qwen3
        ("deepseek_r1", "r1 think", f"{THOUGHT.lstrip()}</think>"),
    ],
)
async def test_thinking_is_split_off(
    servers: ToolServers, server: str, prompt: str, thinking: str, stream: bool
) -> None:
    reasoning, content, tokens, _ = await reply(servers, server, prompt, stream, temperature=0)
    assert reasoning == thinking.removeprefix("<think>").removesuffix("</think>")
    assert content == ANSWER
    assert tokens == _tokens(thinking)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_qwen3_output_without_thinking_is_content(servers: ToolServers, stream: bool) -> None:
    reasoning, content, tokens, _ = await reply(
        servers, "hermes", "hi", stream, temperature=0, max_tokens=4
    )
    assert (reasoning, content, tokens) == (None, ";<=>", 0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_deepseek_r1_output_that_never_ends_thinking_is_all_reasoning(
    servers: ToolServers, stream: bool
) -> None:
    reasoning, content, tokens, _ = await reply(
        servers, "deepseek_r1", "hi", stream, temperature=0, max_tokens=4
    )
    assert (reasoning, content, tokens) == (";<=>", None, 4)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_json_schema_applies_after_the_thinking(servers: ToolServers, stream: bool) -> None:
    schema = ANSWER_SCHEMA
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    reasoning, content, _, _ = await reply(
        servers, "hermes", "json think", stream, temperature=0, response_format=response_format
    )
    assert reasoning == "It wants JSON."
    assert content is not None and json.loads(content) == {"answer": 4}


async def test_a_tool_grammar_applies_after_the_thinking(servers: ToolServers) -> None:
    reasoning, content, _, choice = await reply(
        servers, "hermes", "call after thinking", False, tools=TOOLS, tool_choice="required"
    )
    message = choice.message
    assert reasoning == "The weather is needed."
    assert content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", WEATHER_ARGS)
    ]


def _calls(got: Any, stream: bool) -> tuple[list[tuple[str, Any]], str | None]:
    """(calls as (name, arguments), finish reason) of a message or of streamed chunks."""
    if not stream:
        calls = got.message.tool_calls or ()
        return [
            (c.function.name, json.loads(c.function.arguments)) for c in calls
        ], got.finish_reason
    pieces: dict[int, tuple[str, str]] = {}
    reason = None
    for chunk in got:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for piece in choice.delta.tool_calls or ():
                # A call comes whole: its id, name and arguments in one piece.
                assert piece.index not in pieces and piece.id and piece.function.name
                pieces[piece.index] = (piece.function.name, piece.function.arguments)
    return [(name, json.loads(args)) for name, args in pieces.values()], reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("server", ["hermes", "deepseek_r1"])
@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
@pytest.mark.parametrize("temperature", [0, None], ids=["greedy", "default"])
async def test_a_forced_call_comes_after_bounded_thinking(
    servers: ToolServers, stream: bool, server: str, tool_choice: Any, temperature: float | None
) -> None:
    # No scripted reply: the mock thinks until the grammar closes the block after
    # FORCED_REASONING_CHARS characters, then writes the call.
    kwargs: dict[str, Any] = {"tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 400}
    if temperature is not None:
        kwargs["temperature"] = temperature
    for seed in range(3):
        reasoning, content, tokens, got = await reply(
            servers, server, "anything", stream, seed=seed, **kwargs
        )
        calls, reason = _calls(got, stream)
        assert reason == "tool_calls" and calls, (reasoning, content)
        assert len(reasoning or "") <= FORCED_REASONING_CHARS
        if temperature == 0:  # greedy thinks on until the grammar closes the block
            assert reasoning is not None and len(reasoning) == FORCED_REASONING_CHARS
        assert not (content or "").strip()
        for name, arguments in calls:
            jsonschema.validate(arguments, SCHEMAS[name])
        if tool_choice != "required":
            assert [name for name, _ in calls] == ["get_time"]
