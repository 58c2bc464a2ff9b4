"""A real engine-core process fed raw frames it cannot decode: a request whose id can be read is
answered with an error for that id (nobody waits forever), a frame without one is dropped, both
are counted in the engine's stats, and the engine keeps serving. Client and engine process run
under asyncio and under trio."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
import pytest

from engine_core._core.engine_io import EngineCoreRequest, FinishedRequest
from engine_core._engine.mp.client import MPClient
from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

encode = msgspec.msgpack.encode


def _deep_schema_frame(request_id: str) -> bytes:
    """An "add" frame whose JSON schema nests 100000 levels (msgspec's RecursionError)."""
    head = encode(["add", request_id, [1], {"structured_outputs": {"json": {"a": 0}}}])
    return head[:-1] + b"\x91" * 100_000 + b"\x90"


def _frames(tag: str) -> dict[str, tuple[bytes, str]]:
    """Frames bearing a readable request id, and what the error for it says."""
    return {
        f"bool-{tag}": (encode(["add", f"bool-{tag}", [1], {"ignore_eos": "no"}]), "ignore_eos"),
        f"kind-{tag}": (encode(["add", f"kind-{tag}", [1], {"output_kind": 7}]), "output_kind"),
        f"prio-{tag}": (encode(["add", f"prio-{tag}", [1], {}, 0.0, "high"]), "$.priority"),
        f"salt-{tag}": (encode(["add", f"salt-{tag}", [1], {}, 0.0, 0, [], 5]), "$.cache_salt"),
        f"big-{tag}": (encode(["add", f"big-{tag}", [1], {"max_tokens": 2**64 - 1}]), "max_tokens"),
        f"json-{tag}": (
            encode(["add", f"json-{tag}", [1], {"structured_outputs": {"json": "[" * 10**5}}]),
            "structured_outputs.json is nested deeper than 100 levels",
        ),
        f"deep-{tag}": (_deep_schema_frame(f"deep-{tag}"), "RecursionError"),
        f"cut-{tag}": (
            encode(EngineCoreRequest(f"cut-{tag}", [1], SamplingParams()))[:-2],
            "Input data was truncated",
        ),
    }


async def test_undecodable_requests_end_with_an_error(anyio_backend: str) -> None:
    runtime: Any = anyio_backend
    config = EngineConfig(backend="mock", num_kv_blocks=64, engine_runtime=runtime)
    frames = _frames(anyio_backend)
    dropped = [b"\xc1", encode(["bogus", "x"]), encode(["add", 5, [1]]), b"\x92\xa3add"]
    with MPClient(config) as engine:
        for frame in dropped:
            engine.send_raw(frame)
        for frame, _ in frames.values():
            engine.send_raw(frame)
        ok = f"ok-{anyio_backend}"
        engine.add_request(EngineCoreRequest(ok, [1], SamplingParams(max_tokens=2)))
        finished: dict[str, FinishedRequest] = {}
        with anyio.fail_after(20):
            while len(finished) < len(frames) + 1:
                outputs = await engine.get_output_async()
                finished.update((f.req_id, f) for f in outputs.finished)
        assert finished.pop(ok) == FinishedRequest(ok, "length")
        assert sorted(finished) == sorted(frames)
        for request_id, (_, reason) in frames.items():
            entry = finished[request_id]
            assert entry.finish_reason == "error" and not entry.retryable
            assert entry.error is not None
            assert entry.error.startswith("the engine could not decode the request: ")
            assert reason in entry.error, (request_id, entry.error)
        stats = await engine.call_utility_async("get_stats")
        assert stats.num_malformed_messages == len(dropped) + len(frames)
        assert (stats.num_running, stats.num_waiting, stats.num_free_kv_blocks) == (0, 0, 64)
