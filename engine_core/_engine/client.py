"""Clients of the engine core: one interface (:class:`EngineCoreClient`), in-process or across
a process boundary, and the one place that picks which runs a config (:func:`make_client`,
:func:`make_client_async`, for ``LLM`` and ``AsyncLLM``)."""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any, Literal

import anyio.to_thread

from engine_core._core.engine_io import EngineCoreOutputs, EngineCoreRequest, EngineInfo
from engine_core.config import EngineConfig

__all__ = ["ClientKind", "EngineCoreClient", "client_kind", "make_client", "make_client_async"]


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
        """Run a control call (see ``engine_io.UTILITY_METHODS``) in the engine core."""

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


ClientKind = Literal["inproc", "mp", "dp"]


def client_kind(
    config: EngineConfig, *, multiprocess: bool, data_parallel: bool = False
) -> ClientKind:
    """Which client runs ``config``: in this process when ``config.multiprocess`` is False (or
    None and ``multiprocess``, the caller's default, is False); else the data-parallel client
    for several engines, the Ray backend or when ``data_parallel`` asks for it (to measure its
    overhead with one engine); else one engine-core process."""
    if not (multiprocess if config.multiprocess is None else config.multiprocess):
        return "inproc"
    if config.data_parallel_size > 1 or config.data_parallel_backend == "ray" or data_parallel:
        return "dp"
    return "mp"


def make_client(
    config: EngineConfig, *, multiprocess: bool, data_parallel: bool = False
) -> EngineCoreClient:
    """The started client that runs ``config`` (see :func:`client_kind`); blocks until the
    engine is ready."""
    match client_kind(config, multiprocess=multiprocess, data_parallel=data_parallel):
        case "inproc":
            from engine_core._engine.inproc_client import InprocClient

            return InprocClient(config)
        case "dp":
            from engine_core._engine.dp.client import DPClient

            return DPClient(config)
        case "mp":
            from engine_core._engine.mp.client import MPClient

            return MPClient(config)


async def make_client_async(
    config: EngineConfig, *, multiprocess: bool, data_parallel: bool = False
) -> EngineCoreClient:
    """Like :func:`make_client`, without blocking the event loop."""
    match client_kind(config, multiprocess=multiprocess, data_parallel=data_parallel):
        case "inproc":
            from engine_core._engine.inproc_client import InprocClient

            return await anyio.to_thread.run_sync(InprocClient, config)
        case "dp":
            from engine_core._engine.dp.client import DPClient

            return await DPClient.start_async(config)
        case "mp":
            from engine_core._engine.mp.client import MPClient

            return await MPClient.start_async(config)
