"""The fused sampling kernel (interpreted on the CPU) against the torch sampler: the same
tokens for the same seeds, every stage, in few operations."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_core_cuda._sampler import SamplingBatch, sample
from engine_core_cuda.kernels import sampling

ROWS, VOCAB = 24, 700  # the vocabulary spans a kernel block and part of another


def _batch(seed: int, **stages: bool) -> tuple[torch.Tensor, SamplingBatch]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, VOCAB, generator=gen) * 3
    logits[0, :] = 1.0  # a row of ties
    logits[1, 100:] = float("-inf")  # a masked row (grammar, stop tokens)
    ints = torch.randint(-(2**62), 2**62, (ROWS, 3), generator=gen)  # seeds in a strided column
    batch = SamplingBatch(
        seeds=ints[:, 1],
        positions=torch.randint(0, 5000, (ROWS,), generator=gen),
        all_greedy=False,
        greedy=torch.rand(ROWS, generator=gen) < 0.2,
    )
    if stages.get("temperature"):
        batch.temperature = torch.rand(ROWS, generator=gen) * 1.5 + 0.1
    if stages.get("min_p"):
        batch.min_p = torch.rand(ROWS, generator=gen) * 0.2
    if stages.get("top_k"):
        top_k = torch.randint(1, 50, (ROWS,), generator=gen)
        top_k[::3] = VOCAB  # off
        batch.top_k = top_k
    if stages.get("top_p"):
        top_p = torch.rand(ROWS, generator=gen) * 0.9 + 0.05
        top_p[::4] = 1.0  # off
        batch.top_p = top_p
    return logits, batch


STAGES = [
    {},
    {"temperature": True},
    {"top_p": True},
    {"top_k": True},
    {"min_p": True, "temperature": True},
    {"temperature": True, "top_k": True, "top_p": True},
    {"temperature": True, "min_p": True, "top_k": True, "top_p": True},
]


@pytest.mark.parametrize("stages", STAGES, ids=lambda s: "+".join(s) or "plain")
def test_the_kernel_samples_the_tokens_of_the_torch_sampler(stages: dict[str, bool]) -> None:
    for seed in range(2):
        logits, batch = _batch(seed, **stages)
        expected = sample(logits, batch, "torch")
        assert sample(logits, batch, "triton").tolist() == expected.tolist()


def test_a_row_alone_draws_what_it_draws_in_a_batch() -> None:
    logits, batch = _batch(5, temperature=True, top_p=True)
    together = sample(logits, batch, "triton")
    for row in (2, 7, 19):
        alone = SamplingBatch(
            seeds=batch.seeds[row : row + 1],
            positions=batch.positions[row : row + 1],
            all_greedy=False,
            greedy=batch.greedy[row : row + 1] if batch.greedy is not None else None,
            temperature=batch.temperature[row : row + 1] if batch.temperature is not None else None,
            top_p=batch.top_p[row : row + 1] if batch.top_p is not None else None,
        )
        assert sample(logits[row : row + 1], alone, "triton").item() == together[row].item()


class _LabelledLaunches:
    """A Triton kernel whose launches show in the profiler as one ``triton launch`` event (the
    interpreter's host copies inside it are not kernels of their own on a GPU)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function("triton launch"):
                return self.kernel[grid](*args, **kwargs)

        return launch


def _kernels_of(run: Any) -> list[str]:
    """Torch operations launched at top level, and Triton launches, while ``run()`` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    return [e.name for e in prof.events() if e.cpu_parent is None and
            (e.name.startswith("aten::") or e.name == "triton launch")]  # fmt: skip


@pytest.mark.parametrize("greedy_rows", [False, True])
def test_temperature_one_and_top_p_take_a_few_kernels(
    monkeypatch: pytest.MonkeyPatch, greedy_rows: bool
) -> None:
    # The default of chat clients: one fused kernel, nothing of [rows, vocab] written.
    monkeypatch.setattr(sampling, "_sample_kernel", _LabelledLaunches(sampling._sample_kernel))
    logits, batch = _batch(1, top_p=True)
    batch.top_p = torch.full((ROWS,), 0.9)
    if not greedy_rows:
        batch.greedy = torch.zeros(ROWS, dtype=torch.bool)
    sample(logits, batch, "triton")  # warm-up
    kernels = _kernels_of(lambda: sample(logits, batch, "triton"))
    assert kernels.count("triton launch") == 1
    assert len(kernels) <= 8, kernels
    reference = _kernels_of(lambda: sample(logits, batch, "torch"))
    assert len(reference) > 40  # what the fused kernel replaces
