"""Streamed and whole answers of the same output agree, for every tool-call format, over random
cut points and broken markups: the same calls (names and arguments), the same content (up to
the white space a whole message strips), the same finish reason; a call is only ever sent with
arguments that parse as a JSON object, and ``"tool_calls"`` only ends a choice that has one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core._core.tokenizer import ByteTokenizer
from engine_core.outputs import CompletionOutput
from engine_core.server._chat_output import ChatReader
from engine_core.server._reasoning import get_reasoning_parser
from engine_core.server._responses_items import OutputItems
from engine_core.server.tools import ToolParser, get_tool_parser
from engine_core.server.tools._choice import CallListParser, NamedCallParser

FORMATS = ["hermes", "llama3_json", "mistral", "mistral_named", "required", "named"]
DECLARED = ("get_weather", "get_time")

NAMES = st.sampled_from([*DECLARED, "get_weather", "lookup"])  # lookup: not offered
ARGUMENTS = st.dictionaries(
    st.sampled_from(["city", "tz", "unit", "n"]),
    st.one_of(
        st.text(max_size=4), st.integers(-5, 5), st.none(), st.lists(st.booleans(), max_size=2)
    ),
    max_size=3,
)
CALLS = st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3)
BREAKS = st.sampled_from(
    [
        '"Paris"',  # arguments that are a string, not an object
        '{"city": "Par',
        "<tool_call>",
        "</tool_call>",
        "[TOOL_CALLS]",
        "[ARGS]",
        "{",
        "}",
        "]",
        ";",
        ",",
        '"',
        "x",
        " ",
    ]
)


def _call(name: str, args: dict[str, Any], key: str = "arguments") -> str:
    return json.dumps({"name": name, key: args})


def render(fmt: str, calls: list[tuple[str, dict[str, Any]]], prefix: str) -> str:
    """The text a model writes for ``calls`` in ``fmt`` (``prefix``: content before, where the
    format has any)."""
    if fmt == "hermes":
        return prefix + "".join(f"<tool_call>\n{_call(n, a)}\n</tool_call>\n" for n, a in calls)
    if fmt == "llama3_json":
        return "<|python_tag|>" + "; ".join(_call(n, a, "parameters") for n, a in calls)
    if fmt == "mistral":
        return prefix + "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])
    if fmt == "mistral_named":
        return prefix + "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    if fmt == "required":
        return json.dumps([{"name": n, "parameters": a} for n, a in calls])
    return json.dumps(calls[0][1])


def parser_of(fmt: str) -> ToolParser:
    if fmt == "required":
        return CallListParser()
    if fmt == "named":
        return NamedCallParser("get_weather")
    return get_tool_parser(fmt.removesuffix("_named"))


@st.composite
def outputs(draw: st.DrawFn, fmt: str) -> str:
    """A format's text for some calls, maybe broken: cut short, a piece spliced in, the
    arguments written as a string, the name given twice."""
    calls = draw(CALLS)
    text = render(fmt, calls, draw(st.sampled_from(["", "Let me check.\n"])))
    damage = draw(st.sampled_from(["none", "cut", "splice", "string_arguments", "two_names"]))
    if damage == "cut":
        text = text[: draw(st.integers(0, len(text)))]
    elif damage == "splice":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(BREAKS) + text[at:]
    elif damage == "string_arguments":
        text = text.replace('"arguments": {', '"arguments": "Paris", "x": {', 1)
        text = text.replace('"parameters": {', '"parameters": "Paris", "x": {', 1)
    elif damage == "two_names":
        text = text.replace(
            '{"name": "get_weather"', '{"name": "get_time", "name": "get_weather"', 1
        )
    return text


def whole(reader: ChatReader, text: str, reason: str) -> dict[str, Any]:
    (completion,) = pieces(text, reason, [])
    message, finish_reason = reader.message(completion)
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    return {
        "content": (message.content or "").strip(),
        "reasoning": message.reasoning_content or "",
        "calls": calls,
        "finish_reason": finish_reason,
    }


def pieces(text: str, reason: str, cuts: list[int]) -> Iterator[CompletionOutput]:
    """The outputs of ``text`` streamed in the pieces that ``cuts`` make (the byte
    tokenizer's token ids), the last one finished with ``reason``."""
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    for start, end in list(zip(bounds, bounds[1:], strict=False)) or [(0, 0)]:
        piece = text[start:end]
        finish_reason: Any = reason if end == len(text) else None
        yield CompletionOutput(0, piece, list(piece.encode()), finish_reason=finish_reason)


def streamed(reader: ChatReader, text: str, reason: str, cuts: list[int]) -> dict[str, Any]:
    stream = reader.stream(0)
    content = reasoning = ""
    calls: dict[int, list[str]] = {}
    finish_reason = None
    for completion in pieces(text, reason, cuts):
        delta, finish_reason = stream.delta(completion)
        if delta is None:
            continue
        content += delta.content or ""
        reasoning += delta.reasoning_content or ""
        for piece_call in delta.tool_calls or ():
            function = piece_call.function
            assert function is not None
            if piece_call.index not in calls:
                assert piece_call.id is not None and function.name is not None
                calls[piece_call.index] = [function.name, ""]
            else:
                assert piece_call.id is None and function.name is None
            calls[piece_call.index][1] += function.arguments or ""
    return {
        "content": content.strip(),
        "reasoning": reasoning,
        "calls": [(name, args) for name, args in (calls[i] for i in sorted(calls))],
        "finish_reason": finish_reason,
    }


def check_answer(answer: dict[str, Any]) -> None:
    for name, arguments in answer["calls"]:
        assert isinstance(json.loads(arguments), dict), answer
        assert name in DECLARED, answer
    if answer["calls"]:
        assert answer["finish_reason"] in ("tool_calls", "length"), answer
    else:
        assert answer["finish_reason"] in ("stop", "length"), answer


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("thinking", [False, True], ids=["plain", "qwen3"])
@settings(max_examples=120, deadline=None)
@given(data=st.data(), cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_streamed_and_whole_answers_agree(
    fmt: str, thinking: bool, data: st.DataObject, cuts: list[int]
) -> None:
    text = data.draw(outputs(fmt))
    reason = data.draw(st.sampled_from(["stop", "length"]))
    reasoning = get_reasoning_parser("qwen3") if thinking else None
    if thinking:
        text = "<think>\nWhich tool?\n</think>\n\n" + text

    def reader() -> ChatReader:
        return ChatReader(ByteTokenizer(), parser_of(fmt), reasoning, tool_names=DECLARED)

    expected = whole(reader(), text, reason)
    got = streamed(reader(), text, reason, cuts)
    assert got == expected, text
    check_answer(got)


_TIME_CALL = '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>\n'
_CUT_WEATHER = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'


@pytest.mark.parametrize(
    ("fmt", "text", "calls"),
    [
        ("hermes", _CUT_WEATHER, []),
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>', []),
        ("hermes", _TIME_CALL + _CUT_WEATHER, [("get_time", '{"tz": "CET"}')]),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Pa', []),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa', []),
        ("mistral_named", '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', []),
    ],
)
def test_a_broken_call_is_never_sent(fmt: str, text: str, calls: list[tuple[str, str]]) -> None:
    # Fed one character at a time: no piece of a call whose arguments never close goes out,
    # and the choice ends "stop" with the broken markup as content.
    got = streamed(ChatReader(ByteTokenizer(), parser_of(fmt)), text, "stop", [*range(len(text))])
    assert got == whole(ChatReader(ByteTokenizer(), parser_of(fmt)), text, "stop")
    assert got["calls"] == calls
    assert got["finish_reason"] == ("tool_calls" if calls else "stop")
    assert got["content"] == text.removeprefix(_TIME_CALL)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "required"])
def test_a_duplicated_name_reads_the_same_streamed_and_whole(fmt: str) -> None:
    text = render(fmt, [("get_weather", {"city": "Paris"})], "")
    text = text.replace('{"name": "get_weather"', '{"name": "get_time", "name": "get_weather"', 1)
    got = streamed(
        ChatReader(ByteTokenizer(), parser_of(fmt)), text, "stop", list(range(len(text)))
    )
    assert got == whole(ChatReader(ByteTokenizer(), parser_of(fmt)), text, "stop")
    # Which function the model meant is ambiguous: no call is made of it.
    assert (got["calls"], got["finish_reason"]) == ([], "stop")


def response_items(reader: ChatReader, text: str, reason: str, cuts: list[int]) -> list[Any]:
    """The ``/v1/responses`` output items of ``text`` streamed in the pieces ``cuts`` make:
    (type, text) or (type, name, arguments), and the events' item types."""
    stream = reader.stream(0)
    items = OutputItems()
    added: list[str] = []
    for completion in pieces(text, reason, cuts):
        parts, _ = stream.parts(completion)
        for event in items.add(parts):
            added += [e["item"]["type"] for e in _events(event, "response.output_item.added")]
    items.close()
    summary = [
        (i["type"], i["name"], i["arguments"])
        if i["type"] == "function_call"
        else (i["type"], i["content"][0]["text"])
        for i in items.items
    ]
    assert added == [item[0] for item in summary]
    return summary


def _events(data: bytes, kind: str) -> list[dict[str, Any]]:
    found = []
    for block in data.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if lines.get("event") == kind:
            found.append(json.loads(lines["data"]))
    return found


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=80, deadline=None)
@given(data=st.data(), cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_streamed_and_whole_responses_list_the_same_items(
    fmt: str, data: st.DataObject, cuts: list[int]
) -> None:
    text = "<think>Which tool?</think>\n" + data.draw(outputs(fmt))
    reason = data.draw(st.sampled_from(["stop", "length"]))

    def reader() -> ChatReader:
        qwen3 = get_reasoning_parser("qwen3")
        return ChatReader(ByteTokenizer(), parser_of(fmt), qwen3, tool_names=DECLARED)

    whole_items = response_items(reader(), text, reason, [])
    assert response_items(reader(), text, reason, cuts) == whole_items
    for item in whole_items:
        if item[0] == "function_call":
            assert isinstance(json.loads(item[2]), dict) and item[1] in DECLARED
        else:
            assert item[1].strip()
