"""``bench/trace_hops.py``, the count of a plain request's hops between the project's files,
keeps working: the trip it traces reaches the mock backend and comes back, and its figures
follow from the calls it recorded."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "trace_hops.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trace_hops", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_collapsing_and_counting() -> None:
    script = load_script()
    Call = script.Call
    calls = [
        Call("a.py", "f:1", None),
        Call("a.py", "g:5", "a.py"),
        Call("b.py", "h:1", "a.py"),
        Call("a.py", "f:1", None),
        Call("b.py", "h:1", "a.py"),
    ]
    figures = script.count(calls)
    assert figures["sequence"] == ["a.py", "b.py", "a.py", "b.py"]
    assert figures["hops"] == 3
    assert figures["revisited"] == {"a.py": 2, "b.py": 2}
    assert figures["first_call_hops"] == 1  # a.py (f, g), b.py (h)
    assert figures["file_edges"] == 1
    assert figures["reader_hops"] == 0  # no parents recorded: no call is followed


def test_the_reader_follows_calls_with_children_and_skips_resumptions() -> None:
    script = load_script()
    Call = script.Call
    calls = [
        Call("a.py", "f:1", None),  # 0: calls g and h
        Call("b.py", "g:1", "a.py", 0),  # 1: a leaf
        Call("c.py", "h:1", "a.py", 0),  # 2: calls k
        Call("a.py", "k:9", "c.py", 2),  # 3: calls m
        Call("b.py", "m:3", "a.py", 3),  # 4: a leaf
        Call("c.py", "h:1", None, None, True),  # 5: h resumed: not followed
        Call("b.py", "g:1", "c.py", 5),  # 6: a leaf of the resumed h
    ]
    figures = script.count(calls)
    assert script.reader_calls(calls) == ["a.py", "c.py", "a.py"]
    assert figures["reader_hops"] == 2


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_the_traced_trip_reaches_the_mock_and_comes_back() -> None:
    script = load_script()
    calls, text = await script.trace(2)
    assert text == "pq"  # the mock counts up from the prompt's last byte ("Hello")
    figures = script.count(calls)
    sequence = figures["sequence"]
    assert sequence[0] == sequence[-1] == "engine_core/_frontend/async_llm.py"
    for room in (
        "engine_core/_engine/mp/client.py",
        "engine_core/_engine/wire.py",
        "engine_core/_engine/proc.py",
        "engine_core/_engine/core.py",
        "engine_core/_core/scheduler.py",
        "backends/mock/engine_core_mock/_backend.py",
        "engine_core/_frontend/output_processor.py",
    ):
        assert room in sequence
    assert figures["hops"] == len(sequence) - 1 > figures["first_call_hops"]


def _leaf(x: int) -> int:
    return x


def _outer() -> list[int]:
    return [_leaf(i) for i in range(2)] + list(_leaf(i) for i in range(1))


def test_comprehensions_are_code_of_their_function(monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script()
    here = Path(__file__).resolve().parent
    monkeypatch.setitem(script.ROOTS, str(here), "tests/engine")
    tracer = script._Tracer()
    tracer.on()
    try:
        _outer()
    finally:
        tracer.off()
    recorded = [(c.function.split(":")[0], c.parent) for c in tracer.calls]
    # No comprehension's own frame (Python 3.11 has one): the leaves are called from _outer.
    assert recorded == [("_outer", None), ("_leaf", 0), ("_leaf", 0), ("_leaf", 0)]
    assert {c.caller for c in tracer.calls[1:]} == {"tests/engine/test_trace_hops.py"}
