"""Finding backends through the ``engine_core.backends`` entry-point group."""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import msgspec

from engine_core.abc import Backend, BackendProvider
from engine_core.config import COMMAND_LINE_ENV, EngineConfig, backend_options_hint
from engine_core.errors import BackendError

__all__ = [
    "BackendInfo",
    "ENTRY_POINT_GROUP",
    "KNOWN_BACKENDS",
    "list_backends",
    "load_backend",
    "resolve_backend",
    "resolve_config",
]

ENTRY_POINT_GROUP = "engine_core.backends"
_MOCK = "mock"
KNOWN_BACKENDS = {"mock": "pip install engine-core-mock", "cuda": "pip install engine-core-cuda"}
"""The backends this project ships, by name, and how each is installed (named in errors when
they are not installed)."""
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
    return "installed: " + ", ".join(f"{i.name} ({_state(i)})" for i in found.values())


def _state(info: BackendInfo) -> str:
    if info.usable:
        return "usable"
    if info.usable_with:
        return f"usable with {backend_options_hint(info.usable_with)}"
    return "unusable: " + info.detail


def _closest(name: str, found: dict[str, BackendInfo]) -> str | None:
    """The installed backend ``name`` was probably meant to be (case and close spellings)."""
    lowered = {n.lower(): n for n in found}
    if name.lower() in lowered:
        return lowered[name.lower()]
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[close[0]] if close else None


def _unknown(name: str, found: dict[str, BackendInfo]) -> BackendError:
    closest = _closest(name, found)
    guess = f"did you mean {closest!r}? " if closest is not None else ""
    known = [f"{n} ({hint})" for n, hint in KNOWN_BACKENDS.items() if n not in found]
    more = f"; also available: {', '.join(known)}" if known else ""
    return BackendError(f"unknown backend {name!r}: {guess}{_describe(found)}{more}")


def _auto_for_model(config: EngineConfig, found: dict[str, BackendInfo]) -> BackendInfo:
    """What ``"auto"`` picks for a model: a backend that runs it, never the mock (it would
    answer in the model's name with counting tokens)."""
    real = [i for i in found.values() if i.name != _MOCK]
    for info in real:
        if info.usable:
            return info
    for info in real:
        if info.usable_with:
            logger.warning(
                "backend 'auto': %s runs the model %s with %s (%s; %s says so explicitly)",
                info.name,
                config.model,
                info.usable_with,
                info.detail.split(";")[0],
                backend_options_hint(info.usable_with),
            )
            return info
    missing = [f"{n} ({hint})" for n, hint in KNOWN_BACKENDS.items() if n not in found]
    install = f"; install one: {', '.join(missing)}" if missing else ""
    raise BackendError(
        f"no backend can run the model {config.model} here ({_describe(found)}){install}. The "
        f"mock does not run models: {_flag('backend', _MOCK)} serves counting tokens with the "
        "model's KV geometry and tokenizer"
    )


def _flag(name: str, value: str) -> str:
    if os.environ.get(COMMAND_LINE_ENV) == "1":
        return f"--{name.replace('_', '-')} {value}"
    return f"{name}={value!r}"


def resolve_backend(name: str, config: EngineConfig | None = None) -> BackendInfo:
    """The usable backend called ``name``. ``"auto"`` with a model picks a backend that runs it
    (usable as asked, else with its ``usable_with`` options, which the engine then applies, and
    says so in one warning), never the mock; ``"auto"`` without a model picks the usable
    non-mock backend, else the mock. Raises :class:`BackendError` saying what is installed and
    what to install."""
    for_model = config is not None and config.model is not None
    found = list_backends(config if name != "auto" or for_model else None)
    if name == "auto":
        if config is not None and config.model is not None:
            return _auto_for_model(config, found)
        real = [i for i in found.values() if i.usable and i.name != _MOCK]
        if real:
            return real[0]
        if _MOCK in found and found[_MOCK].usable:
            return found[_MOCK]
        raise BackendError(f"no usable backend for backend='auto'; {_describe(found)}")
    info = found.get(name)
    if info is None:
        raise _unknown(name, found)
    if not info.usable:
        # Installed and usable otherwise: how to use it is in the detail, not an install.
        hint = f" ({info.install_hint})" if info.install_hint and not info.usable_with else ""
        raise BackendError(f"backend {name!r} is not usable here: {info.detail}{hint}")
    return info


def resolve_config(config: EngineConfig) -> tuple[BackendInfo, EngineConfig]:
    """The backend ``config`` asks for and the config to run it with: ``"auto"`` replaced by
    the backend's name, and the options it needs here added (``auto`` with a model and no GPU:
    the CUDA backend's ``{"device": "cpu"}``)."""
    info = resolve_backend(config.backend, config)
    options = config.backend_options
    if config.backend == "auto" and info.usable_with and not info.usable:
        options = {**options, **info.usable_with}
    return info, msgspec.structs.replace(config, backend=info.name, backend_options=options)


def load_backend(name: str, config: EngineConfig | None = None) -> type[Backend]:
    """Resolve ``name`` (for ``config``) and import its backend class."""
    info = resolve_backend(name, config)
    assert info.provider is not None
    cls = info.provider.load()
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendError(f"backend {info.name!r} loaded {cls!r}, not a Backend subclass")
    return cls
