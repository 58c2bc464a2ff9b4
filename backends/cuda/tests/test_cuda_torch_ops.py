"""The torch kernels' KV write, rotary embedding and norms: bit-equal to the references (the
CPU's C kernels of ``cpu_ops`` off; with them, float32 norms to the rounding of their sums)."""

from __future__ import annotations

import pytest
import torch
from engine_core_cuda._hf_config import RopeConfig
from engine_core_cuda._rope import RotaryTables
from engine_core_cuda.kernels import cpu_ops
from engine_core_cuda.kernels.reference import (
    add_rms_norm_reference,
    rms_norm_reference,
    rotary_embedding_reference,
    write_kv_reference,
)
from engine_core_cuda.kernels.torch_ops import (
    add_rms_norm_torch,
    rms_norm_torch,
    rotary_embedding_torch,
    write_kv_torch,
)


@pytest.mark.parametrize("padding", [False, True])
def test_write_kv_equals_the_reference(padding: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(20, 2, 8, generator=gen) for _ in range(2))
    slots = torch.randperm(6 * 4, generator=gen)[:20]
    if padding:
        slots[::3] = -1
    caches = [torch.zeros(6, 4, 2, 8) for _ in range(4)]
    write_kv_torch(key, value, caches[0], caches[1], slots)
    write_kv_reference(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("fused", [True, False])
def test_rotary_embedding_equals_the_reference(fused: bool, native: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, size, tokens = 4, 2, 16, 11
    tables = RotaryTables(RopeConfig(10000.0, "default"), size, 64, torch.float32,
                          torch.device("cpu"))  # fmt: skip
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * size, generator=gen)
    expected = qkv.clone()
    views = []
    for target in (qkv, expected):
        q, k, _ = target.split([heads * size, kv_heads * size, kv_heads * size], dim=-1)
        views.append((q.view(tokens, heads, size), k.view(tokens, kv_heads, size)))
    (q, k), (q_ref, k_ref) = views
    if not fused:  # separate tensors: the per-tensor path
        q, k = q.clone(), k.clone()
    rotary_embedding_torch(positions, q, k, tables.cos, tables.sin)
    rotary_embedding_reference(positions, q_ref, k_ref, tables.cos, tables.sin)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    if fused:
        assert torch.equal(qkv, expected)  # the value heads untouched


@pytest.fixture(params=[False, True], ids=["torch", "cpu_ops"])
def native(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether the CPU's C kernels (``cpu_ops``) take the float32 norms and rotations."""
    if not request.param:
        monkeypatch.setattr(cpu_ops, "_resolved", True)
        monkeypatch.setattr(cpu_ops, "_functions", None)
    elif not cpu_ops.available():
        pytest.skip("no C compiler")
    return bool(request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_norms_equal_the_reference(dtype: torch.dtype, rows: int, native: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 96, generator=gen).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)

    def same(a: torch.Tensor, b: torch.Tensor) -> None:
        if native and dtype == torch.float32:  # the C kernel sums the squares in its own order
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(a, b)

    same(rms_norm_torch(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))
    r1, r2 = residual.clone(), residual.clone()
    got = add_rms_norm_torch(x, r1, weight, 1e-5)
    same(got, add_rms_norm_reference(x, r2, weight, 1e-5))
    assert torch.equal(r1, r2)
