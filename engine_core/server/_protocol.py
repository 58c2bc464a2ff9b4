"""The OpenAI wire format: request bodies (validated by msgspec) and response bodies.

Request structs accept OpenAI's fields plus vLLM's extra sampling fields (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ...); unknown fields are ignored, as
OpenAI's own API does with fields a model does not use. Response structs mirror OpenAI's shapes
field for field so the official clients parse them.
"""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

import msgspec

from engine_core.sampling_params import StructuredOutputsParams

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ErrorBody",
    "ErrorResponse",
    "StreamOptions",
    "Usage",
]


C = TypeVar("C")

# -- requests ------------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    """Send a last chunk (with no choices) carrying the usage of the whole request."""


class JSONSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``."""

    type: str = "text"
    json_schema: JSONSchemaFormat | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields both endpoints share: OpenAI's sampling fields and vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0
    allowed_token_ids: list[int] | None = None
    """vLLM's: only these tokens may be sampled (a +100 logit bias on each)."""
    bad_words: list[str] | None = None
    """vLLM's: words never to generate; each must be one token, as written or after a space (a
    -100 logit bias on those tokens)."""
    prompt_logprobs: int | None = None
    """vLLM's: the logprobs of the prompt's tokens (and of this many most likely candidates at
    each position), answered as ``prompt_logprobs`` (the first position ``null``)."""
    structured_outputs: StructuredOutputsParams | None = None
    """vLLM's constraint: exactly one of ``json``, ``json_object``, ``regex``, ``choice``,
    ``grammar``."""


class CompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/completions``."""

    prompt: str | list[str | int | list[int]]
    max_tokens: int | None | msgspec.UnsetType = msgspec.UNSET
    """Absent: 16 (OpenAI's default), fewer when the prompt leaves less room; null: as many as
    fit. Given, the prompt and it must fit ``max_model_len``."""
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant message's calls: ``{"id", "type": "function", "function": {"name",
    "arguments"}}``."""
    tool_call_id: str | None = None
    """A ``tool`` message: the call it answers."""
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    """Deprecated by OpenAI for ``max_completion_tokens``, which wins when both are given.
    Absent: as many as fit in ``max_model_len``; given, the prompt and it must fit."""
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    """Function tools: ``{"type": "function", "function": {"name", "description",
    "parameters"}}``."""
    tool_choice: str | dict[str, Any] | None = None
    """``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function", "function":
    {"name"}}``; absent: ``"auto"`` with tools, else ``"none"``."""
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template. As in vLLM, ``add_generation_prompt`` and
    ``continue_final_message`` here override the fields of the same name, and ``bos_token`` /
    ``eos_token`` the tokenizer's (as Hugging Face's ``apply_chat_template`` lets them);
    ``messages``, ``chat_template`` and ``tokenize`` are refused (400)."""


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /tokenize``: a ``prompt`` (its completion form) or ``messages`` (its chat
    form, rendered with the chat template as ``/v1/chat/completions`` renders them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """The completion form only: add the special tokens the tokenizer adds by itself (a BOS,
    say); default true. The chat form gives the ids ``/v1/chat/completions`` uses."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /detokenize``."""

    tokens: list[int]
    model: str | None = None


# -- responses -----------------------------------------------------------------------------------


class CompletionTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class Usage(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None
    """With a reasoning parser: how many completion tokens were thinking."""


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """The legacy completions logprobs: columns over the generated tokens (with ``echo``, over
    the prompt's tokens first, whose first token has no logprob: ``null``)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct, kw_only=True):
    """vLLM's ``prompt_logprobs`` entry of one candidate token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's ``prompt_logprobs``: per prompt position (the first ``null``), the candidates by token
id (the prompt's own token and the most likely ones)."""


class ResponseBody(msgspec.Struct, Generic[C], kw_only=True):
    """What every response and streamed chunk of the completion endpoints holds; the subclasses
    add ``object`` (and name the type of their choices)."""

    id: str
    created: int
    model: str
    choices: list[C]
    usage: Usage | None = None


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class Completion(ResponseBody[CompletionChoice], kw_only=True):
    """A whole response, and (with no usage but in the last) each streamed chunk."""

    object: Literal["text_completion"] = "text_completion"


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob, kw_only=True):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprob]


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str
    """A JSON object as text."""


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class AssistantMessage(msgspec.Struct, kw_only=True):
    content: str | None
    role: Literal["assistant"] = "assistant"
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(ResponseBody[ChatChoice], kw_only=True):
    usage: Usage  # a whole response always has it
    object: Literal["chat.completion"] = "chat.completion"
    prompt_logprobs: PromptLogprobs | None = None


class FunctionDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of a streamed call: the id, type and name once, then pieces of arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(ResponseBody[ChatChunkChoice], kw_only=True):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None
    """A LoRA adapter's base model (None: a base model)."""
    max_model_len: int | None = None
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class ErrorBody(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody
