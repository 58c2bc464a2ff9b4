"""``InprocClient``: the engine core inside the caller's process (offline ``LLM``, tests)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from engine_core._client import UTILITY_METHODS, EngineCoreClient
from engine_core._engine_core import EngineCore
from engine_core._protocol import EngineCoreOutputs, EngineCoreRequest, EngineInfo
from engine_core.abc import Backend
from engine_core.config import EngineConfig
from engine_core.errors import EngineClosedError

__all__ = ["InprocClient"]


class InprocClient(EngineCoreClient):
    """Drives an :class:`EngineCore` directly: ``get_output()`` runs one step."""

    def __init__(self, config: EngineConfig, *, backend_cls: type[Backend] | None = None) -> None:
        self.engine_core = EngineCore(config, backend_cls=backend_cls)
        core = self.engine_core
        self.info = EngineInfo(
            num_kv_blocks=core.num_kv_blocks,
            block_size=core.config.block_size,
            max_model_len=core.max_model_len,
            vocab_size=core.vocab_size,
            backend=config.backend,
        )
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine was shut down")

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_open()
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self._check_open()
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        self._check_open()
        return self.engine_core.step()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def call_utility(self, method: str, *args: Any) -> Any:
        self._check_open()
        if method not in UTILITY_METHODS:
            raise ValueError(f"unknown utility method {method!r}")
        if method == "check_health":
            return None
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine_core.close()
