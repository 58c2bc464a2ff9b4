"""Compile stalls: over a run with varying batch sizes, the Triton kernels see a fixed set of
compiled variants once warmed up.

Triton compiles one variant per distinct signature: the constexpr values, each tensor's dtype
and 16-byte alignment, and each integer argument's type and, unless the kernel marks it
``do_not_specialize``, whether it equals 1 and whether it divides by 16 (pointers marked
``do_not_specialize_on_alignment`` have no alignment in the key). The interpreter
compiles nothing, so the signatures are computed here from each launch's arguments the way
Triton computes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from engine_core_cuda.kernels import (
    activation,
    kv_write,
    paged_attention,
    rms_norm,
    rotary,
    sampling,
)
from tiny_models import TinyModel

from engine_core import SamplingParams

LAUNCHED = [
    (kv_write, "_write_kv_kernel"),
    (paged_attention, "_paged_attention_kernel"),
    (paged_attention, "_merge_segments_kernel"),
    (rms_norm, "_rms_norm_kernel"),
    (rotary, "_rotary_kernel"),
    (activation, "_gated_kernel"),
    (sampling, "_sample_kernel"),
]


def _is_constexpr(kernel: Any, name: str) -> bool:
    return "constexpr" in str(kernel.fn.__annotations__.get(name, ""))


def _int_type(value: int) -> str:
    return "i32" if -(2**31) <= value < 2**31 else ("i64" if value < 2**63 else "u64")


def signature(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], honour: bool) -> tuple:
    """Triton's specialization key of one launch; ``honour=False`` ignores
    ``do_not_specialize`` (what the key would be without the marks)."""
    kept = set(kernel.kwargs.get("do_not_specialize") or ()) if honour else set()
    unaligned = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ()) if honour else set()
    bound = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
    key: list[Any] = []
    for name in kernel.arg_names:
        value = bound.get(name)
        if _is_constexpr(kernel, name) or name in ("num_warps", "num_stages"):
            key.append((name, value))
        elif isinstance(value, torch.Tensor):
            aligned = () if name in unaligned else (value.data_ptr() % 16 == 0,)
            key.append((name, value.dtype, *aligned))
        elif isinstance(value, bool):
            key.append((name, "i1"))
        elif isinstance(value, int):
            special = () if name in kept else (value == 1, value % 16 == 0)
            key.append((name, _int_type(value), *special))
        elif isinstance(value, float):
            key.append((name, "fp32"))
        else:
            key.append((name, type(value).__name__))
    return tuple(key)


class _Recorded:
    def __init__(self, kernel: Any, seen: dict[str, set[tuple]], raw: dict[str, set[tuple]],
                 name: str) -> None:  # fmt: skip
        self.kernel, self.seen, self.raw, self.name = kernel, seen, raw, name

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.seen.setdefault(self.name, set()).add(signature(self.kernel, args, kwargs, True))
            self.raw.setdefault(self.name, set()).add(signature(self.kernel, args, kwargs, False))
            return self.kernel[grid](*args, **kwargs)

        return launch


@contextmanager
def recording(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[dict, dict]]:
    seen: dict[str, set[tuple]] = {}
    raw: dict[str, set[tuple]] = {}
    for module, name in LAUNCHED:
        monkeypatch.setattr(module, name, _Recorded(getattr(module, name), seen, raw, name))
    yield seen, raw


def _snapshot(variants: dict[str, set[tuple]]) -> dict[str, int]:
    return {name: len(keys) for name, keys in variants.items()}


def _run(llm: Any, prompts: list[list[int]], max_tokens: list[int]) -> None:
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8, top_p=0.9, seed=i, max_tokens=n, ignore_eos=True
        )  # fmt: skip
        for i, n in enumerate(max_tokens)
    ]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_compiled_variants_stay_fixed_after_warm_up(
    tiny: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    with (
        recording(monkeypatch) as (seen, raw),
        tiny["llama"].llm(block_size=8, backend_options={"kernels": "triton"}) as llm,
    ):
        # Warm-up: prefill and decode, batches shrinking from 4 to 1 as requests finish.
        _run(llm, [[5] * 3, [6] * 9, [7] * 4, [8] * 12], [2, 3, 4, 5])
        warm, warm_raw = _snapshot(seen), _snapshot(raw)
        # Other batch sizes (up to 7), other prompt lengths (16, one token), other totals.
        _run(llm, [[9] * n for n in (16, 1, 5, 7, 2, 30, 11)], [6, 1, 3, 2, 7, 4, 5])
        _run(llm, [[10] * 32], [3])
        after = _snapshot(seen)
    assert set(warm) == {name for _, name in LAUNCHED if name != "_merge_segments_kernel"}
    assert after == warm
    # Without the marks, the batches' sizes would have compiled new variants mid-serving.
    assert _snapshot(raw)["_write_kv_kernel"] > warm_raw["_write_kv_kernel"]
    assert _snapshot(raw)["_paged_attention_kernel"] > warm_raw["_paged_attention_kernel"]
