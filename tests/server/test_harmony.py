"""gpt-oss's harmony format through the official ``openai`` client (``--reasoning-parser
gpt_oss --tool-call-parser openai``), whole and streamed, under asyncio and trio: the
``analysis`` channel is ``reasoning_content``, the ``final`` channel the content (its header and
end marker left out), a ``commentary`` message to a function a tool call; grammars apply to the
``final`` message, the markers spelled out (the byte tokenizer) or named as special tokens."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from helpers.tool_servers import (
    ANSWER_SCHEMA,
    FORCED_REASONING_CHARS,
    MODEL,
    TOOLS,
    WEATHER_ARGS,
    ToolServers,
    in_thread,
)
from test_reasoning import reply

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_analysis_channel_is_the_thinking(servers: ToolServers, stream: bool) -> None:
    reasoning, content, tokens, _ = await reply(
        servers, "gpt_oss", "harmony think", stream, temperature=0
    )
    assert (reasoning, content) == ("The user asks 2+2.", "The answer is 4.")
    assert tokens == len("<|channel|>analysis<|message|>The user asks 2+2.<|end|>")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_final_message_without_thinking_is_content(
    servers: ToolServers, stream: bool
) -> None:
    reasoning, content, tokens, _ = await reply(
        servers, "gpt_oss", "harmony plain", stream, temperature=0
    )
    assert (reasoning, content, tokens) == (None, "Hello there.", 0)


async def test_a_commentary_message_to_a_function_is_a_tool_call(servers: ToolServers) -> None:
    reasoning, content, _, choice = await reply(
        servers, "gpt_oss", "harmony weather", False, temperature=0, tools=TOOLS
    )
    assert reasoning == "The weather is needed."
    assert content is None and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == WEATHER_ARGS


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_commentary_preamble_before_a_call_is_content(
    servers: ToolServers, stream: bool
) -> None:
    reasoning, content, _, _ = await reply(
        servers, "gpt_oss", "harmony preamble", stream, temperature=0, tools=TOOLS
    )
    assert (reasoning, content) == ("The weather is needed.", "Let me check.")


async def test_the_tool_call_streams(servers: ToolServers) -> None:
    _, content, _, chunks = await reply(
        servers, "gpt_oss", "harmony weather", True, temperature=0, tools=TOOLS
    )
    assert content is None
    names, arguments = [], ""
    for chunk in chunks:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.function.name:
                    names.append(call.function.name)
                arguments += call.function.arguments or ""
    assert names == ["get_weather"] and json.loads(arguments) == WEATHER_ARGS
    reasons = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert reasons == ["tool_calls"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_json_schema_applies_to_the_final_message(
    servers: ToolServers, stream: bool
) -> None:
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": ANSWER_SCHEMA},
    }
    reasoning, content, _, _ = await reply(
        servers, "gpt_oss", "harmony json", stream, temperature=0, response_format=response_format
    )
    assert reasoning == "It wants JSON."
    assert content is not None and json.loads(content) == {"answer": 4}


async def test_a_required_tool_choice_thinks_then_calls(servers: ToolServers) -> None:
    reasoning, _, _, choice = await reply(
        servers, "gpt_oss", "harmony forced", False, temperature=0, tools=TOOLS,
        tool_choice="required",
    )  # fmt: skip
    assert reasoning == "The weather is needed."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == WEATHER_ARGS


async def test_a_forced_call_bounds_the_thinking(servers: ToolServers) -> None:
    """Without a scripted reply the mock would think on: the grammar ends the thinking after
    the bound and writes the final header, and the call comes."""
    reasoning, _, _, choice = await reply(
        servers, "gpt_oss", "hi", False, temperature=0, tools=TOOLS, tool_choice="required",
        max_tokens=400,
    )  # fmt: skip
    assert reasoning is not None and len(reasoning) <= FORCED_REASONING_CHARS
    assert choice.message.tool_calls and choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_responses_read_the_channels(servers: ToolServers, stream: bool) -> None:
    """``/v1/responses``: the analysis channel is a reasoning item, a call a function call."""
    from test_responses import _final, _summary, create, events

    kwargs: dict[str, Any] = {"input": "harmony weather", "temperature": 0, "tools": [
        {"type": "function", "name": t["function"]["name"],
         "parameters": t["function"]["parameters"]} for t in TOOLS]}  # fmt: skip
    if stream:
        response = _final(await events(servers, "gpt_oss", **kwargs))
    else:
        response = await create(servers, "gpt_oss", **kwargs)
    assert _summary(response) == [
        ("reasoning", "The weather is needed."),
        ("function_call", ("get_weather", WEATHER_ARGS)),
    ]


HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>"]  # fmt: skip


async def test_the_markers_as_special_tokens_stay_in_the_text(tmp_path: Any) -> None:
    """With a tokenizer whose harmony markers are special tokens (gpt-oss's), the server keeps
    them in the text it reads (``skip_special_tokens`` off for the request), so the channels
    still split, and a grammar names them as special tokens; the end marker is the EOS
    token."""
    import contextlib

    import anyio
    from helpers.tiny_tokenizer import save_tiny_bpe
    from helpers.tool_servers import TEMPLATE

    from engine_core import AsyncLLM
    from engine_core.server import ServerSettings, serve

    corpus = ["The user asks 2+2. The answer is 4. assistant analysis final"] * 20
    path = save_tiny_bpe(tmp_path / "harmony", corpus, HARMONY_TOKENS)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>"}))
    text = ("<|channel|>analysis<|message|>The user asks 2+2.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>The answer is 4.")  # fmt: skip
    json_text = ("<|channel|>analysis<|message|>It wants JSON.<|end|>"
                 '<|start|>assistant<|channel|>final<|message|>{"answer": 4}')  # fmt: skip
    replies = [{"match": "user: 2", "text": text}, {"match": "user: 3", "text": json_text}]
    settings = ServerSettings(port=0, served_model_names=(MODEL,), chat_template=TEMPLATE,
                              reasoning_parser="gpt_oss", tool_call_parser="openai",
                              enable_auto_tool_choice=True)  # fmt: skip
    stop = anyio.Event()
    async with (
        AsyncLLM(
            backend="mock",
            tokenizer=str(path),
            multiprocess=False,
            backend_options={"replies": replies},
        ) as engine,  # fmt: skip
        anyio.create_task_group() as task_group,
    ):
        url = await task_group.start(
            lambda *, task_status: serve(
                engine, settings, shutdown_trigger=stop.wait, task_status=task_status
            )
        )
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with contextlib.closing(client):
            result = await in_thread(
                client.chat.completions.create,
                model=MODEL,
                messages=[{"role": "user", "content": "2"}],
                temperature=0,
            )
            # The grammar names the markers as special tokens: the reply's tokens pass it.
            constrained = await in_thread(
                client.chat.completions.create,
                model=MODEL,
                messages=[{"role": "user", "content": "3"}],
                temperature=0,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": ANSWER_SCHEMA},
                },
            )
        stop.set()
    message: Any = result.choices[0].message
    assert (message.reasoning_content, message.content) == (
        "The user asks 2+2.",
        "The answer is 4.",
    )
    assert result.choices[0].finish_reason == "stop"
    from engine_core._core.hf_tokenizer import HFTokenizer

    thinking = HFTokenizer(path).encode("<|channel|>analysis<|message|>The user asks 2+2.<|end|>")
    details = result.usage.completion_tokens_details if result.usage else None
    assert details is not None and details.reasoning_tokens == len(thinking)
    answer: Any = constrained.choices[0].message
    assert answer.reasoning_content == "It wants JSON."
    assert json.loads(answer.content) == {"answer": 4}
