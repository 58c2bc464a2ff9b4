"""The entry point's object: cheap to import, loads :class:`MockBackend` on demand."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_core.abc import Backend
    from engine_core.config import EngineConfig

__all__ = ["MockProvider", "provider"]


class MockProvider:
    """Says that the mock runs anywhere and imports it when asked."""

    name = "mock"
    install_hint = "pip install engine-core-mock"

    def is_available(self, config: EngineConfig | None = None) -> tuple[bool, str]:
        """Always usable: the mock needs nothing but the CPU."""
        return True, "deterministic CPU mock"

    def load(self) -> type[Backend]:
        """The :class:`~engine_core_mock.MockBackend` class."""
        from engine_core_mock._backend import MockBackend

        return MockBackend

    def __repr__(self) -> str:
        return "MockProvider()"


provider = MockProvider()
