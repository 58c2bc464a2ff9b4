"""Speculative decoding in the backend, driven step by step with scripted drafts: the tokens
equal those of decoding without drafts, whatever the drafts, next to prefilling requests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch
from engine_core_cuda import CudaBackend
from engine_core_cuda._cuda_graphs import DecodeGraphs
from engine_core_cuda._step_inputs import StepInputs
from hf_reference import greedy
from tiny_models import VOCAB_SIZE, TinyModel

from engine_core import SamplingParams
from engine_core.abc import CachedRequestData, NewRequestData, SchedulerOutput, TokenLogprobs
from engine_core.config import EngineConfig

BLOCK = 4
MAX_LEN = 64
PROMPTS = [[(7 * i + 3 * j) % 90 + 5 for j in range(12 - i)] for i in range(4)]

Drafter = Callable[[str, int], list[int]]
"""(request id, number of output tokens so far) -> drafts for the next step."""


@dataclass
class _Request:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    blocks: list[int]
    outputs: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    computed: int = 0
    admitted: bool = False
    sampling_steps: int = 0

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.params.max_tokens


def _backend(model: TinyModel, kernels: str) -> CudaBackend:
    config = EngineConfig(
        model=str(model.path), backend="cuda",
        backend_options={"device": "cpu", "kernels": kernels},
        block_size=BLOCK, max_model_len=MAX_LEN, max_num_seqs=8,
    )  # fmt: skip
    backend = CudaBackend(config)
    backend.initialize_kv_cache(8 * MAX_LEN // BLOCK)
    return backend


@pytest.fixture(scope="module")
def backend(tiny: dict[str, TinyModel]) -> Iterator[CudaBackend]:
    backend = _backend(tiny["llama"], "torch")
    yield backend
    backend.close()


def run(
    backend: CudaBackend,
    prompts: list[list[int]],
    params: list[SamplingParams],
    drafter: Drafter | None = None,
    chunk: int = 64,
) -> list[_Request]:
    """Run the requests to ``max_tokens`` together, as a scheduler would: prompts in chunks of
    ``chunk`` tokens, then decode steps verifying the drafter's drafts (capped to the tokens
    still wanted), rolling back the rejected ones."""
    per_request = MAX_LEN // BLOCK
    requests = [
        _Request(f"r{i}", p, sp, list(range(i * per_request, (i + 1) * per_request)))
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    while not all(r.done for r in requests):
        new: list[NewRequestData] = []
        cached = CachedRequestData()
        order: list[_Request] = []
        drafts_of: dict[str, list[int]] = {}
        for r in requests:
            if r.done:
                continue
            if r.computed < len(r.prompt):
                num = min(chunk, len(r.prompt) - r.computed)
            else:
                drafts = drafter(r.req_id, len(r.outputs)) if drafter is not None else []
                drafts = drafts[: r.params.max_tokens - len(r.outputs) - 1]
                drafts_of[r.req_id] = drafts
                num = 1 + len(drafts)
            if not r.admitted:
                new.append(NewRequestData(r.req_id, r.prompt, r.params, r.blocks, 0, num))
                r.admitted = True
            else:
                cached.req_ids.append(r.req_id)
                cached.new_block_ids.append(None)
                cached.num_computed_tokens.append(r.computed)
                cached.num_scheduled_tokens.append(num)
                cached.spec_token_ids.append(drafts_of.get(r.req_id, []))
                order.append(r)
            r.computed += num
        order += [r for r in requests if r.req_id in {n.req_id for n in new}]
        if not any(cached.spec_token_ids):
            cached.spec_token_ids = []
        total = sum(cached.num_scheduled_tokens) + sum(n.num_scheduled_tokens for n in new)
        backend.execute_model(SchedulerOutput(new, cached, total))
        output = backend.sample_tokens(None)
        assert output.req_ids == [r.req_id for r in order]
        for i, (r, tokens) in enumerate(zip(order, output.sampled_token_ids, strict=True)):
            drafts = drafts_of.get(r.req_id, [])
            accepted = len(tokens) - 1 if tokens else 0
            if tokens:  # the contract's shape of a verified step
                assert tokens[:accepted] == drafts[:accepted]
                assert accepted == len(drafts) or tokens[accepted] != drafts[accepted]
                r.computed -= len(drafts) - accepted
            r.outputs += tokens
            r.sampling_steps += bool(tokens)
            if r.params.logprobs is not None and tokens:
                assert output.logprobs is not None
                entries = output.logprobs[i]
                assert entries is not None and len(entries) == len(tokens)
                r.logprobs += entries
    finished = [r.req_id for r in requests]
    backend.execute_model(SchedulerOutput([], CachedRequestData(), 0, finished_req_ids=finished))
    backend.sample_tokens(None)
    return requests


def _cut(req_id: str, n: int, k: int) -> int:
    """Mixed drafts: how many are right after ``n`` output tokens."""
    return (3 * n + int(req_id[1:])) % (k + 1)


def _mixed_steps(req_id: str, k: int, max_tokens: int) -> int:
    """Steps that sample with mixed drafts: the prefill's, then one per verification."""
    n, steps = 1, 1
    while n < max_tokens:
        n += min(_cut(req_id, n, k), max_tokens - n - 1) + 1
        steps += 1
    return steps


def _scripted(reference: dict[str, list[int]], k: int, kind: str) -> Drafter:
    """Drafts from the known continuation: all right, all wrong, or right up to a point that
    moves with the position."""

    def drafter(req_id: str, n: int) -> list[int]:
        right = reference[req_id][n : n + k]
        wrong = [(t + 1) % VOCAB_SIZE for t in right]
        if kind == "right":
            return right
        if kind == "wrong":
            return wrong
        cut = _cut(req_id, n, k)
        return right[:cut] + wrong[cut:]

    return drafter


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=7, max_tokens=14, ignore_eos=True, logprobs=2),
    SamplingParams(
        temperature=0.0,
        max_tokens=14,
        ignore_eos=True,
        frequency_penalty=0.7,
        presence_penalty=0.3,
        repetition_penalty=1.2,
    ),  # fmt: skip
    SamplingParams(
        temperature=1.0,
        top_k=20,
        min_p=0.05,
        seed=3,
        max_tokens=14,
        ignore_eos=True,
        logit_bias={5: 1.5},
    ),  # fmt: skip
]


@pytest.mark.parametrize("kind", ["right", "wrong", "mixed"])
def test_spec_decode_is_token_identical(backend: CudaBackend, kind: str) -> None:
    prompts = PROMPTS[: len(PARAMS)]
    reference = run(backend, prompts, PARAMS)
    expected = {r.req_id: r.outputs for r in reference}
    spec = run(backend, prompts, PARAMS, _scripted(expected, 4, kind), chunk=5)
    for ref, got in zip(reference, spec, strict=True):
        assert got.outputs[: len(ref.outputs)] == ref.outputs
        if ref.params.logprobs is not None:
            n = len(ref.logprobs)
            assert [e.token_ids for e in got.logprobs[:n]] == [e.token_ids for e in ref.logprobs]
            for a, b in zip(got.logprobs[:n], ref.logprobs, strict=True):
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    # The prefill samples the first token; then 13 tokens in steps of up to 1 + 4.
    steps = [r.sampling_steps for r in spec]
    if kind == "right":
        assert steps == [4] * len(PARAMS)
    elif kind == "wrong":
        assert steps == [14] * len(PARAMS)
    else:
        assert steps == [_mixed_steps(r.req_id, 4, 14) for r in spec]
        assert 4 < max(steps) < 14


def test_greedy_spec_decode_equals_transformers(
    backend: CudaBackend, tiny: dict[str, TinyModel]
) -> None:
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = greedy(tiny["llama"].hf, prompt, 12)
    drafter = _scripted({"r0": expected}, 3, "mixed")
    (got,) = run(backend, [prompt], [params], drafter)
    assert got.outputs[:12] == expected


class EagerGraphs(DecodeGraphs):
    """Records the forward function instead of a CUDA graph (replays run it eagerly into the
    same static output) and the shapes that ran."""

    ran: list[tuple[int, int, int]]

    def _record(
        self, forward: Callable[[], torch.Tensor]
    ) -> tuple[Callable[[], None], torch.Tensor]:
        output = forward()

        def replay() -> None:
            output.copy_(forward())

        return replay, output

    def _run_padded(self, step: StepInputs, n: int, q: int) -> torch.Tensor:
        self.ran.append((len(step.states), n, q))
        return super()._run_padded(step, n, q)


def test_graphs_of_query_length_one_plus_k_pad_with_fillers(backend: CudaBackend) -> None:
    """Steps verifying up to k drafts run in the graph of the smallest captured 1 + k, requests
    with fewer drafts padded with fillers, batches padded with empty sequences."""
    runner = backend.runner
    graphs = EagerGraphs(runner, [1, 2, 4, 8, 20], [1, 3, 5])
    graphs.ran = []
    assert graphs.shapes == [
        (1, 1), (2, 1), (4, 1), (8, 1), (20, 1), (1, 3), (2, 3), (4, 3), (6, 3),
        (1, 5), (2, 5), (4, 5),
    ]  # fmt: skip
    graphs.capture()
    prompts = PROMPTS[:3]
    params = PARAMS[:3]
    reference = run(backend, prompts, params)
    expected = {r.req_id: r.outputs for r in reference}
    runner.graphs = graphs
    try:
        spec = run(backend, prompts, params, _scripted(expected, 4, "mixed"), chunk=5)
    finally:
        runner.graphs = None
    for ref, got in zip(reference, spec, strict=True):
        assert got.outputs[: len(ref.outputs)] == ref.outputs
    # Three requests: the graph of 4 sequences; 3 or 5 tokens each by the step's most drafts.
    assert {(b, n) for b, n, _ in graphs.ran} <= {(3, 4), (2, 2), (1, 1)}
    assert {q for _, _, q in graphs.ran} == {3, 5}


def test_the_triton_kernels_verify_the_same_tokens(tiny: dict[str, TinyModel]) -> None:
    """Mixed query lengths through the interpreted Triton attention and the fused sampler."""
    backend = _backend(tiny["qwen3"], "triton")
    try:
        params = [PARAMS[0].clone(max_tokens=6), PARAMS[1].clone(max_tokens=6)]
        prompts = [p[:5] for p in PROMPTS[:2]]
        reference = run(backend, prompts, params)
        expected = {r.req_id: r.outputs for r in reference}
        spec = run(backend, prompts, params, _scripted(expected, 3, "mixed"))
    finally:
        backend.close()
    assert [r.outputs[:6] for r in spec] == [r.outputs for r in reference]
    assert [r.sampling_steps for r in spec] == [_mixed_steps(r.req_id, 3, 6) for r in spec]
