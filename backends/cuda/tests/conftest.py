"""Fixtures of the CUDA backend's CPU tests: tiny HF checkpoints and engines on the CPU.

Triton must run in interpreter mode on the CPU, which has to be chosen before ``triton`` is
first imported (transformers imports it), hence the environment variable set here at import.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
import tiny_models  # noqa: E402
from tiny_models import TinyModel  # noqa: E402


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, TinyModel]]:
    """The three tiny models, by kind."""
    root = tmp_path_factory.mktemp("tiny-models")
    yield {kind: TinyModel(kind, root / kind) for kind in tiny_models.KINDS}
