"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, in its request and response shapes.

Clients (vLLM's own benchmark client among them) use them to count a prompt's tokens against
``max_model_len`` before sending it, so a prompt of any length is tokenized, never refused.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine_core._core.checks import show
from engine_core.server._chat import chat_prompt
from engine_core.server._errors import APIError
from engine_core.server._protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from engine_core.server._serving import ServerState, read_body

__all__ = ["detokenize", "tokenize"]


def _token_ids(state: ServerState, body: TokenizeRequest) -> list[int]:
    if body.return_token_strs:
        raise APIError(400, "return_token_strs is not supported", param="return_token_strs")
    if body.messages is not None:
        if body.prompt is not None:
            raise APIError(400, "give either prompt or messages, not both", param="messages")
        chat = ChatCompletionRequest(
            messages=body.messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        return chat_prompt(state, chat)[1]
    if body.prompt is None:
        raise APIError(400, "prompt or messages is required", param="prompt")
    add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
    return state.tokenizer.encode(body.prompt, add_special_tokens=add_special_tokens)


async def tokenize(state: ServerState, request: Request) -> Response:
    body = await read_body(request, TokenizeRequest, state)
    state.model_name(body.model)
    token_ids = _token_ids(state, body)
    result = TokenizeResponse(
        count=len(token_ids), max_model_len=state.max_model_len, tokens=token_ids
    )
    return Response(msgspec.json.encode(result), media_type="application/json")


async def detokenize(state: ServerState, request: Request) -> Response:
    body = await read_body(request, DetokenizeRequest, state)
    state.model_name(body.model)
    vocab_size = state.engine.info.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise APIError(
            400,
            f"token id {show(bad[0])} is outside the vocabulary (ids 0 to {vocab_size - 1})",
            param="tokens",
            code="invalid_value",
        )
    text = state.tokenizer.decode(body.tokens, skip_special_tokens=False)
    return Response(
        msgspec.json.encode(DetokenizeResponse(prompt=text)), media_type="application/json"
    )
