"""The event loop the engine-core process (and a front end) runs on."""

from __future__ import annotations

import importlib.util

import pytest

from engine_core._engine.runtime import NO_UVLOOP_ENV, run_options

HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None


@pytest.mark.skipif(not HAS_UVLOOP, reason="uvloop is not installed")
def test_asyncio_runs_on_uvloop_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NO_UVLOOP_ENV, raising=False)
    assert run_options("asyncio") == {"backend": "asyncio", "backend_options": {"use_uvloop": True}}


def test_no_uvloop_env_keeps_asyncio_on_its_own_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NO_UVLOOP_ENV, "1")
    assert run_options("asyncio") == {"backend": "asyncio"}


def test_trio_runs_as_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NO_UVLOOP_ENV, raising=False)
    assert run_options("trio") == {"backend": "trio"}
