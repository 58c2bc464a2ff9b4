"""Fuzzing the completion endpoints over HTTP with mutated request bodies (wrong types, huge
ints, deep nesting, unknown fields, odd unicode, negative values, huge ``n``, long stop lists,
broken JSON), under asyncio (uvicorn) and trio (hypercorn).

Whatever comes in: no 5xx (the engine is neither dead nor paused here, so not even a 503), no
``server_error`` event in a stream, every request ends, ``/health`` answers within 100 ms all
along (100 ms of the server's own time: a shared machine may stall the whole process longer,
so the wall-clock bound is looser), and once every response has ended the engine holds no
request.
"""

from __future__ import annotations

import gc
import json
import time
from typing import Any

import anyio
import httpx
import pytest
from helpers.serving import fuzz_server, serving
from hypothesis import strategies as st

pytestmark = pytest.mark.anyio

MAX_EXAMPLES = 150
"""Per endpoint and runtime: about 2 s each."""
HEALTH_LIMIT_S = 0.1

COMPLETION = {"prompt": "abc", "max_tokens": 4, "temperature": 0.0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0.0}
SAMPLING_FIELDS = [
    "model", "n", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
    "presence_penalty", "frequency_penalty", "logit_bias", "user", "top_k", "min_p",
    "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
    "priority", "structured_outputs", "max_tokens",
]  # fmt: skip
FIELDS = {
    "/v1/completions": [*SAMPLING_FIELDS, "prompt", "logprobs", "echo", "best_of", "suffix"],
    "/v1/chat/completions": [
        *SAMPLING_FIELDS, "messages", "max_completion_tokens", "logprobs", "top_logprobs",
        "response_format", "tools", "add_generation_prompt", "continue_final_message",
        "chat_template_kwargs",
    ],
}  # fmt: skip
UNKNOWN_FIELDS = ["foo", "", "__proto__", "\u0000", "промпт", "x" * 300, "max_tokens "]


class Raw:
    """JSON text spliced into a body as it is (nesting too deep for ``json.dumps``, broken
    text)."""

    def __init__(self, text: str) -> None:
        self.text = text


def nested(depth: int, inner: str = "1") -> Raw:
    return Raw("[" * depth + inner + "]" * depth)


huge_ints = st.sampled_from(
    [0, -1, 1, 2, 127, 128, 129, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
     -(2**63), -(2**63) - 1, -(2**64), 10**30, -(10**30), 10**400, 10**9]
)  # fmt: skip
odd_text = st.one_of(
    st.text(max_size=20),
    st.sampled_from(
        ["", "\ud800", "\udfff", "\u0000", "\u202e", "🙂🙂", "a\nb", "{[", "\\", '"', "\ufeff",
         "\U0010ffff"]
    ),
    st.tuples(st.sampled_from(["x", "{", "🙂", "\\"]), st.sampled_from([300, 5000])).map(
        lambda part: part[0] * part[1]
    ),
)  # fmt: skip
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    huge_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    odd_text,
)
deep = st.one_of(
    st.integers(1, 140).map(nested),
    st.sampled_from([200, 1_000, 5_000, 50_000]).map(nested),
    st.integers(1, 200).map(lambda d: Raw('{"a":' * d + "1" + "}" * d)),
)
grammars = st.sampled_from(
    [
        {"choice": ["x", "y"]},
        {"regex": "[0-9]{2}"},
        {"regex": "[0-9"},
        {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        {"json": "{"},
        {"json_object": True},
        {"grammar": "start: 'a'"},
        {"choice": []},
        {"regex": "a", "choice": ["b"]},
    ]
)
messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.one_of(odd_text, scalars),
            "content": st.one_of(
                odd_text,
                scalars,
                st.lists(
                    st.dictionaries(st.sampled_from(["type", "text", "x"]), scalars | odd_text),
                    max_size=3,
                ),
            ),
            "name": scalars,
        },
    ),
    max_size=4,
)
values = st.recursive(
    st.one_of(scalars, deep, grammars, messages),
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(odd_text, children, max_size=4),
    ),
    max_leaves=12,
)
special = {
    "n": st.one_of(huge_ints, st.integers(-2, 200)),
    "stop": st.one_of(
        st.lists(odd_text, min_size=50, max_size=120), st.lists(st.text(max_size=2000), max_size=3)
    ),
    "stop_token_ids": st.lists(st.one_of(huge_ints, st.integers(-5, 400)), max_size=300),
    "prompt": st.one_of(
        odd_text,
        st.lists(st.one_of(huge_ints, st.integers(-1, 300)), max_size=50),
        st.lists(st.lists(st.integers(-1, 300), max_size=5), max_size=300),
        st.lists(odd_text, max_size=5),
    ),
    "messages": messages,
    "structured_outputs": grammars,
    "response_format": st.sampled_from(
        [{"type": "json_object"}, {"type": "json_schema"}, {"type": "xml"}, {"type": 5}]
    ),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(
            ["add_generation_prompt", "continue_final_message", "messages", "bos_token", "x"]
        ),
        values,
        max_size=3,
    ),
    "stream_options": st.sampled_from([{"include_usage": True}, {"include_usage": 5}, []]),
    "max_tokens": st.one_of(huge_ints, st.integers(-2, 100), st.none()),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 25)),
}


def encode(body: Any, ascii_only: bool) -> bytes:
    """``body`` as JSON, with :class:`Raw` parts spliced in; non-finite floats come out as
    ``NaN``/``Infinity`` (not JSON) and, with ``ascii_only`` False, lone surrogates as
    invalid UTF-8."""
    raws: list[str] = []

    def placeholder(value: Any) -> Any:
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"\u0001raw{len(raws) - 1}\u0001"
        if isinstance(value, dict):
            return {key: placeholder(item) for key, item in value.items()}
        if isinstance(value, list):
            return [placeholder(item) for item in value]
        return value

    text = json.dumps(placeholder(body), ensure_ascii=ascii_only)
    for index, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\u0001raw{index}\u0001"), raw, 1)
    return text.encode("utf-8", "surrogatepass")


@st.composite
def bodies(draw: st.DrawFn, path: str) -> bytes:
    body: Any = dict(COMPLETION if path == "/v1/completions" else CHAT)
    body["stream"] = draw(st.booleans())
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["set", "set", "set", "delete", "unknown"]))
        if action == "set":
            name = draw(st.sampled_from(FIELDS[path]))
            body[name] = draw(special.get(name, values))
        elif action == "delete" and body:
            del body[draw(st.sampled_from(sorted(body)))]
        else:
            body[draw(st.sampled_from(UNKNOWN_FIELDS))] = draw(values)
    whole = draw(st.integers(0, 19))
    if whole == 0:  # not an object at all
        body = draw(values)
    raw = encode(body, ascii_only=draw(st.booleans()))
    if whole == 1:  # cut short
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif whole == 2:  # garbage
        raw = draw(st.binary(max_size=200))
    return raw


def check_response(path: str, raw: bytes, status: int, data: bytes) -> None:
    context = (path, raw[:300], status, data[:300])
    assert status < 500, context
    assert status in (200, 400, 404, 413), context
    if status == 200 and data.startswith(b"data: "):
        assert data.endswith(b"data: [DONE]\n\n"), context
        assert b'"server_error"' not in data, context
    elif status != 200:
        error = json.loads(data)["error"]
        assert error["type"] == "invalid_request_error", context


def fuzz(url: str, path: str) -> int:
    """Post fuzzed bodies to ``path`` (from a worker thread); returns how many."""

    def post(client: httpx.Client, raw: bytes) -> None:
        headers = {"content-type": "application/json"}
        with client.stream("POST", path, content=raw, headers=headers) as response:
            data = response.read()
        check_response(path, raw, response.status_code, data)

    return fuzz_server(url, bodies(path), post, MAX_EXAMPLES)


async def test_fuzzed_bodies_get_no_5xx_and_leave_the_server_healthy() -> None:
    async with serving(
        multiprocess=False, max_model_len=64, settings={"max_request_body_bytes": 1 << 20}
    ) as (client, engine):
        url = str(client.base_url)
        # The first constrained request loads llguidance into the (in-process) engine: not the
        # server's work, and not what the health checks measure.
        warm = {**COMPLETION, "structured_outputs": {"choice": ["x"]}}
        assert (await client.post("/v1/completions", json=warm)).status_code == 200
        latencies: list[tuple[float, float]] = []
        """Per health check: (seconds it took, CPU seconds the event loop's thread spent
        meanwhile). A check slowed by the server's own work shows in both; one slowed by other
        processes on a shared machine only in the first."""
        fuzzing = True

        async def ping_health() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=5.0) as health:
                while fuzzing:
                    cpu, started = time.thread_time(), time.perf_counter()
                    response = await health.get("/health")
                    latencies.append((time.perf_counter() - started, time.thread_time() - cpu))
                    assert response.status_code == 200
                    await anyio.sleep(0.01)

        # What the test session holds by now (every module it imported) is kept out of the
        # garbage collector's passes: a full pass over it is not the server's work.
        gc.freeze()
        try:
            with anyio.fail_after(120):
                async with anyio.create_task_group() as task_group:
                    task_group.start_soon(ping_health)
                    try:
                        for path in FIELDS:
                            assert await anyio.to_thread.run_sync(fuzz, url, path) >= MAX_EXAMPLES
                    finally:
                        fuzzing = False
        finally:
            gc.unfreeze()
        # Every response has ended: the engine holds nothing (aborts land between steps).
        with anyio.fail_after(5):
            while (stats := await engine.get_stats()).num_running or stats.num_waiting:
                await anyio.sleep(0.005)
        assert len(latencies) > 20
        slowest = max(min(wall, cpu) for wall, cpu in latencies)
        assert slowest < HEALTH_LIMIT_S, sorted(latencies)[-5:]
        assert max(wall for wall, _ in latencies) < 1.0, sorted(latencies)[-5:]
