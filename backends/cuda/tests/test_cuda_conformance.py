"""The conformance suite of ``engine_core.testing`` against the CUDA backend on the CPU, with the
torch attention references and with the Triton kernels (interpreted)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from engine_core_cuda import CudaBackend
from tiny_models import TinyModel

from engine_core.config import EngineConfig
from engine_core.testing import BACKEND_CHECKS, BackendFactory, check_kv_groups, check_spec_decode

# NOTE: check_spec_decode interprets the Triton kernels for over a minute on the CPU; the Triton
# path of verification has its own small case in test_cuda_spec_decode.py.
CASES = [
    pytest.param(check, kernels, id=f"{check.__name__}-{kernels}")
    for kernels in ("torch", "triton")
    for check in BACKEND_CHECKS
    if (kernels == "torch" or check is not check_spec_decode) and check is not check_kv_groups
]


# The Triton cases run interpreted: a minute each on a loaded two-core machine.
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("check", "kernels"), CASES)
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


def test_kv_groups_of_a_windowed_model(tiny: dict[str, TinyModel]) -> None:
    """Gemma 3's window layers in KV-cache groups of their own (the Llama above has none)."""
    config = EngineConfig(
        model=str(tiny["gemma3"].path),
        backend="cuda",
        backend_options={"device": "cpu", "kernels": "torch"},
        max_model_len=256,
        num_kv_blocks=128,
    )
    check_kv_groups(CudaBackend, config)
