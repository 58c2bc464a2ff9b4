"""The FP8 KV cache (``kv_cache_dtype="fp8"``) on the CPU: one byte per element (twice the
blocks of a bf16 cache in the same memory), the KV write and paged attention kernels (Triton
interpreted and torch) reading and writing it with per-tensor scales, logits of a tiny model
within cosine 0.99 of the 32-bit cache, a checkpoint's ``k_scale``/``v_scale`` used, and a GPU
without FP8 refused at startup."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_core_cuda import CudaBackend
from engine_core_cuda._fp8 import FP8_DTYPE, resolve_kv_cache_dtype
from test_cuda_fp8 import _cosines, _last_logits, _prompts
from tiny_models import TinyModel

from engine_core.config import EngineConfig


def _backend(model: TinyModel, kernels: str = "torch", **fields: object) -> CudaBackend:
    config = EngineConfig(model=str(model.path), backend="cuda", max_model_len=128,
                          backend_options={"device": "cpu", "kernels": kernels}, **fields)  # type: ignore[arg-type]  # fmt: skip
    return CudaBackend(config)


def _logits(backend: CudaBackend, prompts: list[list[int]]) -> torch.Tensor:
    try:
        backend.initialize_kv_cache(32)
        return _last_logits(backend, prompts)
    finally:
        backend.close()


def test_fp8_cache_doubles_the_blocks_of_a_bf16_one(tiny: dict[str, TinyModel]) -> None:
    model = tiny["llama"]
    sizes = {}
    for kv in ("auto", "fp8"):
        backend = _backend(model, dtype="bfloat16", kv_cache_dtype=kv)
        try:
            spec = backend.kv_cache_spec()
            sizes[kv] = (spec.dtype_bytes, (64 << 20) // spec.bytes_per_block(16))
            if kv == "fp8":
                backend.initialize_kv_cache(4)
                assert backend.runner.kv_caches[0][0].dtype == FP8_DTYPE
        finally:
            backend.close()
    assert sizes["auto"][0] == 2 and sizes["fp8"][0] == 1
    assert sizes["fp8"][1] == 2 * sizes["auto"][1]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_fp8_cache_logits_within_cosine_099(tiny: dict[str, TinyModel], kernels: str) -> None:
    model = tiny["qwen3"]
    prompts = _prompts(model)[:3]
    full = _logits(_backend(model, kernels), prompts)
    fp8 = _logits(_backend(model, kernels, kv_cache_dtype="fp8"), prompts)
    cosines = _cosines(full, fp8)
    assert min(cosines) >= 0.99, cosines
    assert not torch.equal(full, fp8)


def test_kernels_write_and_read_an_fp8_cache_with_scales() -> None:
    from engine_core_cuda.kernels.kv_write import write_kv
    from engine_core_cuda.kernels.paged_attention import paged_attention
    from engine_core_cuda.kernels.reference import paged_attention_reference
    from engine_core_cuda.kernels.torch_ops import write_kv_torch

    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, head, blocks, block = 12, 4, 2, 16, 4, 8
    key = 3.0 * torch.randn(tokens, kv_heads, head, generator=gen)
    value = torch.randn(tokens, kv_heads, head, generator=gen)
    key[0, 0, 0] = 5000.0  # beyond e4m3's range even after the scale: saturated, not NaN
    slots = torch.arange(tokens)
    caches = []
    for writer in (write_kv, write_kv_torch):
        k_cache = torch.zeros(blocks, block, kv_heads, head, dtype=FP8_DTYPE)
        v_cache = torch.zeros_like(k_cache)
        writer(key, value, k_cache, v_cache, slots, 2.0, 0.5)
        caches.append((k_cache, v_cache))
    for a, b in zip(caches[0], caches[1], strict=True):
        assert torch.equal(a.float(), b.float())
    k_cache, v_cache = caches[0]
    assert float(k_cache.view(-1, kv_heads, head)[0, 0, 0]) == 448.0
    expected = (key / 2.0).clamp(-448, 448).to(FP8_DTYPE).float()
    assert torch.equal(k_cache.view(-1, kv_heads, head)[:tokens].float(), expected)
    # Attention over the FP8 cache with the scales folded in = attention over its dequantised
    # values.
    q = torch.randn(tokens, heads, head, generator=gen)
    args = (torch.zeros(1, blocks, dtype=torch.int32).copy_(torch.arange(blocks)),
            torch.zeros(1, dtype=torch.int32), torch.tensor([0, tokens], dtype=torch.int32),
            torch.tensor([tokens], dtype=torch.int32))  # fmt: skip
    scale = head**-0.5
    got = paged_attention(q, k_cache, v_cache, *args, scale=scale * 2.0, max_query_len=tokens)
    got = got * 0.5
    expected = paged_attention_reference(q, k_cache.float() * 2.0, v_cache.float() * 0.5, *args,
                                         scale=scale)  # fmt: skip
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_checkpoint_kv_scales_are_used(tiny: dict[str, TinyModel], tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    model = tiny["llama"]
    target = tmp_path / "scaled"
    shutil.copytree(model.path, target)
    path = target / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor([0.125])
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = EngineConfig(model=str(target), backend="cuda", max_model_len=128,
                          kv_cache_dtype="fp8", backend_options={"device": "cpu"})  # fmt: skip
    backend = CudaBackend(config)
    try:
        layers = backend.runner.model.model.layers
        assert layers[0].self_attn.kv_scales == (0.25, 1.0)
        assert layers[1].self_attn.kv_scales == (1.0, 0.125)
        backend.initialize_kv_cache(32)
        prompts = _prompts(model)[:2]
        scaled = _last_logits(backend, prompts)
    finally:
        backend.close()
    full = _logits(_backend(model), prompts)
    assert min(_cosines(full, scaled)) >= 0.99


def test_gpu_without_fp8_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_core_cuda import _fp8

    monkeypatch.setattr(_fp8, "_capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs a GPU with FP8") as info:
        resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda:0"))
    assert "NVIDIA A100" in str(info.value) and "8.0" in str(info.value)
    assert "'auto'" in str(info.value)
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, torch.device("cuda:0")) is torch.bfloat16
    monkeypatch.setattr(_fp8, "_capability", lambda index: (9, 0))
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, torch.device("cuda:0")) is FP8_DTYPE


def test_per_layer_specs_of_a_windowed_model_are_one_byte(tiny: dict[str, TinyModel]) -> None:
    """Gemma 2's window and full layers (KV-cache groups): every layer's spec has FP8's one-byte
    elements."""
    backend = _backend(tiny["gemma2"], kv_cache_dtype="fp8")
    try:
        specs = backend.kv_cache_spec()
        assert isinstance(specs, list) and len(specs) == 3
        assert {type(s).__name__ for s in specs} == {"SlidingWindowSpec", "FullAttentionSpec"}
        assert all(s.dtype_bytes == 1 for s in specs)
    finally:
        backend.close()
