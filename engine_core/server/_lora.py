"""LoRA adapters over HTTP, as vLLM serves them: ``--lora-modules name=path`` (or vLLM's JSON
``{"name": ..., "path": ...}``) registers adapters that a request's ``model`` picks;
``/v1/models`` lists them with ``parent`` (the base model) and ``root`` (their path); with
``--enable-lora-runtime-updates``, ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (bodies ``{"lora_name", "lora_path"}``) change them at run
time, behind the API key like every ``/v1`` route. An unknown name is a 404
``model_not_found``; an adapter that cannot be served a 400 naming it."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine_core.lora import LoRAError, LoRARequest
from engine_core.server._errors import APIError
from engine_core.server._serving import read_body

if TYPE_CHECKING:
    from engine_core.server._serving import ServerState

__all__ = [
    "LoadLoRARequest",
    "UnloadLoRARequest",
    "load_lora_adapter",
    "parse_lora_module",
    "unload_lora_adapter",
]


class LoadLoRARequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None


def parse_lora_module(text: str) -> tuple[str, str]:
    """``name=path`` or ``{"name": ..., "path": ...}`` -> ``(name, path)``; ``ValueError``
    naming ``--lora-modules`` otherwise."""
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--lora-modules: {text!r} is not JSON: {e}") from None
        name, path = raw.get("name"), raw.get("path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(
                f'--lora-modules: {text!r} needs "name" and "path" (non-empty strings)'
            )
        return name, path
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {text!r} is not name=path or JSON")
    return name, path


async def load_lora_adapter(state: ServerState, request: Request) -> Response:
    """``POST /v1/load_lora_adapter``: load and register an adapter under ``lora_name``."""
    body = await read_body(request, LoadLoRARequest, state)
    name, path = body.lora_name, body.lora_path
    if not name or not path:
        raise APIError(400, "lora_name and lora_path must be non-empty", param="lora_name")
    if name in state.loras:
        raise APIError(400, f"the LoRA adapter {name!r} has already been loaded", param="lora_name")
    if name in state.model_names:
        raise APIError(400, f"{name!r} is the base model's name", param="lora_name")
    lora = LoRARequest(name, state.next_lora_id(), path)
    try:
        await state.engine.add_lora(lora)
    except LoRAError as e:
        raise APIError(400, str(e), param="lora_path") from None
    state.loras[name] = lora
    return Response(f"Success: LoRA adapter '{name}' added successfully.", 200)


async def unload_lora_adapter(state: ServerState, request: Request) -> Response:
    """``POST /v1/unload_lora_adapter``: forget an adapter; its requests in flight finish."""
    body = await read_body(request, UnloadLoRARequest, state)
    lora = state.loras.get(body.lora_name)
    if lora is None:
        raise APIError(
            404,
            f"the LoRA adapter {body.lora_name!r} cannot be found",
            param="lora_name",
            code="model_not_found",
        )
    del state.loras[body.lora_name]
    await state.engine.remove_lora(lora.lora_int_id)
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", 200)
