"""engine-core: an LLM inference engine core on structured concurrency, with pluggable backends.

The public surface is re-exported here; everything in ``engine_core._*`` is private.
``LLM`` and ``AsyncLLM`` are imported lazily so ``import engine_core`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine_core._core.engine_io import EngineStats
from engine_core._plugins import list_backends
from engine_core.config import EngineConfig, SpeculativeConfig
from engine_core.errors import (
    BackendError,
    EngineClosedError,
    EngineDeadError,
    EngineError,
    EngineStalledError,
    InvalidRequestError,
    RequestError,
    RetryableRequestError,
)
from engine_core.lora import LoRAError, LoRARequest, LoRASupport, UnknownLoRAError
from engine_core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine_core.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from engine_core._frontend.async_llm import AsyncLLM
    from engine_core._frontend.llm import LLM

__version__ = "0.1.0"

__all__ = [
    "AsyncLLM",
    "BackendError",
    "CompletionOutput",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineStalledError",
    "EngineStats",
    "InvalidRequestError",
    "LLM",
    "LoRAError",
    "LoRARequest",
    "LoRASupport",
    "Logprob",
    "RequestError",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "RetryableRequestError",
    "SamplingParams",
    "SpeculativeConfig",
    "StructuredOutputsParams",
    "UnknownLoRAError",
    "list_backends",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine_core._frontend.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from engine_core._frontend.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'engine_core' has no attribute {name!r}")
