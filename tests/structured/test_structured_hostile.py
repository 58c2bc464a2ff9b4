"""Hostile grammars reach the engine (bypassing the params' own checks, as a client of another
version could): whatever goes wrong canonicalizing or compiling them ends that request alone
with an error, and the engine holds no request afterwards."""

from __future__ import annotations

from typing import Any

import pytest

from engine_core import SamplingParams, StructuredOutputsParams
from engine_core._core.engine_io import EngineCoreRequest, FinishedRequest
from engine_core._engine.core import EngineCore
from engine_core._structured import manager
from engine_core._structured.grammar import GrammarError, GrammarSpec, compile_grammar
from engine_core.config import EngineConfig

pytest.importorskip("llguidance")

EOS = 257


def _constrained(request_id: str, **structured: Any) -> EngineCoreRequest:
    """A request whose structured_outputs fields were assigned after validation."""
    spec = StructuredOutputsParams(regex="a")
    spec.regex = None
    for name, value in structured.items():
        setattr(spec, name, value)
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=spec)
    return EngineCoreRequest(request_id, list(b"hi"), params, eos_token_ids=[EOS])


def _plain(request_id: str) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    return EngineCoreRequest(request_id, list(b"abc"), params)


def _finish(core: EngineCore) -> dict[str, FinishedRequest]:
    finished: dict[str, FinishedRequest] = {}
    for _ in range(100):
        if not core.has_unfinished_requests():
            break
        finished.update((f.req_id, f) for f in core.step().finished)
    stats = core.get_stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert not core.has_unfinished_requests()
    return finished


def _deep_list(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "structured,error",
    [
        # Used to raise RecursionError out of add_request, leaving the request queued forever.
        ({"json": "[" * 100_000}, "invalid structured_outputs.json: not valid JSON"),
        ({"json": {"a": _deep_list(100_000)}}, "invalid structured_outputs.json: RecursionError"),
        ({"json": {"a": {1, 2}}}, "invalid structured_outputs.json: TypeError"),
    ],
    ids=["deep-text", "deep-dict", "unserializable"],
)
def test_a_schema_that_cannot_be_read_ends_its_request_alone(
    structured: dict[str, Any], error: str
) -> None:
    core = EngineCore(EngineConfig(backend="mock", tokenizer="byte", num_kv_blocks=64))
    try:
        core.add_request(_constrained("bad", **structured))
        core.add_request(_plain("ok"))
        finished = _finish(core)
    finally:
        core.close()
    assert finished["ok"] == FinishedRequest("ok", "length")
    assert finished["bad"].finish_reason == "error"
    assert finished["bad"].error is not None and finished["bad"].error.startswith(error)


class _Panic(BaseException):
    """What a Rust panic inside llguidance raises: not an Exception."""


def test_any_exception_from_compiling_ends_its_request_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def panicking(tokenizer: Any, spec: GrammarSpec) -> Any:
        if spec.text == "b+":
            raise _Panic("called `Option::unwrap()` on a `None` value")
        return compile_grammar(tokenizer, spec)

    monkeypatch.setattr(manager, "compile_grammar", panicking)
    core = EngineCore(EngineConfig(backend="mock", tokenizer="byte", num_kv_blocks=64))
    try:
        core.add_request(_constrained("panics", regex="b+"))
        core.add_request(_constrained("fine", regex="ab"))
        core.add_request(_plain("plain"))
        finished = _finish(core)
        # The failure is cached like any other: the same spec fails again at once.
        core.add_request(_constrained("again", regex="b+"))
        again = _finish(core)
    finally:
        core.close()
    expected = "structured_outputs.regex failed to compile: _Panic: called `Option::unwrap()`"
    for entry in (finished["panics"], again["again"]):
        assert entry.finish_reason == "error"
        assert entry.error is not None and entry.error.startswith(expected)
    assert finished["fine"].finish_reason == "stop"
    assert finished["plain"] == FinishedRequest("plain", "length")


def test_deep_json_text_compiles_to_an_error() -> None:
    from engine_core._structured.grammar import build_tokenizer

    with pytest.raises(GrammarError, match=r"^invalid structured_outputs.json: not valid JSON"):
        compile_grammar(build_tokenizer("byte", 258), GrammarSpec("json", "[" * 100_000))
