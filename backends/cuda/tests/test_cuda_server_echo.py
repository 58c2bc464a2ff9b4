"""The CUDA backend (on the CPU) behind ``/v1/completions``: the echoed prompt's logprobs that
``lm-eval``'s ``local-completions`` scores with are transformers' own (what ``lm-eval --model hf``
computes), within 1e-4, under asyncio and trio."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

import anyio
import httpx
import pytest
from hf_reference import log_softmax
from tiny_models import TinyModel

from engine_core import AsyncLLM
from engine_core._core.tokenizer import load_tokenizer
from engine_core.server import ServerSettings, serve

pytestmark = pytest.mark.anyio

CONTEXTS = ["the engine", "decode prefill batch"]
CONTINUATIONS = [" cache model", " step"]


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
async def url(anyio_backend: str, tiny: dict[str, TinyModel]) -> AsyncIterator[str]:
    stop = anyio.Event()
    async with (
        AsyncLLM(
            model=str(tiny["llama"].path),
            backend="cuda",
            backend_options={"device": "cpu", "kernels": "torch"},
            multiprocess=False,
            max_model_len=128,
            num_kv_blocks=32,
        ) as engine,
        anyio.create_task_group() as task_group,
    ):
        settings = ServerSettings(port=0, served_model_names=("tiny",))
        yield await task_group.start(
            functools.partial(serve, engine, settings, shutdown_trigger=stop.wait)
        )
        stop.set()


async def test_echoed_loglikelihoods_are_transformers(url: str, tiny: dict[str, TinyModel]) -> None:
    model = tiny["llama"]
    tokenizer = load_tokenizer(str(model.path))
    requests = []
    for context, continuation in zip(CONTEXTS, CONTINUATIONS, strict=True):
        ctx = tokenizer.encode(context)
        whole = tokenizer.encode(context + continuation)
        assert whole[: len(ctx)] == ctx
        requests.append((whole, len(ctx)))
    body = {
        "model": "tiny",
        "prompt": [whole for whole, _ in requests],
        "echo": True,
        "logprobs": 1,
        "max_tokens": 1,
        "temperature": 0,
        "seed": 1234,
    }
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    for choice, (whole, ctxlen) in zip(choices, requests, strict=True):
        logprobs = choice["logprobs"]["token_logprobs"]
        assert logprobs[0] is None
        reference = log_softmax(model.hf, whole)
        expected = [float(reference[i - 1, whole[i]]) for i in range(1, len(whole))]
        assert logprobs[1 : len(whole)] == pytest.approx(expected, abs=1e-4)
        # lm-eval's loglikelihood of the continuation, and its greedy check.
        assert sum(logprobs[ctxlen:-1]) == pytest.approx(sum(expected[ctxlen - 1 :]), abs=1e-4)
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(int(reference[i - 1].argmax()) == whole[i] for i in range(ctxlen, len(whole)))
        assert greedy == all(
            lp == max(top.values()) for lp, top in zip(logprobs[ctxlen:-1], tops, strict=True)
        )
