"""Finding backends through the ``engine_core.backends`` entry-point group."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from engine_core.abc import Backend, BackendProvider
from engine_core.config import EngineConfig
from engine_core.errors import BackendError

__all__ = ["BackendInfo", "ENTRY_POINT_GROUP", "list_backends", "load_backend", "resolve_backend"]

ENTRY_POINT_GROUP = "engine_core.backends"
_MOCK = "mock"
logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """One installed backend and whether it can run here."""

    name: str
    usable: bool
    detail: str
    """Why it is unusable, or a short description of what it would run on."""
    install_hint: str
    provider: BackendProvider | None
    usable_with: dict[str, Any] | None = None
    """Unusable as asked but installed and usable with these ``backend_options`` (the CUDA
    backend without a GPU: ``{"device": "cpu"}``), from the provider's optional
    ``fallback_options``."""


def _usable_with(provider: BackendProvider, config: EngineConfig | None) -> dict[str, Any] | None:
    """The provider's ``fallback_options`` when the backend is usable with them."""
    fallback = getattr(provider, "fallback_options", None)
    if not isinstance(fallback, dict) or not fallback:
        return None
    options = {**(config.backend_options if config is not None else {}), **fallback}
    usable, _ = provider.is_available(EngineConfig(backend_options=options))
    return dict(fallback) if usable else None


def list_backends(config: EngineConfig | None = None) -> dict[str, BackendInfo]:
    """Every backend registered in the entry-point group, by name, and whether it is usable here
    (for ``config``, when given). Imports only the providers."""
    found: dict[str, BackendInfo] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            provider = ep.load()
            if not isinstance(provider, BackendProvider):
                raise TypeError(f"{ep.value} is not a BackendProvider")
            usable, detail = (
                provider.is_available() if config is None else provider.is_available(config)
            )
            usable_with = None if usable else _usable_with(provider, config)
            found[ep.name] = BackendInfo(
                ep.name, usable, detail, provider.install_hint, provider, usable_with
            )
        except Exception as exc:  # a broken plugin must not break discovery
            logger.warning("backend %r failed to load: %s", ep.name, exc)
            found[ep.name] = BackendInfo(ep.name, False, f"failed to load: {exc}", "", None)
    return dict(sorted(found.items()))


def _describe(found: dict[str, BackendInfo]) -> str:
    if not found:
        return "no backend is installed (pip install engine-core-mock, or engine-core-cuda)"
    return "installed: " + ", ".join(
        f"{i.name} ({'usable' if i.usable else 'unusable: ' + i.detail})" for i in found.values()
    )


def resolve_backend(name: str, config: EngineConfig | None = None) -> BackendInfo:
    """The usable backend called ``name``; ``"auto"`` picks the usable non-mock backend, else
    the mock. Raises :class:`BackendError` saying what is installed and what to install."""
    found = list_backends(None if name == "auto" else config)
    if name == "auto":
        real = [i for i in found.values() if i.usable and i.name != _MOCK]
        if real:
            return real[0]
        if _MOCK in found and found[_MOCK].usable:
            return found[_MOCK]
        raise BackendError(f"no usable backend for backend='auto'; {_describe(found)}")
    info = found.get(name)
    if info is None:
        raise BackendError(
            f"unknown backend {name!r}; {_describe(found)}. "
            f"A backend named {name!r} would be installed with: pip install engine-core-{name}"
        )
    if not info.usable:
        # Installed and usable otherwise: how to use it is in the detail, not an install.
        hint = f" ({info.install_hint})" if info.install_hint and not info.usable_with else ""
        raise BackendError(f"backend {name!r} is not usable here: {info.detail}{hint}")
    return info


def load_backend(name: str, config: EngineConfig | None = None) -> type[Backend]:
    """Resolve ``name`` (for ``config``) and import its backend class."""
    info = resolve_backend(name, config)
    assert info.provider is not None
    cls = info.provider.load()
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendError(f"backend {info.name!r} loaded {cls!r}, not a Backend subclass")
    return cls
