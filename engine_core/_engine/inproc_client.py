"""``InprocClient``: the engine core inside the caller's process (offline ``LLM``, tests)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import anyio
import anyio.lowlevel

from engine_core._core.engine_io import EngineCoreOutputs, EngineCoreRequest, check_utility_call
from engine_core._engine.client import EngineCoreClient
from engine_core._engine.core import EngineCore
from engine_core.abc import Backend
from engine_core.config import EngineConfig
from engine_core.errors import EngineClosedError

__all__ = ["InprocClient"]


class InprocClient(EngineCoreClient):
    """Drives an :class:`EngineCore` directly: ``get_output()`` runs one step."""

    def __init__(self, config: EngineConfig, *, backend_cls: type[Backend] | None = None) -> None:
        if config.data_parallel_backend == "ray":
            raise ValueError(
                'data_parallel_backend="ray" runs the engines remotely: use multiprocess=True'
            )
        if config.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={config.data_parallel_size} needs one process per engine: "
                "use multiprocess=True"
            )
        self.engine_core = EngineCore(config, backend_cls=backend_cls)
        self.info = self.engine_core.info
        self._closed = False
        self._wakeup: anyio.Event | None = None

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine was shut down")

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_open()
        self.engine_core.add_request(request)
        self._wake()

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self._check_open()
        self.engine_core.abort_requests(request_ids)
        self._wake()

    def get_output(self) -> EngineCoreOutputs:
        self._check_open()
        return self.engine_core.step()

    async def get_output_async(self) -> EngineCoreOutputs:
        """Wait until there is work, then run one step in the event loop's thread (steps of
        the in-process engine are short; a checkpoint before each keeps the loop fair)."""
        while not self.engine_core.has_work:
            self._check_open()
            self._wakeup = anyio.Event()
            await self._wakeup.wait()
        self._wakeup = None
        await anyio.lowlevel.checkpoint()
        return self.get_output()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def call_utility(self, method: str, *args: Any) -> Any:
        self._check_open()
        check_utility_call(method, args)
        result = getattr(self.engine_core, method)(*args)
        self._wake()
        return result

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine_core.close()
            self._wake()
