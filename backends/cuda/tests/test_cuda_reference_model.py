"""The dense reference model (ground truth of ``bench/gpu_check.py`` where transformers is not
installed) against transformers."""

from __future__ import annotations

import pytest
import torch
from engine_core_cuda import CudaBackend
from engine_core_cuda._loader import checkpoint_tensors
from engine_core_cuda.reference_model import reference_greedy, reference_logits
from hf_reference import greedy
from tiny_models import TinyModel

from engine_core.config import EngineConfig


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"])
def test_reference_model_equals_transformers(tiny: dict[str, TinyModel], kind: str) -> None:
    model = tiny[kind]
    config = EngineConfig(model=str(model.path), backend="cuda", backend_options={"device": "cpu"})
    backend = CudaBackend(config)
    try:
        weights = checkpoint_tensors(backend.runner.model)
        # Longer than the windowed models' window (8).
        prompt = [5, 99, 17, 250, 3, 3, 42, 8, 71, 160, 33, 2, 201, 9]
        logits = reference_logits(weights, backend.model_config, prompt)
        with torch.no_grad():
            expected = model.hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        got = reference_greedy(weights, backend.model_config, prompt, 8)
    finally:
        backend.close()
    assert got == greedy(model.hf, prompt, 8)
