"""LoRA over HTTP: --lora-modules, a request's model picks the adapter, /v1/models with parent
and root, the load/unload endpoints (off by default, behind the API key), 404 model_not_found,
per-adapter metrics."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.lora_adapters import make_adapter
from helpers.serving import serving

from engine_core.cli import build_parser
from engine_core.server import ServerSettings
from engine_core.server._lora import parse_lora_module

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

KEY = {"Authorization": "Bearer sesame"}
GREEDY = {"prompt": "abc", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    make_adapter(root, "one", 1, offset=1)
    make_adapter(root, "two", 2, offset=2)
    make_adapter(root, "three", 3, offset=3)
    make_adapter(root, "big", 4, rank=128)
    return root


@pytest.fixture(scope="module")
async def server(adapter_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings: dict[str, Any] = {
        "api_key": "sesame",
        "lora_modules": (("one", str(adapter_dir / "one")), ("two", str(adapter_dir / "two"))),
        "enable_lora_runtime_updates": True,
    }
    async with serving(
        settings=settings, multiprocess=False, enable_lora=True, max_loras=2, max_cpu_loras=3
    ) as (client, _):
        client.headers.update(KEY)
        yield client


async def complete(client: httpx.AsyncClient, model: str) -> httpx.Response:
    return await client.post("/v1/completions", json={"model": model, **GREEDY})


async def test_a_requests_model_picks_its_adapter(server: httpx.AsyncClient) -> None:
    texts = {}
    for model in ("mock", "one", "two"):
        response = await complete(server, model)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        texts[model] = response.json()["choices"][0]["text"]
    assert texts == {"mock": "def", "one": "egi", "two": "fil"}
    chat = await server.post(
        "/v1/chat/completions",
        json={"model": "two", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert chat.status_code == 200 and chat.json()["model"] == "two"


async def test_models_lists_adapters_with_parent_and_root(
    server: httpx.AsyncClient, adapter_dir: Path
) -> None:
    cards = {c["id"]: c for c in (await server.get("/v1/models")).json()["data"]}
    assert {"mock", "one", "two"} <= set(cards)
    assert cards["mock"]["parent"] is None
    assert cards["one"]["parent"] == "mock" and cards["one"]["root"] == str(adapter_dir / "one")
    card = (await server.get("/v1/models/two")).json()
    assert card["parent"] == "mock" and card["root"] == str(adapter_dir / "two")


async def test_an_unknown_model_is_404_model_not_found(server: httpx.AsyncClient) -> None:
    response = await complete(server, "nope")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and "'nope'" in error["message"]
    assert "'one'" in error["message"]  # the adapters are listed among what is served


async def test_load_use_and_unload_an_adapter(server: httpx.AsyncClient, adapter_dir: Path) -> None:
    body = {"lora_name": "three", "lora_path": str(adapter_dir / "three")}
    response = await server.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == 200, response.text
    again = await server.post("/v1/load_lora_adapter", json=body)
    assert again.status_code == 400 and "already been loaded" in again.text
    assert (await complete(server, "three")).json()["choices"][0]["text"] == "gko"
    assert "three" in {c["id"] for c in (await server.get("/v1/models")).json()["data"]}
    response = await server.post("/v1/unload_lora_adapter", json={"lora_name": "three"})
    assert response.status_code == 200, response.text
    gone = await complete(server, "three")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    missing = await server.post("/v1/unload_lora_adapter", json={"lora_name": "three"})
    assert missing.status_code == 404
    # The others are unaffected.
    assert (await complete(server, "one")).json()["choices"][0]["text"] == "egi"


@pytest.mark.parametrize(
    ("path", "reason"),
    [("nowhere", "does not exist"), ("big", "rank 128 is above max_lora_rank (16)")],
)
async def test_a_bad_adapter_is_a_400_naming_it(
    server: httpx.AsyncClient, adapter_dir: Path, path: str, reason: str
) -> None:
    body = {"lora_name": "bad", "lora_path": str(adapter_dir / path)}
    response = await server.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "'bad'" in message and reason in message
    assert (await complete(server, "bad")).status_code == 404
    assert (await complete(server, "one")).status_code == 200


async def test_the_endpoints_need_the_api_key(server: httpx.AsyncClient) -> None:
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        response = await server.post(
            path, json={"lora_name": "x", "lora_path": "/x"}, headers={"Authorization": ""}
        )
        assert response.status_code == 401


async def test_metrics_per_adapter(server: httpx.AsyncClient) -> None:
    await complete(server, "one")
    text = (await server.get("/metrics")).text
    assert 'engine_core_lora_generation_tokens_total{lora_name="one"}' in text
    assert 'engine_core_lora_prompt_tokens_total{lora_name="one"}' in text
    assert 'engine_core_lora_loaded{lora_name="one"} 1.0' in text
    assert "engine_core_lora_requests_running" in text


async def test_runtime_updates_are_off_by_default(adapter_dir: Path) -> None:
    settings = {"lora_modules": (("one", str(adapter_dir / "one")),)}
    async with serving(settings=settings, multiprocess=False, enable_lora=True) as (client, _):
        body = {"lora_name": "two", "lora_path": str(adapter_dir / "two")}
        assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 404
        assert (await client.post("/v1/unload_lora_adapter", json=body)).status_code == 404
        assert (await complete(client, "one")).json()["choices"][0]["text"] == "egi"


def test_lora_modules_forms_and_errors() -> None:
    assert parse_lora_module("a=/p/a") == ("a", "/p/a")
    assert parse_lora_module(json.dumps({"name": "b", "path": "/p/b"})) == ("b", "/p/b")
    for bad in ("a", "=/p", "a=", '{"name": "x"}', "{oops"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)
    args = build_parser().parse_args(
        [
            "serve",
            "--enable-lora",
            "--max-loras",
            "4",
            "--lora-modules",
            "a=/p/a",
            '{"name": "b", "path": "/p/b"}',
            "--enable-lora-runtime-updates",
        ]  # fmt: skip
    )
    assert args.lora_modules == ["a=/p/a", '{"name": "b", "path": "/p/b"}']
    assert args.enable_lora_runtime_updates and args.cfg_enable_lora and args.cfg_max_loras == 4
    with pytest.raises(ValueError, match="twice"):
        ServerSettings(lora_modules=(("a", "/x"), ("a", "/y")))
