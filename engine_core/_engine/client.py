"""Clients of the engine core: one interface, in-process or across a process boundary."""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any

from engine_core._core.engine_io import EngineCoreOutputs, EngineCoreRequest, EngineInfo

__all__ = ["EngineCoreClient", "UTILITY_METHODS"]

# Control calls a client forwards to the engine core by name (see EngineCore).
UTILITY_METHODS = frozenset(
    {
        "get_stats",
        "reset_prefix_cache",
        "profile",
        "sleep",
        "wake_up",
        "check_health",
        "pause_generation",
        "resume_generation",
        "is_paused",
        "kv_cache_snapshot",
    }
)


class EngineCoreClient(abc.ABC):
    """What the front end (``LLM``, ``AsyncLLM``) needs from an engine core.

    Sync methods serve the offline ``LLM``; ``*_async`` ones serve ``AsyncLLM``.
    """

    info: EngineInfo

    @abc.abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abc.abstractmethod
    def abort_requests(self, request_ids: Iterable[str]) -> None: ...

    @abc.abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs (blocks until there are some, or nothing is left to do)."""

    @abc.abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any:
        """Run a control call (see ``UTILITY_METHODS``) in the engine core."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.add_request(request)

    async def abort_requests_async(self, request_ids: Iterable[str]) -> None:
        self.abort_requests(request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        return self.get_output()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return self.call_utility(method, *args)

    async def shutdown_async(self) -> None:
        self.shutdown()
