"""The ASGI application: routes, API-key check and error responses in OpenAI's shape."""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from engine_core._frontend.async_llm import AsyncLLM
from engine_core.errors import EngineError
from engine_core.lora import LoRARequest
from engine_core.server._chat import create_chat_completion
from engine_core.server._chat_template import load_chat_template
from engine_core.server._completions import create_completion
from engine_core.server._errors import APIError, error_json
from engine_core.server._lora import load_lora_adapter, unload_lora_adapter
from engine_core.server._protocol import ModelCard, ModelList
from engine_core.server._reasoning import (
    DEFAULT_FORCED_REASONING_CHARS,
    MAX_FORCED_REASONING_CHARS,
    get_reasoning_parser,
)
from engine_core.server._responses import create_response
from engine_core.server._serving import ServerState
from engine_core.server._sse import EventStreamResponse
from engine_core.server._tokenize import detokenize, tokenize
from engine_core.server.tools import get_tool_parser

__all__ = ["ServerSettings", "create_app"]

logger = logging.getLogger("engine_core.server")

_ENCODER = msgspec.json.Encoder()
_BEARER = "bearer "
_STATUS_CODES = {404: "not_found", 405: "method_not_allowed"}

Handler = Callable[[ServerState, Request], Awaitable[Response | EventStreamResponse]]
Endpoint = Callable[[Request], Awaitable[Response | EventStreamResponse]]


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """How the HTTP server runs (the engine is configured by :class:`EngineConfig`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    """0 picks a free port."""
    api_key: str | None = None
    """When set, ``/v1/*`` requests need ``Authorization: Bearer <api_key>``."""
    served_model_names: tuple[str, ...] = ()
    """Names clients may ask for; empty: ``--model`` as given, else the backend's name
    (``"mock"``)."""
    chat_template: str | None = None
    """A chat template file or text, overriding the tokenizer's."""
    max_request_body_bytes: int = 16 << 20
    health_timeout_s: float = 5.0
    """``/health`` answers 503 when the engine does not answer within this time."""
    keep_alive_timeout_s: float = 65.0
    """A connection that waits for its next request is closed after this long (before its
    first request: after ``header_timeout_s`` at most). Longer than the idle expiry of common
    clients (httpx and the OpenAI Python SDK 5 s, Node's fetch 4 s, aiohttp 15 s) and of common load
    balancers (60 s): they end an idle connection before the server does, so a request of
    theirs never meets a connection the server is closing."""
    header_timeout_s: float = 10.0
    """A request's headers must be in within this long of its first byte, or its connection
    is closed."""
    body_timeout_s: float = 30.0
    """A request's body must be in within this long of its headers, or it is answered 408."""
    max_connections: int | None = None
    """Connections held at once; past it a new one replaces the one that has waited longest
    for a request, or is answered 503 when all are in a request. None: what the process's
    file-descriptor limit allows (:func:`default_max_connections`)."""
    shutdown_timeout_s: float = 30.0
    """On shutdown, how long in-flight responses may take to finish before they are ended
    with an error (a stream: an error event and ``data: [DONE]``)."""
    disable_any_whitespace: bool = False
    """Compact JSON (no whitespace between tokens) for every request constrained to JSON, as
    if each set ``structured_outputs.disable_any_whitespace``."""
    access_log: bool = False
    log_requests: bool = False
    """Log one line per request (id, prompt and output token counts, finish reason, latency)
    to the ``engine_core.server.requests`` logger, at INFO."""
    http_server: Literal["auto", "uvicorn", "hypercorn"] = "auto"
    """``"auto"``: uvicorn under asyncio where it is installed, else hypercorn (trio: always)."""
    tool_call_parser: str | None = None
    """The format the model writes tool calls in (``hermes``, ``llama3_json``, ``mistral``),
    read out of its text for ``tool_choice: "auto"``."""
    enable_auto_tool_choice: bool = False
    """Serve ``tool_choice: "auto"`` (needs ``tool_call_parser``)."""
    reasoning_parser: str | None = None
    """``qwen3`` or ``deepseek_r1``: the thinking goes to ``reasoning_content``."""
    max_forced_reasoning_chars: int = DEFAULT_FORCED_REASONING_CHARS
    """With a reasoning parser, the most characters a forced tool call (``tool_choice``
    ``"required"`` or a named function) may think before the grammar closes the thinking and
    the call follows; 0: no thinking before such a call."""
    strict_request_fields: bool = False
    """Answer 400 to a request body with a field the server does not know (by default such a
    field is ignored, with one warning per request naming it)."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """LoRA adapters served under names: ``(name, path)`` pairs (``--lora-modules``); the
    engine needs ``enable_lora``."""
    enable_lora_runtime_updates: bool = False
    """Serve ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``."""

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.max_request_body_bytes <= 0:
            raise ValueError(
                f"max_request_body_bytes must be > 0, got {self.max_request_body_bytes!r}"
            )
        if self.http_server not in ("auto", "uvicorn", "hypercorn"):
            raise ValueError(
                f"http_server must be 'auto', 'uvicorn' or 'hypercorn', got {self.http_server!r}"
            )
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty when given")
        for name in (
            "health_timeout_s",
            "keep_alive_timeout_s",
            "header_timeout_s",
            "body_timeout_s",
            "shutdown_timeout_s",
        ):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"{name} must be > 0 and finite, got {value!r}")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # ValueError naming the known ones
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        forced = self.max_forced_reasoning_chars
        if not (isinstance(forced, int) and 0 <= forced <= MAX_FORCED_REASONING_CHARS):
            raise ValueError(
                f"max_forced_reasoning_chars must be an int in [0, {MAX_FORCED_REASONING_CHARS}]"
                f" (the grammar that counts them grows with it), got {forced!r}"
            )
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names an adapter twice: {names}")
        if set(names) & set(self.served_model_names):
            raise ValueError("a LoRA adapter's name is one of served_model_names")
        if self.max_connections is not None and not (
            isinstance(self.max_connections, int) and self.max_connections >= 1
        ):
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections!r}")


def _json(data: Any, status: int = 200) -> Response:
    return Response(_ENCODER.encode(data), status_code=status, media_type="application/json")


def _error_response(exc: APIError) -> Response:
    headers = {"www-authenticate": "Bearer"} if exc.status == 401 else None
    return Response(exc.body(), exc.status, headers=headers, media_type="application/json")


def _authorized(state: ServerState, request: Request) -> None:
    expected = state.api_key
    if expected is None:
        return
    header = request.headers.get("authorization", "")
    given = header[len(_BEARER) :] if header[: len(_BEARER)].lower() == _BEARER else ""
    # Digests compared in constant time: neither how much of a guess was right nor the key's
    # length shows in the response time.
    if not hmac.compare_digest(hashlib.sha256(given.encode()).digest(), expected):
        raise APIError(
            401,
            "missing or incorrect API key; send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )


def _api_endpoint(state: ServerState, handler: Handler) -> Endpoint:
    """A ``/v1`` endpoint: the API key checked, :class:`APIError` answered in OpenAI's shape."""

    async def endpoint(request: Request) -> Response | EventStreamResponse:
        try:
            _authorized(state, request)
            return await handler(state, request)
        except APIError as exc:
            return _error_response(exc)

    return endpoint


class _App:
    """The ASGI app: ``POST`` to the completion endpoints goes straight to its handler, the rest
    through Starlette. Those two carry nearly all the traffic, and Starlette's middleware and
    routing would cost a request more than the handler's own work."""

    def __init__(self, starlette: Starlette, hot: dict[str, Endpoint]) -> None:
        self.starlette = starlette
        self.hot = hot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.hot.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await self.starlette(scope, receive, send)
            return
        try:
            response = await endpoint(Request(scope, receive, send))
        except Exception:
            logger.exception("%s failed", scope["path"])
            response = Response(error_json("internal server error", "server_error"), 500)
        await response(scope, receive, send)


def _model_card(state: ServerState, name: str) -> ModelCard:
    lora = state.loras.get(name)
    if lora is not None:  # as vLLM lists an adapter: its path as root, the base as parent
        return ModelCard(
            id=name,
            created=state.created,
            owned_by="engine-core",
            root=lora.lora_path,
            parent=state.model_names[0],
            max_model_len=state.max_model_len,
        )
    return ModelCard(
        id=name,
        created=state.created,
        owned_by="engine-core",
        root=state.engine.config.model,
        max_model_len=state.max_model_len,
    )


async def _models(state: ServerState, request: Request) -> Response:
    names = [*state.model_names, *state.loras]
    return _json(ModelList(data=[_model_card(state, name) for name in names]))


async def _model(state: ServerState, request: Request) -> Response:
    """``GET /v1/models/{id}``: the card of a served model, 404 for any other id."""
    name = state.model_name(request.path_params["model_id"])
    return _json(_model_card(state, name))


async def _health(state: ServerState, request: Request) -> Response:
    try:
        with anyio.fail_after(state.health_timeout_s):
            await state.engine.check_health()
    except (EngineError, TimeoutError) as exc:
        reason = "it did not answer" if isinstance(exc, TimeoutError) else str(exc)
        body = error_json(f"the engine is unhealthy: {reason}", "service_unavailable")
        return Response(body, 503, media_type="application/json")
    dp = state.engine.data_parallel
    if dp is not None:  # healthy while one engine is alive: say which are
        return _json({"engines": dp.engine_status()})
    return Response(b"", 200)


async def _version(state: ServerState, request: Request) -> Response:
    from engine_core import __version__

    return _json({"version": __version__})


async def _metrics(state: ServerState, request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    try:
        with anyio.fail_after(state.health_timeout_s):
            stats = await state.engine.get_stats()
    except (EngineError, TimeoutError):
        stats = None  # a dead engine: the server's own metrics still count
    dp = state.engine.data_parallel
    router = None if dp is None else dp.metrics
    return Response(state.metrics.render(stats, router), media_type=CONTENT_TYPE_LATEST)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = _STATUS_CODES.get(exc.status_code)
    return _error_response(APIError(exc.status_code, str(exc.detail), code=code))


async def _server_error(request: Request, exc: Exception) -> Response:
    return Response(error_json("internal server error", "server_error"), 500)


def _open_endpoint(state: ServerState, handler: Handler) -> Endpoint:
    """An endpoint that needs no API key (health checks and scrapes come without one)."""

    async def endpoint(request: Request) -> Response | EventStreamResponse:
        return await handler(state, request)

    return endpoint


def _server_state(engine: AsyncLLM, settings: ServerSettings) -> ServerState:
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise RuntimeError("create_app needs a started AsyncLLM (use it inside 'async with')")
    config = engine.config
    return ServerState(
        engine=engine,
        tokenizer=tokenizer,
        chat_template=load_chat_template(config.tokenizer_name, settings.chat_template),
        model_names=settings.served_model_names or (config.model or engine.info.backend,),
        log_requests=settings.log_requests,
        max_model_len=engine.info.max_model_len,
        api_key=(
            hashlib.sha256(settings.api_key.encode()).digest()
            if settings.api_key is not None
            else None
        ),
        max_body_bytes=settings.max_request_body_bytes,
        health_timeout_s=settings.health_timeout_s,
        disable_any_whitespace=settings.disable_any_whitespace,
        strict_request_fields=settings.strict_request_fields,
        tool_parser=(
            get_tool_parser(settings.tool_call_parser) if settings.tool_call_parser else None
        ),
        auto_tool_choice=settings.enable_auto_tool_choice,
        reasoning=(
            get_reasoning_parser(settings.reasoning_parser) if settings.reasoning_parser else None
        ),
        max_forced_reasoning_chars=settings.max_forced_reasoning_chars,
        loras=lora_requests(settings),
    )


def lora_requests(settings: ServerSettings) -> dict[str, LoRARequest]:
    """The adapters of ``--lora-modules`` by name, ids 1, 2, ..."""
    return {
        name: LoRARequest(name, i, path) for i, (name, path) in enumerate(settings.lora_modules, 1)
    }


def create_app(engine: AsyncLLM, settings: ServerSettings | None = None) -> ASGIApp:
    """The OpenAI-compatible ASGI app over a started ``engine`` (inside its ``async with``)."""
    state = _server_state(engine, settings or ServerSettings())
    hot = {
        "/v1/completions": _api_endpoint(state, create_completion),
        "/v1/chat/completions": _api_endpoint(state, create_chat_completion),
        "/v1/responses": _api_endpoint(state, create_response),
    }
    routes = [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in hot.items()),
        Route("/v1/models", _api_endpoint(state, _models), methods=["GET"]),
        # ``path``: served names may hold slashes ("org/model"), which clients percent-encode.
        Route("/v1/models/{model_id:path}", _api_endpoint(state, _model), methods=["GET"]),
        Route("/tokenize", _api_endpoint(state, tokenize), methods=["POST"]),
        Route("/detokenize", _api_endpoint(state, detokenize), methods=["POST"]),
        Route("/health", _open_endpoint(state, _health), methods=["GET"]),
        Route("/version", _open_endpoint(state, _version), methods=["GET"]),
        Route("/metrics", _open_endpoint(state, _metrics), methods=["GET"]),
    ]
    if settings is not None and settings.enable_lora_runtime_updates:
        routes += [
            Route(
                "/v1/load_lora_adapter",
                _api_endpoint(state, load_lora_adapter),
                methods=["POST"],
            ),
            Route(
                "/v1/unload_lora_adapter",
                _api_endpoint(state, unload_lora_adapter),
                methods=["POST"],
            ),
        ]
    exception_handlers = {HTTPException: _http_error, Exception: _server_error}
    starlette = Starlette(routes=routes, exception_handlers=exception_handlers)
    return _App(starlette, hot)
