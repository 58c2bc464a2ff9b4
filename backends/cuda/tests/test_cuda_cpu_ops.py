"""The CPU's C kernels for RMS norm (with the fused residual add) and the rotary embedding,
against the references; what they do not take goes to the torch path, and the torch ops the
CPU runs (``kernels.torch_ops``) call them."""

from __future__ import annotations

import pytest
import torch
from engine_core_cuda.kernels import cpu_native, cpu_ops, torch_ops
from engine_core_cuda.kernels.reference import (
    add_rms_norm_reference,
    rms_norm_reference,
    rotary_embedding_reference,
)

pytestmark = [
    pytest.mark.skipif(cpu_native.compiler() is None, reason="no C compiler"),
    pytest.mark.usefixtures("torch_threads"),
]


def test_it_builds_here() -> None:
    assert cpu_ops.available()


@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (3, 4, 32)])
def test_rms_norm_matches_the_reference(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x, weight = torch.randn(shape) * 3, torch.randn(shape[-1])
    got = cpu_ops.rms_norm(x, weight, 1e-6)
    assert got is not None and got.shape == x.shape
    torch.testing.assert_close(got, rms_norm_reference(x, weight, 1e-6), rtol=1e-6, atol=1e-6)


def test_add_rms_norm_writes_the_sum_back() -> None:
    torch.manual_seed(1)
    x, residual, weight = torch.randn(5, 48), torch.randn(5, 48), torch.randn(48)
    expected_residual = residual.clone()
    expected = add_rms_norm_reference(x, expected_residual, weight, 1e-5)
    got = cpu_ops.rms_norm(x, weight, 1e-5, residual=residual)
    assert got is not None
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_rms_norm_declines_what_it_does_not_take() -> None:
    weight = torch.randn(64)
    assert cpu_ops.rms_norm(torch.randn(2, 64, dtype=torch.bfloat16), weight, 1e-6) is None
    assert cpu_ops.rms_norm(torch.randn(2, 128)[:, :64], weight, 1e-6) is None  # strided rows
    assert cpu_ops.rms_norm(torch.randn(2, 32), weight, 1e-6) is None  # weight of another size
    residual = torch.randn(2, 128)[:, :64]
    assert cpu_ops.rms_norm(torch.randn(2, 64), weight, 1e-6, residual=residual) is None
    # Large inputs with several torch threads keep the multi-threaded torch path.
    torch.set_num_threads(2)
    big = torch.randn(cpu_ops.SINGLE_THREAD_ELEMENTS // 64 + 1, 64)
    assert cpu_ops.rms_norm(big, weight, 1e-6) is None
    torch.set_num_threads(1)
    assert cpu_ops.rms_norm(big, weight, 1e-6) is not None


def _qk(tokens: int, heads: int, kv_heads: int, head_size: int) -> tuple[torch.Tensor, ...]:
    """q and k as the views of one fused QKV projection's output, as the model makes them."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size)
    q = qkv[:, : heads * head_size].view(tokens, heads, head_size)
    k = qkv[:, heads * head_size : (heads + kv_heads) * head_size].view(tokens, kv_heads, head_size)
    return q, k


@pytest.mark.parametrize("heads,kv_heads,head_size", [(2, 1, 32), (8, 4, 64), (4, 4, 16)])
def test_rotary_matches_the_reference(heads: int, kv_heads: int, head_size: int) -> None:
    torch.manual_seed(2)
    q, k = _qk(6, heads, kv_heads, head_size)
    cos, sin = torch.randn(50, head_size), torch.randn(50, head_size)
    positions = torch.tensor([0, 49, 3, 3, 17, 8])
    eq, ek = q.clone(), k.clone()
    rotary_embedding_reference(positions, eq, ek, cos, sin)
    assert cpu_ops.rotary(positions, q, k, cos, sin)
    assert torch.equal(q, eq) and torch.equal(k, ek)  # no fused multiply-adds: bit for bit


def test_rotary_refuses_a_position_outside_the_tables() -> None:
    q, k = _qk(2, 2, 1, 16)
    cos = sin = torch.randn(10, 16)
    with pytest.raises(IndexError, match="outside the tables"):
        cpu_ops.rotary(torch.tensor([1, 10]), q, k, cos, sin)


def test_rotary_declines_what_it_does_not_take() -> None:
    q, k = _qk(2, 2, 1, 16)
    cos = sin = torch.randn(10, 16)
    positions = torch.tensor([1, 2])
    assert not cpu_ops.rotary(positions, q.to(torch.bfloat16), k.to(torch.bfloat16), cos, sin)
    assert not cpu_ops.rotary(positions, q, k, cos[:, :8], sin[:, :8])  # tables too narrow
    strided = torch.randn(2, 2, 32)[..., ::2]  # last dimension not contiguous
    assert not cpu_ops.rotary(positions, strided, k, cos, sin)


def test_the_cpus_torch_ops_call_them(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    norm, rotary = cpu_ops.rms_norm, cpu_ops.rotary

    def counted_norm(*args, **kwargs):
        calls.append("residual" if kwargs.get("residual") is not None else "norm")
        return norm(*args, **kwargs)

    def counted_rotary(*args):
        calls.append("rotary")
        return rotary(*args)

    monkeypatch.setattr(cpu_ops, "rms_norm", counted_norm)
    monkeypatch.setattr(cpu_ops, "rotary", counted_rotary)
    x, residual, weight = torch.randn(3, 32), torch.randn(3, 32), torch.randn(32)
    torch.testing.assert_close(torch_ops.rms_norm_torch(x, weight, 1e-6),
                               rms_norm_reference(x, weight, 1e-6))  # fmt: skip
    expected_residual = residual.clone()
    expected = add_rms_norm_reference(x, expected_residual, weight, 1e-6)
    torch.testing.assert_close(torch_ops.add_rms_norm_torch(x, residual, weight, 1e-6), expected)
    torch.testing.assert_close(residual, expected_residual)
    q, k = _qk(2, 2, 1, 16)
    cos, sin = torch.randn(10, 16), torch.randn(10, 16)
    eq, ek = q.clone(), k.clone()
    rotary_embedding_reference(torch.tensor([4, 9]), eq, ek, cos, sin)
    torch_ops.rotary_embedding_torch(torch.tensor([4, 9]), q, k, cos, sin)
    torch.testing.assert_close((q, k), (eq, ek))
    assert calls == ["norm", "residual", "rotary"]


def test_switched_off_the_torch_path_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_ops.DISABLE_ENV, "torch")
    monkeypatch.setattr(cpu_ops, "_resolved", False)
    monkeypatch.setattr(cpu_ops, "_functions", None)
    assert not cpu_ops.available()
    x, weight = torch.randn(2, 16), torch.randn(16)
    assert cpu_ops.rms_norm(x, weight, 1e-6) is None
    torch.testing.assert_close(torch_ops.rms_norm_torch(x, weight, 1e-6),
                               rms_norm_reference(x, weight, 1e-6))  # fmt: skip
