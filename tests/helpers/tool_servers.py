"""Servers over one mock engine that plays a tool-calling, thinking model (scripted replies),
one per tool-call format and reasoning parser, for the tool, reasoning and Responses tests."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import openai

from engine_core.server import ServerSettings
from helpers.serving import served

T = TypeVar("T")
MODEL = "mock-model"

WEATHER_ARGS = {"city": "Paris", "unit": "celsius"}
TIME_ARGS = {"tz": "CET"}
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"tz": {"type": "string", "maxLength": 5}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}},
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
"""The JSON schema the replies that think before answering JSON (``{"answer": 4}``) meet."""


def _call(name: str, args: dict[str, Any], key: str = "arguments") -> str:
    return json.dumps({"name": name, key: args})


_HERMES_WEATHER = f"<tool_call>\n{_call('get_weather', WEATHER_ARGS)}\n</tool_call>"
_HERMES_TIME = f"<tool_call>\n{_call('get_time', TIME_ARGS)}\n</tool_call>"
HERMES_CALLS = {"get_weather": _HERMES_WEATHER, "get_time": _HERMES_TIME}
_LLAMA_WEATHER = _call("get_weather", WEATHER_ARGS, "parameters")
_LLAMA_TIME = _call("get_time", TIME_ARGS, "parameters")

BROKEN = {
    "broken": '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>',
    "truncated": '<tool_call>\n{"name": "get_weather", "arguments": {"ci',
}
"""Tool-call texts that break the hermes format."""

REPLIES = [
    # The agent loop's second turn: the tool's result is in the prompt.
    {"match": r'tool: \{"temperature": 22', "text": "It is 22 degrees in Paris."},
    {"match": r"user: hermes weather", "text": f"Let me check.\n{_HERMES_WEATHER}"},
    {"match": r"user: hermes two", "text": f"{_HERMES_WEATHER}\n{_HERMES_TIME}"},
    {"match": r"user: llama weather", "text": _LLAMA_WEATHER},
    {"match": r"user: llama two", "text": f"<|python_tag|>{_LLAMA_WEATHER}; {_LLAMA_TIME}"},
    {
        "match": r"user: mistral weather",
        "text": f"[TOOL_CALLS][{_call('get_weather', WEATHER_ARGS)}]",
    },
    {
        "match": r"user: mistral two",
        "text": f"[TOOL_CALLS]get_weather[ARGS]{json.dumps(WEATHER_ARGS)}"
        f"[TOOL_CALLS]get_time[ARGS]{json.dumps(TIME_ARGS)}",
    },
    {
        "match": r"user: required two",
        "text": json.dumps(
            [
                {"name": "get_weather", "parameters": WEATHER_ARGS},
                {"name": "get_time", "parameters": TIME_ARGS},
            ]
        ),
    },
    {"match": r"user: broken", "text": BROKEN["broken"]},
    {"match": r"user: truncated", "text": BROKEN["truncated"]},
    {"match": r"user: call then cut", "text": f"{_HERMES_TIME}\n{BROKEN['truncated']}"},
    {"match": r"user: think", "text": "<think>\nThe user asks 2+2.\n</think>\n\nThe answer is 4."},
    {"match": r"user: r1 think", "text": "The user asks 2+2.\n</think>\n\nThe answer is 4."},
    {
        "match": r"user: call after thinking",
        "text": "<think>The weather is needed.</think>\n"
        + json.dumps([{"name": "get_weather", "parameters": WEATHER_ARGS}]),
    },
    {"match": r"user: json think", "text": '<think>It wants JSON.</think>\n{"answer": 4}'},
    {"match": r"user: agent", "text": _HERMES_WEATHER},
    # gpt-oss's harmony format (the byte tokenizer spells its special tokens out).
    {
        "match": r"user: harmony think",
        "text": "<|channel|>analysis<|message|>The user asks 2+2.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>",
    },
    {
        "match": r"user: harmony weather",
        "text": "<|channel|>analysis<|message|>The weather is needed.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        f"<|message|>{json.dumps(WEATHER_ARGS)}<|call|>",
    },
    {"match": r"user: harmony plain", "text": "<|channel|>final<|message|>Hello there.<|return|>"},
    {
        "match": r"user: harmony json",
        "text": "<|channel|>analysis<|message|>It wants JSON.<|end|>"
        '<|start|>assistant<|channel|>final<|message|>{"answer": 4}',
    },
    {
        "match": r"user: harmony forced",
        "text": "<|channel|>analysis<|message|>The weather is needed.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>"
        + json.dumps([{"name": "get_weather", "parameters": WEATHER_ARGS}]),
    },
    {
        "match": r"user: harmony preamble",
        "text": "<|channel|>analysis<|message|>The weather is needed.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        f"<|message|>{json.dumps(WEATHER_ARGS)}<|call|>",
    },
]

TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %};{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}>{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""The plain template, with the tools and the assistants' calls written out."""

FORCED_REASONING_CHARS = 64
"""The thinking a forced tool call may do on the servers that read reasoning."""

SERVERS: dict[str, dict[str, Any]] = {
    "hermes": {
        "tool_call_parser": "hermes",
        "enable_auto_tool_choice": True,
        "reasoning_parser": "qwen3",
        "max_forced_reasoning_chars": FORCED_REASONING_CHARS,
    },
    "llama3_json": {"tool_call_parser": "llama3_json", "enable_auto_tool_choice": True},
    "mistral": {"tool_call_parser": "mistral", "enable_auto_tool_choice": True},
    "deepseek_r1": {
        "reasoning_parser": "deepseek_r1",
        "max_forced_reasoning_chars": FORCED_REASONING_CHARS,
    },
    "gpt_oss": {
        "tool_call_parser": "openai",
        "enable_auto_tool_choice": True,
        "reasoning_parser": "gpt_oss",
        "max_forced_reasoning_chars": FORCED_REASONING_CHARS,
    },
    "plain": {},
}
"""The settings of each server, by name."""


@dataclass
class ToolServers:
    urls: dict[str, str]
    clients: list[openai.OpenAI] = field(default_factory=list)

    def client(self, name: str = "hermes") -> openai.OpenAI:
        client = openai.OpenAI(
            base_url=f"{self.urls[name]}/v1", api_key="none", max_retries=0, timeout=10.0
        )
        self.clients.append(client)
        return client


@contextlib.asynccontextmanager
async def tool_servers() -> AsyncIterator[ToolServers]:
    """Every server of :data:`SERVERS` on a free loopback port, over one engine."""
    settings = [
        ServerSettings(port=0, served_model_names=(MODEL,), chat_template=TEMPLATE, **options)
        for options in SERVERS.values()
    ]
    async with served(
        settings,
        multiprocess=False,
        max_model_len=2048,
        backend_options={"replies": REPLIES},
    ) as (urls, _):
        servers = ToolServers(dict(zip(SERVERS, urls, strict=True)))
        try:
            yield servers
        finally:
            for client in servers.clients:
                client.close()


async def in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking client call without blocking the server's event loop."""
    with anyio.fail_after(20):
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
