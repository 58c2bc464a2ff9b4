"""Structured outputs through ``AsyncLLM``, in and out of process, under asyncio and trio: many
constrained requests among plain ones, bad specs failing alone, and an idle engine-core process
woken by a grammar that finishes compiling."""

from __future__ import annotations

import json
import re
import tempfile
import threading
from typing import Any

import anyio
import msgspec
import pytest
from helpers.schemas import PERSON

from engine_core import (
    AsyncLLM,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    StructuredOutputsParams,
)
from engine_core._core.engine_io import EngineCoreOutputs, EngineCoreRequest, FinishedRequest
from engine_core._engine.core import EngineCore
from engine_core._engine.pipes.addresses import OUTPUT_HWM
from engine_core._engine.pipes.pipes import Pipes
from engine_core._engine.proc import EngineCoreProc
from engine_core._engine.wire import Shutdown, engine_message_decoder
from engine_core.config import EngineConfig

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 3, "maximum": 7}}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["!bang", "Zulu", "alpha", "~tilde", "\u00e9t\u00e9"]  # first bytes far apart


def _constrained(i: int) -> tuple[SamplingParams, Any]:
    """The params of constrained request ``i`` and a check of its text."""
    kind = i % 4
    if kind in (0, 3):
        schema = PERSON if kind == 0 else NUMBERS
        params = SamplingParams(
            temperature=0.0,
            max_tokens=300,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        return params, lambda text: jsonschema.validate(json.loads(text), schema)
    spec = {"regex": REGEX} if kind == 1 else {"choice": CHOICES}
    params = SamplingParams(
        temperature=1.0,
        seed=i,
        max_tokens=50,
        structured_outputs=StructuredOutputsParams(**spec),
    )
    if kind == 1:
        return params, lambda text: re.fullmatch(REGEX, text) or pytest.fail(text)
    return params, lambda text: text in CHOICES or pytest.fail(text)


async def _final(engine: AsyncLLM, prompt: str, params: SamplingParams) -> RequestOutput:
    outs = [out async for out in engine.generate(prompt, params)]
    assert outs[-1].finished
    return outs[-1]


@pytest.mark.parametrize("multiprocess", [True, False], ids=["mp", "inproc"])
async def test_50_constrained_requests_alongside_50_plain_ones(multiprocess: bool) -> None:
    latency = {"step_s": 0.0005}
    async with AsyncLLM(
        backend="mock",
        tokenizer="byte",
        multiprocess=multiprocess,
        backend_options={"latency": latency},
    ) as engine:
        texts: dict[int, str] = {}
        plain: dict[int, list[int]] = {}
        errors: dict[str, str] = {}

        async def constrained(i: int) -> None:
            params, _ = _constrained(i)
            out = await _final(engine, f"request {i}", params)
            assert out.outputs[0].finish_reason == "stop"
            texts[i] = out.outputs[0].text

        async def unconstrained(i: int) -> None:
            params = SamplingParams(temperature=0.0, max_tokens=1 + i % 17, ignore_eos=True)
            out = await _final(engine, "hello", params)
            plain[i] = out.outputs[0].token_ids

        async def malformed(name: str, spec: dict[str, Any]) -> None:
            params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
            with pytest.raises(InvalidRequestError) as info:
                await _final(engine, "hello", params)
            errors[name] = str(info.value)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(50):
                    tg.start_soon(constrained, i)
                    tg.start_soon(unconstrained, i)
                tg.start_soon(malformed, "schema", {"json": {"type": "nonsense"}})
                tg.start_soon(malformed, "regex", {"regex": "(("})
        stats = await engine.get_stats()
    for i, text in texts.items():
        _constrained(i)[1](text)
    assert sorted(texts) == list(range(50))
    assert json.loads(texts[0]) == {"name": "#", "age": 0, "ok": False}
    assert len({texts[i] for i in range(2, 50, 4)}) > 1  # the seeds pick different choices
    assert plain == {i: [(ord("o") + 1 + k) % 258 for k in range(1 + i % 17)] for i in range(50)}
    assert errors["schema"] == "invalid structured_outputs.json: Invalid type: nonsense"
    assert errors["regex"].startswith("invalid structured_outputs.regex: ")
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


async def test_an_idle_engine_process_wakes_up_when_a_grammar_is_compiled() -> None:
    # Nothing else runs while the grammar compiles: only the compilation can wake the engine
    # (its deadline is 10 s away).
    async with AsyncLLM(backend="mock", tokenizer="byte") as engine:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=10,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
        )
        with anyio.fail_after(5):
            first = await _final(engine, "hello", params)
            # The second one finds the grammar in the cache.
            second = await _final(engine, "hello", params)
    assert first.outputs[0].text == second.outputs[0].text == "yes"
    assert first.outputs[0].token_ids == [121, 101, 115, 257]


async def test_an_idle_engine_process_ends_a_request_whose_grammar_times_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import engine_core._structured.manager as module

    release = threading.Event()
    monkeypatch.setattr(module, "compile_grammar", lambda *_: release.wait(10) and None)
    core = EngineCore(EngineConfig(backend="mock", tokenizer="byte"))
    core.structured_output.compile_timeout_s = 0.2
    pipes = Pipes()
    directory = tempfile.TemporaryDirectory()
    to_in, to_out = f"unix://{directory.name}/in", f"unix://{directory.name}/out"
    try:
        engine_in, from_engine = pipes.receiver(to_in), pipes.receiver(to_out)
        engine_out, to_engine = pipes.sender(to_out, hwm=OUTPUT_HWM), pipes.sender(to_in)
        proc = EngineCoreProc(core, engine_in, engine_out)
        encode = msgspec.msgpack.Encoder().encode
        params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(proc.run)
            to_engine.send_nowait(encode(EngineCoreRequest("slow", [1, 2], params)))
            # Nothing else happens: only the deadline can wake the engine.
            with anyio.fail_after(5):
                message = engine_message_decoder().decode(await from_engine.recv())
            to_engine.send_nowait(encode(Shutdown()))
    finally:
        release.set()
        pipes.close()
        directory.cleanup()
        core.close()
    assert isinstance(message, EngineCoreOutputs)
    assert message.finished == [
        FinishedRequest(
            "slow",
            "error",
            None,
            "the structured_outputs.regex grammar did not compile within 0.2 s",
        )
    ]
