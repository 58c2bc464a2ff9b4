"""Multi-LoRA in the CUDA backend on the CPU: a batch mixing four PEFT adapters and the base
model gives the greedy tokens of transformers with each adapter merged in (``peft``'s
``merge_and_unload``) and their logprobs, through chunked prefill, prefix-cache hits,
preemption and adapters loaded and removed mid-run; the device slots' LRU; the errors that
name a bad adapter; the Triton shrink/expand kernels against the torch reference."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_core_cuda import CudaBackend
from engine_core_cuda._hf_config import load_model_config
from engine_core_cuda._lora import read_adapter
from hf_reference import greedy, log_softmax
from lora_adapters import ADAPTERS, Adapter, build_adapter
from tiny_models import VOCAB_SIZE, TinyModel

from engine_core import LoRAError, LoRARequest
from engine_core._core.request import Request
from engine_core.abc import CachedRequestData, NewRequestData, SchedulerOutput
from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams
from engine_core.testing.harness import Harness

NAMES = list(ADAPTERS)
"""Adapter ``NAMES[i]`` is loaded under id ``i + 1``."""


@pytest.fixture(scope="module")
def adapters(
    tiny: dict[str, TinyModel], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[Adapter]]:
    """The four adapters of each of the tiny Llama and Qwen2."""
    root = tmp_path_factory.mktemp("lora")
    return {
        kind: [
            build_adapter(tiny[kind].hf, name, root / kind / name, seed=i + 10)
            for i, name in enumerate(NAMES)
        ]
        for kind in ("llama", "qwen2")
    }


def _prompt(seed: int, length: int) -> list[int]:
    return [2 + (seed * 53 + i * 29 + i * i * 7) % (VOCAB_SIZE - 2) for i in range(length)]


class LoRAHarness(Harness):
    """The real scheduler driving the backend; each request's adapter id is set on its new
    request data (a resumed one too), and prefix-cache hits stay within one adapter."""

    def __init__(self, backend: CudaBackend, config: EngineConfig, num_blocks: int) -> None:
        super().__init__(backend, config, num_blocks)
        self.lora_of: dict[str, int] = {}
        self.steps: list[SchedulerOutput] = []
        execute = backend.execute_model

        def execute_model(scheduler_output: SchedulerOutput) -> None:
            for new in scheduler_output.new_reqs:
                new.lora_int_id = self.lora_of[new.req_id]
            self.steps.append(scheduler_output)
            execute(scheduler_output)

        backend.execute_model = execute_model  # type: ignore[method-assign]

    def add_lora_request(self, req_id: str, prompt: list[int], max_tokens: int, lora: int) -> None:
        self.lora_of[req_id] = lora
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
        request = Request(
            req_id, prompt, params, block_size=self.block_size, cache_salt=f"lora-{lora}"
        )
        self.scheduler.add_request(request)
        self.outputs[req_id] = []


def _backend(model: TinyModel, kernels: str = "torch", **fields: Any) -> CudaBackend:
    fields = {"max_loras": 4, "max_lora_rank": 8, "block_size": 4, "max_model_len": 128, **fields}
    config = EngineConfig(
        model=str(model.path), backend="cuda",
        backend_options={"device": "cpu", "kernels": kernels}, enable_lora=True, **fields,
    )  # fmt: skip
    return CudaBackend(config)


def _check(
    harness: LoRAHarness, hf: dict[int, torch.nn.Module], prompts: dict[str, list[int]]
) -> float:
    """Every request's tokens equal its merged model's greedy tokens; returns the largest
    logprob difference."""
    worst = 0.0
    for req_id, prompt in prompts.items():
        model = hf[harness.lora_of[req_id]]
        tokens = harness.outputs[req_id]
        assert tokens == greedy(model, prompt, len(tokens)), req_id
        expected = log_softmax(model, prompt + tokens)[len(prompt) - 1 : -1]
        got = [entry.logprobs[0] for entry in harness.logprobs[req_id]]
        want = expected.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        worst = max(worst, (torch.tensor(got) - want).abs().max().item())
    return worst


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_mixed_adapters_equal_merged_models(
    tiny: dict[str, TinyModel], adapters: dict[str, list[Adapter]], kind: str
) -> None:
    """Base + four adapters in one batch, chunked prefill (8-token budget), preemption (few
    blocks), prefix hits within an adapter, two adapters hot-loaded mid-run and one removed
    while its request runs."""
    model = tiny[kind]
    ads = adapters[kind]
    hf = {0: model.hf, **{i + 1: a.merged for i, a in enumerate(ads)}}
    backend = _backend(model)
    try:
        num_blocks = 22
        backend.initialize_kv_cache(num_blocks)
        harness = LoRAHarness(backend, backend.config, num_blocks)
        harness.set_token_budget(8)
        for i in (0, 1):
            lora = ads[i]
            backend.add_lora(LoRARequest(lora.name, i + 1, str(lora.path)))
        prompts: dict[str, list[int]] = {}
        shared = _prompt(99, 13)
        for req_id, lora, prompt in [
            ("base", 0, _prompt(1, 9)),
            ("a1", 1, shared + _prompt(2, 3)),
            ("a2", 2, _prompt(3, 17)),
        ]:
            prompts[req_id] = prompt
            harness.add_lora_request(req_id, prompt, 14, lora)
        for _ in range(4):
            harness.step()
        for i in (2, 3):  # hot-loaded while the others run
            lora = ads[i]
            backend.add_lora(LoRARequest(lora.name, i + 1, str(lora.path)))
        for req_id, lora, prompt in [
            ("a3", 3, _prompt(4, 11)),
            ("a4", 4, _prompt(5, 6)),
            ("a1-prefix", 1, shared + _prompt(6, 2)),
            ("base-2", 0, _prompt(7, 5)),
        ]:
            prompts[req_id] = prompt
            harness.add_lora_request(req_id, prompt, 20, lora)
        harness.step()
        backend.remove_lora(2)  # "a2" still runs with it
        runner_lora = backend.runner.lora
        assert runner_lora is not None and 2 in runner_lora.adapters
        harness.run()
        assert 2 not in runner_lora.adapters and 2 not in runner_lora.slots
        worst = _check(harness, hf, prompts)
        assert worst < 1e-4, worst
        # The adapters matter: their tokens are not the base model's.
        changed = [
            r for r, p in prompts.items()
            if harness.lora_of[r] and harness.outputs[r] != greedy(model.hf, p, 20)[: len(harness.outputs[r])]
        ]  # fmt: skip
        assert len(changed) >= 4, changed
        assert harness.scheduler.num_preemptions > 0
        assert any(s.total_num_scheduled_tokens == 8 for s in harness.steps)
        # Every adapter and the base model ran in one step.
        assert any(len({harness.lora_of[r] for r in s.req_ids}) == 5 for s in harness.steps), (
            "no step mixed the four adapters and the base model"
        )
        # Prefix hit of "a1-prefix" on "a1"'s blocks (same adapter).
        hit = [n for s in harness.steps for n in s.new_reqs if n.req_id == "a1-prefix"]
        assert hit[0].num_computed_tokens >= 8
        print(f"{kind}: greedy tokens equal, max logprob difference {worst:.2e}")
    finally:
        backend.close()


def test_triton_kernels_end_to_end(
    tiny: dict[str, TinyModel], adapters: dict[str, list[Adapter]]
) -> None:
    """The Triton shrink/expand (interpreted) in a mixed batch of two adapters and the base."""
    model = tiny["llama"]
    ads = adapters["llama"]
    hf = {0: model.hf, 1: ads[0].merged, 2: ads[1].merged}
    backend = _backend(model, kernels="triton")
    try:
        backend.initialize_kv_cache(32)
        harness = LoRAHarness(backend, backend.config, 32)
        harness.set_token_budget(16)
        for i in (0, 1):
            backend.add_lora(LoRARequest(ads[i].name, i + 1, str(ads[i].path)))
        prompts = {"b": _prompt(1, 5), "x": _prompt(2, 9), "y": _prompt(3, 4)}
        for (req_id, prompt), lora in zip(prompts.items(), (0, 1, 2), strict=True):
            harness.add_lora_request(req_id, prompt, 4, lora)
        harness.run()
        assert _check(harness, hf, prompts) < 1e-4
    finally:
        backend.close()


def test_slots_are_least_recently_used(
    tiny: dict[str, TinyModel], adapters: dict[str, list[Adapter]]
) -> None:
    model = tiny["llama"]
    ads = adapters["llama"]
    backend = _backend(model, max_loras=2)
    try:
        lora = backend.runner.lora
        assert lora is not None
        for i, a in enumerate(ads):
            backend.add_lora(LoRARequest(a.name, i + 1, str(a.path)))
        assert lora.assign([1, 2]) == {1: 0, 2: 1}
        assert lora.assign([2, 0]) == {2: 1}
        assert lora.assign([3]) == {3: 0}  # slot 0 (adapter 1) was used least recently
        assert lora.assign([2, 3]) == {2: 1, 3: 0}  # no copy: both in their slots
        assert lora.assign([4, 1]) in ({4: 0, 1: 1}, {4: 1, 1: 0})
        # Slot 1 (adapter 4 or 1) is least recently used, but its adapter still runs: spared.
        held = dict(enumerate(lora.slots))
        lru_slot = next(iter(lora._lru))
        other = 1 - lru_slot
        assert lora.assign([2], keep=[held[lru_slot]]) == {2: other}
        with pytest.raises(RuntimeError, match="max_loras is 2"):
            lora.assign([1, 2, 3])
        # The slot's contents are the adapter's matrices (B scaled).
        slot = lora.assign([1])[1]
        a0, b0 = lora.adapters[1].weights[0, "self_attn.qkv_proj", "q"]
        qkv = lora.layers[0, "self_attn.qkv_proj"]
        assert torch.equal(qkv.a[slot, : a0.shape[0]], a0)
        assert torch.equal(qkv.b[slot, : b0.shape[0], : b0.shape[1]], b0)
        support = backend.lora_support()
        assert support is not None and support.max_rank == 8
        assert "down_proj" in support.target_modules
    finally:
        backend.close()


def _edited(source: Path, target: Path, **changes: Any) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "adapter_config.json").read_text())
    config.update(changes)
    (target / "adapter_config.json").write_text(json.dumps(config))
    return target


def test_bad_adapters_raise_lora_errors(
    tiny: dict[str, TinyModel], adapters: dict[str, list[Adapter]], tmp_path: Path
) -> None:
    model = tiny["llama"]
    good = adapters["llama"][0].path
    backend = _backend(model)
    try:
        cases = [
            (tmp_path / "missing", "does not exist"),
            (_edited(good, tmp_path / "r16", r=16), "rank 16 is above max_lora_rank 8"),
            (
                _edited(good, tmp_path / "embed", target_modules=["embed_tokens", "q_proj"]),
                r"target modules \['embed_tokens'\] are not served",
            ),
            (_edited(good, tmp_path / "dora", use_dora=True), "DoRA"),
        ]
        for path, message in cases:
            with pytest.raises(LoRAError, match=message) as info:
                backend.add_lora(LoRARequest("bad", 7, str(path)))
            assert info.value.lora_name == "bad"
        lora = backend.runner.lora
        assert lora is not None and 7 not in lora.adapters
    finally:
        backend.close()
    # Another architecture: the Llama adapter's shapes do not fit the tiny Qwen3 (head_dim 32).
    qwen3 = load_model_config(tiny["qwen3"].path)
    with pytest.raises(LoRAError, match="shapes do not fit the base model") as info:
        read_adapter(1, "llama-adapter", good, qwen3, 8)
    assert info.value.lora_name == "llama-adapter"
    # A mixture-of-experts model serves attention adapters only.
    moe = load_model_config(tiny["mixtral"].path)
    with pytest.raises(LoRAError, match="not served"):
        read_adapter(1, "mlp", good, moe, 8)


@pytest.fixture(scope="module")
def triton_lora() -> Iterator[Any]:
    from engine_core_cuda._device import prepare_triton

    prepare_triton(torch.device("cpu"))
    from engine_core_cuda.kernels import lora

    yield lora


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_expand_match_the_torch_reference(triton_lora: Any, dtype: torch.dtype) -> None:
    from engine_core_cuda.kernels.lora_torch import (
        lora_expand_torch,
        lora_shrink_torch,
        segments_of,
    )

    torch.manual_seed(0)
    tokens, k, r, n, slots = 37, 80, 24, 70, 3
    x = torch.randn(tokens, k).to(dtype)
    a = (torch.randn(slots, r, k) * 0.2).to(dtype)
    b = (torch.randn(slots, n, r) * 0.2).to(dtype)
    # Segments: adapter 1, the base model, adapter 0 over more than one block, adapter 2, and
    # an empty segment past the step's (as a CUDA graph's padding).
    seg_start = torch.tensor([0, 5, 6, 24, 37, 37], dtype=torch.int32)
    seg_slot = torch.tensor([1, -1, 0, 2, -1], dtype=torch.int32)
    segments = segments_of(seg_start, seg_slot, 5)
    y = torch.zeros(tokens, r)
    y_ref = torch.zeros(tokens, r)
    triton_lora.lora_shrink(x, a, y, seg_start, seg_slot, 5)
    lora_shrink_torch(x, a, y_ref, segments)
    shrink_err = (y - y_ref).abs().max().item()
    assert torch.equal(y[5], torch.zeros(r))  # the base model's token is left alone
    # Expand into a column slice of a wider output (a fused projection's shard).
    full = torch.randn(tokens, 2 * n).to(dtype)
    full_ref = full.clone()
    triton_lora.lora_expand(y, b, full[:, n:], seg_start, seg_slot, 5)
    lora_expand_torch(y_ref, b, full_ref[:, n:], segments)
    assert torch.equal(full[:, :n], full_ref[:, :n])
    # Three shards of a fused output (as qkv) in one launch, each from its rank block of y.
    shards = [(0, 40), (40, 17), (57, 13)]
    y3 = torch.randn(tokens, 3 * r)
    fused = torch.randn(tokens, n).to(dtype)
    fused_ref = fused.clone()
    triton_lora.lora_expand(y3, b, fused, seg_start, seg_slot, 5, shards)
    for j, (first, rows) in enumerate(shards):
        lora_expand_torch(y3[:, j * r : (j + 1) * r], b[:, first : first + rows],
                          fused_ref[:, first : first + rows], segments)  # fmt: skip
    fused_err = (fused - fused_ref).float().abs().max().item()
    assert fused_err < (1e-4 if dtype == torch.float32 else 2e-2) * fused_ref.float().abs().max()
    expand_err = (full - full_ref).float().abs().max().item()
    scale = full_ref.float().abs().max().item()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert shrink_err < tolerance * y_ref.abs().max().item(), shrink_err
    assert expand_err < tolerance * scale, expand_err
    print(f"{dtype}: shrink max error {shrink_err:.2e}, expand max error {expand_err:.2e}")


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_decode_graphs_take_the_segments_as_inputs(
    tiny: dict[str, TinyModel], adapters: dict[str, list[Adapter]], kernels: str
) -> None:
    """The decode-graph path (a stand-in that replays the captured function eagerly): graphs
    captured before any adapter is loaded run batches of adapters and the base model, padded,
    with the segments written into their static inputs."""
    from test_cuda_graphs import EagerGraphs

    model = tiny["qwen2"]
    ads = adapters["qwen2"]
    hf = {0: model.hf, 1: ads[0].merged, 2: ads[2].merged}
    backend = _backend(model, kernels=kernels)
    try:
        backend.initialize_kv_cache(32)
        runner = backend.runner
        graphs = EagerGraphs(runner, [1, 2, 4])
        graphs.capture()
        runner.graphs = graphs
        harness = LoRAHarness(backend, backend.config, 32)
        backend.add_lora(LoRARequest(ads[0].name, 1, str(ads[0].path)))
        backend.add_lora(LoRARequest(ads[2].name, 2, str(ads[2].path)))
        prompts = {"a": _prompt(1, 6), "b": _prompt(2, 3), "c": _prompt(3, 5)}
        for (req_id, prompt), lora in zip(prompts.items(), (1, 0, 2), strict=True):
            harness.add_lora_request(req_id, prompt, 4, lora)
        harness.run()
        assert graphs.replays >= 3  # decodes of three requests in the graph of 4
        assert _check(harness, hf, prompts) < 1e-4
    finally:
        backend.close()


def test_tensor_parallel_slices_recompose_the_update(
    tiny: dict[str, TinyModel], adapters: dict[str, list[Adapter]]
) -> None:
    """Under tensor parallelism each rank reads its part: column-parallel projections (q, k,
    v, gate, up) the rows of ``lora_B``, row-parallel ones (o, down) the columns of
    ``lora_A``; the ranks' outputs concatenate (column) or sum in the all-reduce (row) to the
    whole update."""
    from engine_core_cuda._tp.shard import slice_of

    config = load_model_config(tiny["llama"].path)
    path = adapters["llama"][0].path
    full = read_adapter(1, "all", path, config, 8)
    size = 2
    parts = [
        read_adapter(1, "all", path, config, 8,
                     lambda name, ndim, rank=rank: slice_of(name, ndim, config, rank, size))
        for rank in range(size)
    ]  # fmt: skip
    torch.manual_seed(0)
    for key, (a, b) in full.weights.items():
        _, projection, _ = key
        x = torch.randn(3, a.shape[1])
        whole = x @ a.t() @ b.t()
        if projection in ("self_attn.o_proj", "mlp.down_proj"):
            width = a.shape[1] // size
            summed = sum(
                x[:, r * width : (r + 1) * width] @ p.weights[key][0].t() @ p.weights[key][1].t()
                for r, p in enumerate(parts)
            )
            assert all(p.weights[key][0].shape[1] == width for p in parts)
            torch.testing.assert_close(summed, whole)
        else:
            joined = torch.cat(
                [x @ p.weights[key][0].t() @ p.weights[key][1].t() for p in parts], 1
            )
            torch.testing.assert_close(joined, whole)


def test_check_lora_conformance(
    tiny: dict[str, TinyModel], adapters: dict[str, list[Adapter]]
) -> None:
    """``engine_core.testing.check_lora`` against the CUDA backend (torch kernels)."""
    from engine_core.testing import check_lora

    model = tiny["llama"]
    config = EngineConfig(
        model=str(model.path), backend="cuda",
        backend_options={"device": "cpu", "kernels": "torch"}, max_model_len=256, max_lora_rank=8,
    )  # fmt: skip
    loras = [LoRARequest(a.name, i + 1, str(a.path)) for i, a in enumerate(adapters["llama"][:3])]
    check_lora(CudaBackend, loras, config)


def test_llm_generate_with_adapters(
    tiny: dict[str, TinyModel], adapters: dict[str, list[Adapter]]
) -> None:
    """``LLM.generate`` with one adapter per prompt through the engine core (its scheduler, its
    adapter loader, prefix-cache keys per adapter): the same prompt under the base model and
    three adapters, then again (prefix-cache hits within each adapter)."""
    from engine_core import SamplingParams as Params

    model = tiny["llama"]
    ads = adapters["llama"]
    hf = [model.hf, *(a.merged for a in ads[:3])]
    loras = [None, *(LoRARequest(a.name, i + 1, str(a.path)) for i, a in enumerate(ads[:3]))]
    prompt = {"prompt_token_ids": _prompt(8, 19)}
    params = Params(temperature=0.0, max_tokens=6, ignore_eos=True)
    with model.llm(block_size=4, enable_lora=True, max_loras=4, max_lora_rank=8) as llm:
        first = llm.generate([prompt] * 4, params, use_tqdm=False, lora_request=loras)
        second = llm.generate([prompt] * 4, params, use_tqdm=False, lora_request=loras)
    outputs = [o.outputs[0].token_ids for o in first]
    assert len({tuple(t) for t in outputs}) == 4, outputs  # every adapter changes the tokens
    for out, again, reference in zip(first, second, hf, strict=True):
        expected = greedy(reference, out.prompt_token_ids, 6)
        assert out.outputs[0].token_ids == expected
        assert again.outputs[0].token_ids == expected
        assert again.num_cached_tokens >= 16


@pytest.mark.timeout(300)
def test_tensor_parallel_adapters_equal_merged_models(
    tiny: dict[str, TinyModel], adapters: dict[str, list[Adapter]]
) -> None:
    """TP=2 (gloo on the CPU): every rank reads its part of each adapter, loaded on rank 0's
    loader thread and sent to the worker between steps; a mixed batch gives the merged models'
    greedy tokens."""
    from engine_core import SamplingParams as Params

    model = tiny["llama"]
    ads = adapters["llama"]
    hf = [model.hf, ads[0].merged, ads[3].merged]
    loras = [None, LoRARequest(ads[0].name, 1, str(ads[0].path)),
             LoRARequest(ads[3].name, 2, str(ads[3].path))]  # fmt: skip
    prompts = [{"prompt_token_ids": _prompt(i, 7 + 3 * i)} for i in range(3)]
    params = Params(temperature=0.0, max_tokens=6, ignore_eos=True)
    with model.llm(tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    for out, reference in zip(outputs, hf, strict=True):
        assert out.outputs[0].token_ids == greedy(reference, out.prompt_token_ids, 6)


def _assert_adapter_beside_the_base(
    model: TinyModel, adapter: Adapter, prompt: list[int], max_tokens: int = 5
) -> None:
    """One prompt under the base model and under ``adapter`` in one batch: the adapter changes
    the tokens, and each equals its reference's greedy tokens (the merged model's)."""
    from engine_core import SamplingParams as Params

    lora = LoRARequest(adapter.name, 1, str(adapter.path))
    prompts = [{"prompt_token_ids": prompt}] * 2
    params = Params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with model.llm(block_size=4, enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=[None, lora])
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids
    for out, reference in zip(outputs, [model.hf, adapter.merged], strict=True):
        assert out.outputs[0].token_ids == greedy(reference, out.prompt_token_ids, max_tokens)


def test_gemma2_adapter_equals_its_merged_model(tiny: dict[str, TinyModel], tmp_path: Path) -> None:
    """Gemma 2 (window and full layers, soft caps, its own decoder layer) with an adapter on
    every served module, beside the base model."""
    model = tiny["gemma2"]
    adapter = build_adapter(model.hf, "all", tmp_path / "gemma2-all", seed=3)
    _assert_adapter_beside_the_base(model, adapter, _prompt(4, 17))


def test_sleep_frees_the_slots_and_wake_up_reloads_them(
    tiny: dict[str, TinyModel], adapters: dict[str, list[Adapter]]
) -> None:
    model = tiny["qwen2"]
    ads = adapters["qwen2"]
    backend = _backend(model)
    try:
        backend.initialize_kv_cache(32)
        backend.add_lora(LoRARequest(ads[1].name, 1, str(ads[1].path)))
        lora = backend.runner.lora
        assert lora is not None
        lora.assign([1])
        backend.sleep(1)
        assert all(layer.a.numel() == 0 for layer in lora.layers.values())
        backend.wake_up()
        assert lora.slots == [None] * 4 and 1 in lora.adapters  # kept in host memory
        harness = LoRAHarness(backend, backend.config, 32)
        prompts = {"x": _prompt(5, 7), "base": _prompt(6, 4)}
        for (req_id, prompt), lora_id in zip(prompts.items(), (1, 0), strict=True):
            harness.add_lora_request(req_id, prompt, 4, lora_id)
        harness.run()
        assert _check(harness, {0: model.hf, 1: ads[1].merged}, prompts) < 1e-4
    finally:
        backend.close()


def _adapter_logits(path: Path, lora: LoRARequest, prompts: list[list[int]], **fields: Any) -> Any:
    """Each prompt's last-position logits under ``lora`` (one prefill step) and under the base
    model (a second one), from a fresh backend with ``fields``."""
    from test_cuda_fp8 import _backend as plain_backend
    from test_cuda_fp8 import _last_logits

    backend = plain_backend(path, enable_lora=True, max_loras=2, max_lora_rank=8, **fields)
    try:
        backend.add_lora(lora)
        news = [NewRequestData(f"a{i}", p, SamplingParams(temperature=0.0), [2 * i, 2 * i + 1],
                               0, len(p), lora_int_id=1) for i, p in enumerate(prompts)]  # fmt: skip
        backend.execute_model(SchedulerOutput(news, CachedRequestData(), sum(map(len, prompts)),
                                              lora_ids=(1,)))  # fmt: skip
        forward = backend.runner._forward
        assert forward is not None and forward.logits is not None
        adapted = forward.logits.clone()
        backend.sample_tokens(None)
        finished = [f"a{i}" for i in range(len(prompts))]
        backend.execute_model(
            SchedulerOutput([], CachedRequestData(), 0, finished_req_ids=finished)
        )
        backend.sample_tokens(None)
        base = _last_logits(backend, prompts)
        return adapted, base
    finally:
        backend.close()


def test_adapters_on_fp8_weights(
    tiny: dict[str, TinyModel], adapters: dict[str, list[Adapter]], tmp_path: Path
) -> None:
    """``quantization="fp8"`` with LoRA: the FP8 projections get the adapter's low-rank update
    (in the model dtype) as the unquantised ones do: the adapter moves the FP8 model's logits as
    it moves the float32 model's, within FP8's rounding (the matrices halved, as in
    ``test_cuda_fp8``: the tiny models' gain amplifies FP8's rounding)."""
    from test_cuda_fp8 import _cosines, _halved

    model = tiny["llama"]
    path = _halved(model, tmp_path / "halved")
    lora = LoRARequest(adapters["llama"][0].name, 1, str(adapters["llama"][0].path))
    prompts = [_prompt(i, 9 + 4 * i) for i in range(3)]
    full_adapted, full_base = _adapter_logits(path, lora, prompts)
    fp8_adapted, fp8_base = _adapter_logits(path, lora, prompts, quantization="fp8")
    assert min(_cosines(full_adapted, fp8_adapted)) >= 0.99
    assert min(_cosines(full_adapted - full_base, fp8_adapted - fp8_base)) >= 0.95
    assert max(_cosines(fp8_adapted, fp8_base)) < 0.99  # the adapter matters


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_mixture_of_experts_adapters_on_attention_equal_the_merged_model(
    tiny: dict[str, TinyModel], tmp_path: Path, kind: str
) -> None:
    """A mixture-of-experts model (gpt-oss: sinks, window layers, biased projections) with an
    adapter on its attention projections, beside the base model."""
    model = tiny[kind]
    adapter = build_adapter(model.hf, "attn", tmp_path / f"{kind}-attn", seed=5)
    _assert_adapter_beside_the_base(model, adapter, _prompt(6, 21))
