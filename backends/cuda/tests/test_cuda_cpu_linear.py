"""CPU linear layers run on weights reordered once for oneDNN: the products match ``F.linear``
(to float32 rounding), for any row count, with and without bias and row parallelism; only
weights large enough are packed, and a packed float32 weight serves only the row counts where
it is faster; the switch ``ENGINE_CORE_CPU_LINEAR=torch`` keeps ``F.linear``; the runner packs
after loading."""

from __future__ import annotations

import engine_core_cuda._layers as layers
import pytest
import torch
import torch.nn.functional as F
from engine_core_cuda._layers import (
    PACK_MIN_ELEMENTS,
    PACKED_ROWS,
    Linear,
    cpu_bf16_packing,
    pack_cpu_linears,
)

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


def _linear(bias: bool, dtype: torch.dtype = torch.float32, reduce=None) -> Linear:
    torch.manual_seed(0)
    layer = Linear(96, {"a": 40, "b": 24}, bias=bias, dtype=dtype, device=torch.device("cpu"),
                   reduce=reduce)  # fmt: skip
    with torch.no_grad():
        layer.weight.normal_()
        if layer.bias is not None:
            layer.bias.normal_()
    return layer


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 16, 70])
def test_packed_matches_f_linear(bias: bool, rows: int) -> None:
    layer = _linear(bias)
    x = torch.randn(rows, 96)
    expected = F.linear(x, layer.weight, layer.bias)
    assert pack_cpu_linears([layer], 16, min_elements=0) == 1
    assert layer.packed is not None
    got = layer(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    strided = torch.randn(rows, 192)[:, :96]  # a split's view
    torch.testing.assert_close(layer(strided), F.linear(strided, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-4)  # fmt: skip


def test_packed_row_parallel_adds_bias_once() -> None:
    calls: list[torch.Tensor] = []

    def reduce(y: torch.Tensor) -> torch.Tensor:
        calls.append(y)
        return y * 2  # two identical ranks

    layer = _linear(True, reduce=reduce)
    x = torch.randn(3, 96)
    pack_cpu_linears([layer], 4, min_elements=0)
    torch.testing.assert_close(layer(x), 2 * F.linear(x, layer.weight) + layer.bias,
                               rtol=1e-5, atol=1e-4)  # fmt: skip
    assert len(calls) == 1


def test_bfloat16_packs_and_switch_off(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _linear(False, torch.bfloat16)
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    assert pack_cpu_linears([layer], 4, min_elements=0) == int(cpu_bf16_packing())
    torch.testing.assert_close(layer(x).float(), F.linear(x, layer.weight).float(),
                               rtol=2e-2, atol=2e-2)  # fmt: skip
    monkeypatch.setenv("ENGINE_CORE_CPU_LINEAR", "torch")
    other = _linear(False)
    assert pack_cpu_linears([other], 4, min_elements=0) == 0
    assert other.packed is None


def test_bfloat16_stays_unpacked_without_a_bf16_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2-only CPU has no oneDNN bfloat16 reorder: its bf16 weights stay on F.linear
    (packing them would raise) while float32 weights are still packed."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert not cpu_bf16_packing()
    half, full = _linear(False, torch.bfloat16), _linear(False)
    assert pack_cpu_linears([half, full], 4, min_elements=0) == 1
    assert half.packed is None and full.packed is not None
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    torch.testing.assert_close(half(x), F.linear(x, half.weight))


def test_small_weights_stay_unpacked_and_packed_ones_serve_only_their_rows() -> None:
    small = _linear(False)
    assert small.weight.numel() < PACK_MIN_ELEMENTS
    assert pack_cpu_linears([small], 16) == 0 and small.packed is None
    # A packed copy of zeros shows which path a row count takes: zeros from the packed one.
    layer = _linear(False)
    layer.packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros_like(layer.weight), 16)
    low, high = PACKED_ROWS
    for rows in (1, low, high, high + 1):
        x = torch.randn(rows, 96)
        packed = bool(torch.all(layer(x) == 0))
        assert packed == (low <= rows <= high), rows
        if not packed:
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


def test_runner_packs_after_loading_and_close_drops(tiny, monkeypatch) -> None:
    llm = tiny["llama"].llm()
    try:
        runner = llm._client.engine_core.backend.runner
        linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
        assert linears and all(m.packed is None for m in linears)  # all smaller than the floor
    finally:
        llm.close()
    monkeypatch.setattr(layers, "PACK_MIN_ELEMENTS", 0)
    llm = tiny["llama"].llm()
    try:
        runner = llm._client.engine_core.backend.runner
        linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
        assert linears and all(m.packed is not None for m in linears)
    finally:
        llm.close()
    assert all(m.packed is None for m in linears)
