"""Fixtures of the CUDA backend's CPU tests: tiny HF checkpoints and engines on the CPU.

Triton must run in interpreter mode on the CPU, which has to be chosen before ``triton`` is
first imported (transformers imports it), hence the environment variable set here at import.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import tiny_models  # noqa: E402
from tiny_models import TinyModel  # noqa: E402


class _Models(dict[str, TinyModel]):
    """Tiny models by kind, each written the first time a test asks for it."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, kind: str) -> TinyModel:
        if kind not in tiny_models.ALL_KINDS:
            raise KeyError(kind)
        model = self[kind] = TinyModel(kind, self.root / kind)
        return model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, TinyModel]]:
    """The tiny models (``tiny_models.ALL_KINDS``), by kind."""
    yield _Models(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """The process's torch thread count as it was before the test (the backend and the CPU
    kernel tests set it)."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
