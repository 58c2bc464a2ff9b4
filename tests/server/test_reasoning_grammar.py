"""The grammar a reasoning parser puts around a constraint: thinking first, bounded for forced
tool calls (the grammar itself closes the block once the characters are spent)."""

from __future__ import annotations

from typing import Any

import pytest

from engine_core._structured.grammar import GrammarSpec, build_tokenizer, compile_grammar
from engine_core.sampling_params import StructuredOutputsParams
from engine_core.server import ServerSettings
from engine_core.server._reasoning import MAX_FORCED_REASONING_CHARS, get_reasoning_parser

pytest.importorskip("llguidance")

ARRAY = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}})
EOS = 257


def _matcher(parser: str, bound: int | None) -> Any:
    params = get_reasoning_parser(parser).constrain(ARRAY, max_thought_chars=bound)
    return compile_grammar(build_tokenizer("byte", 258), GrammarSpec.from_params(params))


def _allowed(matcher: Any) -> set[int]:
    mask = int.from_bytes(matcher.compute_bitmask(), "little")
    return {t for t in range(258) if mask >> t & 1}


def _feed(matcher: Any, text: str) -> bool:
    return all(matcher.consume_token(b) for b in text.encode())


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("bound", [0, 5, 40, MAX_FORCED_REASONING_CHARS])
def test_the_grammar_closes_the_thinking_once_its_characters_are_spent(
    parser: str, bound: int
) -> None:
    matcher = _matcher(parser, bound)
    # Characters, whatever their bytes (deepseek_r1 thinks from the start: a <think> of its
    # own is thinking, and counts).
    assert _feed(matcher, ("<think>" if parser == "qwen3" else "") + "é" * bound)
    assert _allowed(matcher) == {ord("<")}  # only the end of the block may follow
    assert _feed(matcher, "</think>\n[1]")
    assert _allowed(matcher) == {EOS}


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_bounded_thinking_may_end_sooner_and_only_once(parser: str) -> None:
    matcher = _matcher(parser, 40)
    assert _feed(matcher, "<think>a < b, </thin is fine</think>")
    assert "<" not in map(chr, _allowed(matcher) - {EOS})  # no second end marker
    assert _feed(matcher, " [2]")
    # qwen3: an output that does not open the block is the answer; deepseek_r1: thinking.
    assert _matcher(parser, 40).consume_token(ord("x")) == (parser == "deepseek_r1")


def test_qwen3_may_answer_without_thinking_and_deepseek_must_end_it() -> None:
    assert _feed(_matcher("qwen3", 40), "[1]")
    deepseek = _matcher("deepseek_r1", 40)
    assert _feed(deepseek, "thinks at once</think>[1]")
    unbounded = _matcher("qwen3", None)
    assert _feed(unbounded, "<think>" + "x" * 5000 + "</think>[1]")


@pytest.mark.parametrize("value", [-1, MAX_FORCED_REASONING_CHARS + 1, 1.5, None])
def test_the_bound_is_checked(value: Any) -> None:
    with pytest.raises(ValueError, match="max_forced_reasoning_chars must be an int in"):
        ServerSettings(max_forced_reasoning_chars=value)
