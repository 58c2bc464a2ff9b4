"""Backend discovery through the ``engine_core.backends`` entry-point group."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from engine_core import _plugins as _backends
from engine_core._plugins import list_backends, load_backend, resolve_backend, resolve_config
from engine_core.abc import Backend
from engine_core.config import EngineConfig
from engine_core.errors import BackendError


class FakeProvider:
    def __init__(self, name: str, usable: bool, fallback: dict[str, Any] | None = None) -> None:
        self.name = name
        self.install_hint = f"pip install engine-core-{name}"
        self.usable = usable
        if fallback is not None:
            self.fallback_options = fallback

    def is_available(self, config: EngineConfig | None = None) -> tuple[bool, str]:
        asked = config is not None and config.backend_options.get("device") == "cpu"
        if self.usable or (asked and hasattr(self, "fallback_options")):
            return True, "fake device"
        return False, "no fake device here"

    def load(self) -> type[Backend]:
        raise AssertionError("discovery must not load a backend")


class FakeEntryPoint:
    def __init__(self, name: str, target: Any) -> None:
        self.name = name
        self.value = f"fake_{name}:provider"
        self._target = target

    def load(self) -> Any:
        if isinstance(self._target, Exception):
            raise self._target
        return self._target


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> list[FakeEntryPoint]:
    """The entry points discovery sees: the real mock's, plus what a test appends."""
    (mock,) = [
        ep for ep in _backends.entry_points(group=_backends.ENTRY_POINT_GROUP) if ep.name == "mock"
    ]
    points = [FakeEntryPoint("mock", mock.load())]
    monkeypatch.setattr(_backends, "entry_points", lambda group: list(points))
    return points


def test_the_mock_is_installed_and_usable() -> None:
    info = list_backends()["mock"]
    assert (info.name, info.usable, info.detail, info.install_hint) == (
        "mock",
        True,
        "deterministic CPU mock",
        "pip install engine-core-mock",
    )


def test_auto_resolves_to_the_mock_when_nothing_else_is_usable(
    installed: list[FakeEntryPoint],
) -> None:
    installed.append(FakeEntryPoint("cuda", FakeProvider("cuda", usable=False)))
    assert resolve_backend("auto").name == "mock"


def test_auto_prefers_a_usable_real_backend(installed: list[FakeEntryPoint]) -> None:
    installed.append(FakeEntryPoint("cuda", FakeProvider("cuda", usable=True)))
    assert resolve_backend("auto").name == "cuda"


def test_load_backend_returns_the_mock_class() -> None:
    from engine_core_mock import MockBackend

    assert load_backend("mock") is MockBackend


def test_unknown_backend_names_the_installed_ones_and_what_to_install(
    installed: list[FakeEntryPoint],
) -> None:
    with pytest.raises(BackendError) as caught:
        resolve_backend("tpu")
    assert isinstance(caught.value, LookupError)
    assert str(caught.value) == (
        "unknown backend 'tpu': installed: mock (usable); also available: cuda "
        "(pip install engine-core-cuda)"
    )
    installed.append(FakeEntryPoint("cuda", FakeProvider("cuda", usable=False)))
    with pytest.raises(BackendError) as caught:
        resolve_backend("cpu")
    # No made-up package names ("engine-core-cpu" does not exist).
    assert str(caught.value) == (
        "unknown backend 'cpu': installed: cuda (unusable: no fake device here), mock (usable)"
    )


@pytest.mark.parametrize("name", ["Mock", "MOCK", "mokc", "mock "])
def test_a_misspelt_backend_gets_a_suggestion(installed: list[FakeEntryPoint], name: str) -> None:
    with pytest.raises(BackendError, match=r"did you mean 'mock'\?"):
        resolve_backend(name)


# -- auto with a model: never the mock ----------------------------------------------------------


def test_auto_with_a_model_never_picks_the_mock(installed: list[FakeEntryPoint]) -> None:
    installed.append(FakeEntryPoint("cuda", FakeProvider("cuda", usable=False)))
    with pytest.raises(BackendError) as caught:
        resolve_config(EngineConfig(model="/models/llama"))
    message = str(caught.value)
    assert message.startswith("no backend can run the model /models/llama here (installed:")
    assert message.endswith(
        "The mock does not run models: backend='mock' serves counting tokens with the model's "
        "KV geometry and tokenizer"
    )
    installed.pop()
    with pytest.raises(BackendError, match=r"install one: cuda \(pip install engine-core-cuda\)"):
        resolve_config(EngineConfig(model="/models/llama"))
    # Without a model the mock is what "auto" serves.
    assert resolve_config(EngineConfig())[1].backend == "mock"


def test_auto_with_a_model_runs_a_backend_with_the_options_it_needs_and_says_so(
    installed: list[FakeEntryPoint], caplog: pytest.LogCaptureFixture
) -> None:
    installed.append(FakeEntryPoint("cuda", FakeProvider("cuda", False, {"device": "cpu"})))
    config = EngineConfig(model="/models/llama", backend_options={"kernels": "torch"})
    with caplog.at_level("WARNING", logger="engine_core._plugins"):
        info, resolved = resolve_config(config)
    assert info.name == resolved.backend == "cuda"
    assert resolved.backend_options == {"kernels": "torch", "device": "cpu"}
    (record,) = caplog.records
    assert record.getMessage() == (
        "backend 'auto': cuda runs the model /models/llama with {'device': 'cpu'} (no fake "
        "device here; backend_options={'device': 'cpu'} says so explicitly)"
    )
    # A backend usable as asked is used as asked.
    installed[-1] = FakeEntryPoint("cuda", FakeProvider("cuda", True, {"device": "cpu"}))
    assert resolve_config(config)[1].backend_options == {"kernels": "torch"}


def test_unusable_backend_says_why_and_what_to_install(installed: list[FakeEntryPoint]) -> None:
    installed.append(FakeEntryPoint("cuda", FakeProvider("cuda", usable=False)))
    with pytest.raises(
        BackendError,
        match=r"^backend 'cuda' is not usable here: no fake device here "
        r"\(pip install engine-core-cuda\)$",
    ):
        resolve_backend("cuda")


def test_a_broken_plugin_does_not_break_discovery(installed: list[FakeEntryPoint]) -> None:
    installed.append(FakeEntryPoint("broken", ImportError("no module named fake_broken")))
    found = list_backends()
    assert sorted(found) == ["broken", "mock"]
    assert (found["broken"].usable, found["broken"].detail) == (
        False,
        "failed to load: no module named fake_broken",
    )
    assert resolve_backend("auto").name == "mock"


def test_discovery_imports_only_the_mock_provider_and_no_torch() -> None:
    script = (
        "import sys; from engine_core._plugins import list_backends; list_backends(); "
        "print(sorted(m for m in sys.modules if m.startswith(('engine_core_mock', 'torch'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "['engine_core_mock', 'engine_core_mock._provider']"
