"""The tool-call and reasoning parsers on their own: well-formed texts read back exactly, any
text is read without raising, and a text streamed in any pieces reads as it does whole."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core.server._reasoning import REASONING_PARSERS, ReasoningStream, get_reasoning_parser
from engine_core.server.tools import (
    ToolCallStream,
    ToolParser,
    extract_tool_calls,
    get_tool_parser,
    tool_parser_names,
)
from engine_core.server.tools._choice import CallListParser, NamedCallParser

NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
ARGUMENTS = st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=3)
CALLS = st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3)
MARKERS = [
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
    "<think>",
    "</think>",
    # gpt-oss's harmony format
    "<|channel|>analysis<|message|>",
    "<|end|>",
    "<|start|>assistant<|channel|>final<|message|>",
    "<|channel|>final<|message|>",
    "<|return|>",
    "<|start|>assistant",
    "<|channel|>commentary to=functions.f <|constrain|>json<|message|>",
    "<|call|>",
    "<|",
    '{"name": "f", "arguments": {',
    "}",
    "]",
    "[",
    ";",
    ",",
    '"',
    "\\",
]
NOISY_TEXT = st.lists(st.sampled_from(MARKERS) | st.text(max_size=4), max_size=12).map("".join)
PARSERS: list[ToolParser] = [
    *(get_tool_parser(name) for name in tool_parser_names()),
    CallListParser(),
    NamedCallParser("f"),
]


def _format(parser: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    if parser == "hermes":
        return "".join(
            f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>\n"
            for n, a in calls
        )
    if parser == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    if parser == "openai":
        return "".join(
            f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json"
            f"<|message|>{json.dumps(a)}<|call|>"
            for n, a in calls
        )
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def stream(parser: ToolParser, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    """(content, calls) of ``text`` fed in the pieces that ``cuts`` make."""
    feeder = ToolCallStream(parser)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    content = ""
    calls: dict[int, list[str]] = {}
    for start, end in zip(bounds, bounds[1:] or [0], strict=False):
        parts = feeder.feed(text[start:end], final=end == len(text))
        content += "".join(p for p in parts if isinstance(p, str))
        for delta in (p for p in parts if not isinstance(p, str)):
            if delta.index not in calls:
                assert delta.id is not None and delta.name is not None
                calls[delta.index] = [delta.name, ""]
            calls[delta.index][1] += delta.arguments
    if len(bounds) == 1:  # the empty text
        content += "".join(p for p in feeder.feed("", final=True) if isinstance(p, str))
    return content, [(name, args) for name, args in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "openai"])
@settings(max_examples=60, deadline=None)
@given(calls=CALLS, cuts=st.lists(st.integers(0, 10_000), max_size=6))
def test_well_formed_calls_read_back_whole_and_streamed(
    name: str, calls: list[tuple[str, dict[str, Any]]], cuts: list[int]
) -> None:
    parser = get_tool_parser(name)
    text = _format(name, calls)
    content, found = extract_tool_calls(parser, text)
    assert content.strip() == ""
    assert [(c.name, json.loads(c.arguments)) for c in found] == calls
    streamed_content, streamed = stream(parser, text, cuts)
    assert streamed_content.strip() == ""
    assert streamed == [(c.name, c.arguments) for c in found]


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "openai"])
def test_calls_streamed_a_character_at_a_time_read_as_whole(name: str) -> None:
    """Every cut of the text, at once: a call is never sent and then read again (as a parser
    that took back a call it had read would make the stream do)."""
    parser = get_tool_parser(name)
    text = _format(name, [("get_weather", {"city": "Paris"}), ("f", {})])
    _, found = extract_tool_calls(parser, text)
    content, streamed = stream(parser, text, list(range(len(text))))
    assert content.strip() == ""
    assert streamed == [(c.name, c.arguments) for c in found] and len(found) == 2


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: type(p).__name__)
@settings(max_examples=150, deadline=None)
@given(text=NOISY_TEXT, cuts=st.lists(st.integers(0, 10_000), max_size=6))
def test_any_text_reads_without_raising_and_streams_as_it_reads_whole(
    parser: ToolParser, text: str, cuts: list[int]
) -> None:
    content, found = extract_tool_calls(parser, text)
    streamed_content, streamed = stream(parser, text, cuts)
    assert streamed == [(c.name, c.arguments) for c in found]
    assert streamed_content == content
    if not found:
        assert content == parser.plain(text)
    for call in found:
        assert isinstance(json.loads(call.arguments), dict)


def test_unknown_parsers_are_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, openai"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="deepseek_r1, gpt_oss, qwen3"):
        get_reasoning_parser("nope")


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@settings(max_examples=150, deadline=None)
@given(text=NOISY_TEXT, cuts=st.lists(st.integers(0, 10_000), max_size=6))
def test_reasoning_streams_as_it_splits_whole(name: str, text: str, cuts: list[int]) -> None:
    from engine_core._core.tokenizer import ByteTokenizer

    parser = get_reasoning_parser(name)
    reasoning, content, _ = parser.split(text, final=True)
    feeder = ReasoningStream(parser, ByteTokenizer())
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    got_reasoning = got_content = ""
    pairs = list(zip(bounds, bounds[1:], strict=False)) or [(0, 0)]
    for start, end in pairs:
        piece = text[start:end]
        r, c = feeder.feed(piece, list(piece.encode()), final=end == len(text))
        got_reasoning += r
        got_content += c
    assert (got_reasoning, got_content) == (reasoning, content)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tool_call_parser": "nope"}, "unknown tool-call parser"),
        ({"enable_auto_tool_choice": True}, "needs a tool_call_parser"),
        ({"reasoning_parser": "nope"}, "unknown reasoning parser"),
    ],
)
def test_server_settings_check_the_parsers(fields: dict[str, Any], message: str) -> None:
    from engine_core.server import ServerSettings

    with pytest.raises(ValueError, match=message):
        ServerSettings(**fields)


def test_plain_content_streams_without_parsing_the_text_again() -> None:
    from engine_core.server.tools.hermes import HermesToolParser

    seen: list[int] = []

    class Counting(HermesToolParser):
        def parse(self, text: str, final: bool) -> Any:
            seen.append(len(text))
            return super().parse(text, final)

    feeder = ToolCallStream(Counting())
    content = "".join(p for _ in range(1000) for p in feeder.feed("word ", final=False))
    assert feeder.feed("<tool_call>", final=False) == []
    assert content == "word " * 1000 and seen == [len("<tool_call>")]
    # Past the markup's start only the markup is parsed.
    feeder.feed('{"name": "f", "arguments": {}}</tool_call>', final=True)
    assert max(seen) == len('<tool_call>{"name": "f", "arguments": {}}</tool_call>')


@pytest.mark.parametrize(
    ("name", "pieces", "reasoning", "content"),
    [
        ("qwen3", ["<th", "ink>ab</thi", "nk>\n", "cd"], "ab", "cd"),
        ("deepseek_r1", ["<th", "ink>ab</thi", "nk>cd"], "ab", "cd"),
        ("deepseek_r1", ["ab</think>", "cd"], "ab", "cd"),
        ("qwen3", ["ab</think>cd"], "", "ab</think>cd"),
    ],
)
def test_reasoning_split_across_pieces(
    name: str, pieces: list[str], reasoning: str, content: str
) -> None:
    from engine_core._core.tokenizer import ByteTokenizer

    feeder = ReasoningStream(get_reasoning_parser(name), ByteTokenizer())
    got = [
        feeder.feed(piece, list(piece.encode()), final=i == len(pieces) - 1)
        for i, piece in enumerate(pieces)
    ]
    assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == (reasoning, content)
    text = "".join(pieces)
    thinking = text[: text.find("</think>") + len("</think>")] if reasoning else ""
    assert feeder.reasoning_tokens == len(thinking.encode())


def test_reasoning_tokens_stop_at_the_marker_in_a_merged_piece() -> None:
    from engine_core._core.tokenizer import ByteTokenizer

    feeder = ReasoningStream(get_reasoning_parser("qwen3"), ByteTokenizer())
    text = "<think>ab</think>\n\ncd"
    assert feeder.feed(text, list(text.encode()), final=True) == ("ab", "cd")
    assert feeder.reasoning_tokens == len("<think>ab</think>")


@pytest.mark.parametrize(
    ("text", "end"),
    [
        ("{}", 2),
        ('{"a": "}"}', 10),
        ('{"a": "\\"}"}', 12),
        ('{"a": "\\\\"}', 11),
        ('{"a": "\\\\\\"}"}', 14),
        ('[1, [2], {"b": "]"}]', 20),
        ('{"a":1}} tail', 7),
        ('{"a": "x', None),
        ('{"a": "x\\', None),
        ('{"a": [}', None),
    ],
)
def test_value_end_follows_brackets_and_strings(text: str, end: int | None) -> None:
    from engine_core.server.tools._calls import value_end

    assert value_end(text, 0) == end
    if end is not None:
        assert value_end("xy" + text, 2) == end + 2
