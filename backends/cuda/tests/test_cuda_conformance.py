"""The conformance suite of ``engine_core.testing`` against the CUDA backend on the CPU, with the
torch attention references and with the Triton kernels (interpreted)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from engine_core_cuda import CudaBackend
from tiny_models import TinyModel

from engine_core.config import EngineConfig
from engine_core.testing import BACKEND_CHECKS, BackendFactory


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("check", BACKEND_CHECKS, ids=lambda c: c.__name__)
def test_conformance(
    tiny: dict[str, TinyModel],
    check: Callable[[BackendFactory, EngineConfig | None], None],
    kernels: str,
) -> None:
    config = EngineConfig(
        model=str(tiny["llama"].path),
        backend="cuda",
        backend_options={"device": "cpu", "kernels": kernels},
        max_model_len=256,
    )
    check(CudaBackend, config)
