"""Real clients, unmodified, against the server: the OpenAI Agents SDK (a function tool over
Chat Completions and over the Responses API, streamed and not; ``output_type``;
``tool_choice="required"``), ``instructor`` (TOOLS, JSON_SCHEMA and JSON modes at temperature 0
and at the default, no retries) and LangChain (``with_structured_output`` both ways, tools).

The mock plays the model with scripted replies that write JSON fields in the schema's order
(``name`` before ``age``, as a model reading the schema does): a grammar that reordered them
would steer the reply off its text. The server runs under asyncio (uvicorn) and trio
(hypercorn); the clients run in a worker thread (the Agents SDK on an asyncio loop of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import anyio
import openai
import pydantic
import pytest
from helpers.serving import served
from helpers.tool_servers import TEMPLATE

from engine_core.server import ServerSettings

agents = pytest.importorskip("agents")
instructor = pytest.importorskip("instructor")
langchain_openai = pytest.importorskip("langchain_openai")

pytestmark = pytest.mark.anyio

T = TypeVar("T")
MODEL = "mock-model"
ANSWER = "It is 22 degrees in Paris."
PERSON = {"name": "Ada Lovelace", "age": 36}


def _hermes(name: str, args: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


REPLIES = [
    # The second turn of every agent loop: the tool's result is in the prompt.
    {"match": r"tool: 22 degrees in Paris", "text": ANSWER},
    {
        "match": r"user: required: weather",
        "text": '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
    },  # fmt: skip
    {"match": r"user: weather in Paris", "text": _hermes("get_weather", {"city": "Paris"})},
    {"match": r"user: Extract: Ada", "text": json.dumps(PERSON)},
]


class Person(pydantic.BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
async def base_url(anyio_backend: str) -> AsyncIterator[str]:
    settings = ServerSettings(
        port=0,
        served_model_names=(MODEL,),
        chat_template=TEMPLATE,
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    async with served(
        [settings],
        multiprocess=False,
        max_model_len=4096,
        backend_options={"replies": REPLIES},
    ) as ([url], _):
        yield f"{url}/v1"


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """A blocking client call, off the server's event loop."""
    with anyio.fail_after(60):
        return await anyio.to_thread.run_sync(functools.partial(fn, *args))


# -- the OpenAI Agents SDK -----------------------------------------------------------------------


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"22 degrees in {city}"


def _agent_run(base_url: str, api: str, stream: bool, **agent: Any) -> Any:
    """One agent run, on an asyncio loop of its own: its final output and the tools it
    called."""
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)

    async def run() -> tuple[Any, list[str]]:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        model_cls = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
        model = model_cls(model=MODEL, openai_client=client)
        called: list[str] = []

        @function_tool
        def weather(city: str) -> str:
            """The weather in a city."""
            called.append(city)
            return get_weather(city)

        weather.name = "get_weather"
        prompt = agent.pop("prompt", "weather in Paris?")
        tools = agent.pop("tools", [weather])
        bot = Agent(name="bot", instructions="Be brief.", model=model, tools=tools, **agent)
        try:
            if stream:
                result = Runner.run_streamed(bot, prompt)
                async for _ in result.stream_events():
                    pass
            else:
                result = await Runner.run(bot, prompt)
        finally:
            await client.close()
        return result.final_output, called

    return asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_agents_sdk_function_tool(base_url: str, api: str, stream: bool) -> None:
    output, called = await in_thread(_agent_run, base_url, api, stream)
    assert (output, called) == (ANSWER, ["Paris"])


async def test_agents_sdk_tool_choice_required(base_url: str) -> None:
    from agents import ModelSettings

    settings = ModelSettings(tool_choice="required")
    output, called = await in_thread(
        functools.partial(
            _agent_run, base_url, "chat", False, prompt="required: weather", model_settings=settings
        )
    )
    assert (output, called) == (ANSWER, ["Paris"])


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_agents_sdk_output_type(base_url: str, api: str) -> None:
    run = functools.partial(
        _agent_run, base_url, api, False, prompt="Extract: Ada", tools=[], output_type=Person
    )
    output, _ = await in_thread(run)
    assert output.model_dump() == PERSON


# -- instructor ----------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, None], ids=["greedy", "default"])
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA", "JSON"])
async def test_instructor_modes(base_url: str, mode: str, temperature: float | None) -> None:
    def extract() -> Person:
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
        with contextlib.closing(client):
            patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
            kwargs = {} if temperature is None else {"temperature": temperature}
            return patched.chat.completions.create(  # type: ignore[no-any-return]
                model=MODEL,
                response_model=Person,
                messages=[{"role": "user", "content": "Extract: Ada Lovelace, 36."}],
                max_retries=0,  # a reply that does not validate fails the test
                **kwargs,
            )

    assert (await in_thread(extract)).model_dump() == PERSON


# -- LangChain -----------------------------------------------------------------------------------


def _chat_model(base_url: str) -> Any:
    return langchain_openai.ChatOpenAI(
        model=MODEL, base_url=base_url, api_key="none", max_retries=0, temperature=0
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
async def test_langchain_structured_output(base_url: str, method: str) -> None:
    def extract() -> Any:
        structured = _chat_model(base_url).with_structured_output(Person, method=method)
        return structured.invoke("Extract: Ada Lovelace, 36.")

    assert (await in_thread(extract)).model_dump() == PERSON


async def test_langchain_tools(base_url: str) -> None:
    def call() -> Any:
        return _chat_model(base_url).bind_tools([get_weather]).invoke("weather in Paris?")

    message = await in_thread(call)
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
