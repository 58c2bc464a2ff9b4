"""Speculative decoding with a draft model (on the CPU, float32): the draft is the target itself
(every draft accepted), another tiny model (some accepted) or random weights (almost none), and
the outputs always equal those without speculation."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_core_cuda import CudaBackend
from engine_core_cuda._cuda_graphs import DecodeGraphs
from engine_core_cuda._step_inputs import StepInputs
from tiny_models import TinyModel

from engine_core import SamplingParams
from engine_core.config import EngineConfig
from engine_core.testing import check_spec_decode

SMALL = {"block_size": 4, "num_kv_blocks": 48, "max_model_len": 96, "max_num_seqs": 4}
PROMPTS = [{"prompt_token_ids": [(5 * i + 3 * j) % 90 + 7 for j in range(6 + 3 * i)]}
           for i in range(3)]  # fmt: skip
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True, logprobs=1),
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=0.4),
]


def _draft(path: Path, k: int = 3) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k,
            "dynamic": False}  # fmt: skip


def _random_draft(model: TinyModel, directory: Path) -> Path:
    """The model's architecture with other random weights."""
    hf = copy.deepcopy(model.hf)
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    hf.save_pretrained(directory)
    return directory


def _generate(model: TinyModel, spec: dict[str, Any] | None, **fields: Any) -> tuple[Any, Any]:
    with model.llm(speculative_config=spec, **SMALL, **fields) as llm:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        core = llm._client.engine_core
        stats = core.scheduler.draft_planner.stats if spec is not None else None
    tokens = [(o.outputs[0].token_ids, [list(e) for e in o.outputs[0].logprobs or []])
              for o in outputs]  # fmt: skip
    return tokens, stats


@pytest.fixture(scope="module")
def plain(tiny: dict[str, TinyModel]) -> Any:
    return _generate(tiny["llama"], None)[0]


def test_the_target_as_its_own_draft_has_every_draft_accepted(
    tiny: dict[str, TinyModel], plain: Any
) -> None:
    model = tiny["llama"]
    tokens, stats = _generate(model, _draft(model.path))
    assert tokens == plain
    assert stats.num_draft_tokens > 0
    # Greedy requests accept every draft; the seeded one samples with the same noise.
    assert stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.parametrize(("draft", "dynamic"), [("qwen2", False), ("random", False),
                                               ("random", True)])  # fmt: skip
def test_other_drafts_give_the_same_tokens(
    tiny: dict[str, TinyModel], plain: Any, draft: str, dynamic: bool, tmp_path: Path
) -> None:
    """With ``dynamic`` the policy stops drafting for a draft that is always wrong, probing
    now and then (drafts asked for without lookahead slots: fewer come back)."""
    model = tiny["llama"]
    path = tiny[draft].path if draft != "random" else _random_draft(model, tmp_path / "rand")
    tokens, stats = _generate(model, {**_draft(path), "dynamic": dynamic})
    assert tokens == plain
    assert stats.num_draft_tokens > 0
    if draft == "random":
        assert stats.num_accepted_tokens < stats.num_draft_tokens // 4
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_a_draft_of_another_vocabulary_is_refused(
    tiny: dict[str, TinyModel], tmp_path: Path
) -> None:
    draft = tmp_path / "other-vocab"
    shutil.copytree(tiny["qwen3"].path, draft)
    config = json.loads((draft / "config.json").read_text())
    config["vocab_size"] += 16
    (draft / "config.json").write_text(json.dumps(config))
    config = EngineConfig(
        model=str(tiny["llama"].path), backend="cuda", backend_options={"device": "cpu"},
        speculative_config=_draft(draft),
    )  # fmt: skip
    with pytest.raises(ValueError, match="must share the target's vocabulary"):
        CudaBackend(config)


class EagerGraphs(DecodeGraphs):
    """Replays the captured function eagerly (a CUDA graph's stand-in on the CPU)."""

    replays = 0
    padded = 0

    def _run_padded(self, step: StepInputs, n: int, q: int) -> torch.Tensor:
        self.padded += 1
        return super()._run_padded(step, n, q)

    def _record(
        self, forward: Callable[[], torch.Tensor]
    ) -> tuple[Callable[[], None], torch.Tensor]:
        output = forward()

        def replay() -> None:
            self.replays += 1
            output.copy_(forward())

        return replay, output


def test_draft_passes_in_decode_graphs(tiny: dict[str, TinyModel], plain: Any) -> None:
    model = tiny["llama"]
    with model.llm(speculative_config=_draft(tiny["qwen2"].path), **SMALL) as llm:
        runner = llm._client.engine_core.backend.runner
        graphs = EagerGraphs(runner, [1, 2, 4, 16], [1, 2, 3, 4], drafter=runner.drafter)
        graphs.capture()
        runner.drafter.graphs = graphs
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    tokens = [(o.outputs[0].token_ids, [list(e) for e in o.outputs[0].logprobs or []])
              for o in outputs]  # fmt: skip
    assert tokens == plain
    # Single-token passes, and catch-up on verification steps (q = 1 + drafts).
    assert graphs.replays > graphs.padded > 0
    # The draft's graphs write its own cache, not the target's.
    assert graphs._model()[0] is runner.drafter.model


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_keep_the_draft_model(
    tiny: dict[str, TinyModel], plain: Any, level: int
) -> None:
    model = tiny["llama"]
    with model.llm(speculative_config=_draft(model.path), **SMALL) as llm:
        backend = llm._client.engine_core.backend
        drafter = backend.runner.drafter
        backend.sleep(level)
        if level == 2:  # dropped, reloaded from the draft's directory on waking
            assert all(p.numel() == 0 for p in drafter.model.parameters())
        assert drafter.kv_caches == []
        backend.wake_up()
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        stats = llm._client.engine_core.scheduler.draft_planner.stats
    tokens = [(o.outputs[0].token_ids, [list(e) for e in o.outputs[0].logprobs or []])
              for o in outputs]  # fmt: skip
    assert tokens == plain
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


@pytest.mark.timeout(300)
def test_conformance_with_a_draft_model(tiny: dict[str, TinyModel]) -> None:
    config = EngineConfig(
        model=str(tiny["llama"].path), backend="cuda",
        backend_options={"device": "cpu", "kernels": "torch"}, max_model_len=256,
        speculative_config=_draft(tiny["qwen2"].path),
    )  # fmt: skip
    check_spec_decode(CudaBackend, config)


def test_the_target_as_its_own_draft_under_penalties_and_min_tokens(
    tiny: dict[str, TinyModel],
) -> None:
    """Each draft counts the drafts before it in the penalties and ``min_tokens``, as the
    target does when it verifies them: a draft that is the target accepts everything."""
    model = tiny["llama"]
    with model.llm(**SMALL) as llm:
        first = llm.generate(PROMPTS[:1], PARAMS[0], use_tqdm=False)[0].outputs[0].token_ids
    stop = first[2]  # held back by min_tokens at first
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=1.5,
                       frequency_penalty=1.0, repetition_penalty=1.4),
        SamplingParams(temperature=0.0, max_tokens=16, min_tokens=6, stop_token_ids=[stop]),
    ]  # fmt: skip
    results = {}
    for spec in (None, _draft(model.path, k=4)):
        with model.llm(speculative_config=spec, **SMALL) as llm:
            outputs = llm.generate(PROMPTS[:1] * 2, params, use_tqdm=False)
            results[spec is None] = [o.outputs[0].token_ids for o in outputs]
            if spec is not None:
                stats = llm._client.engine_core.scheduler.draft_planner.stats
    assert results[True] == results[False]
    penalized, held_back = results[False]
    assert penalized != first  # the penalties changed the greedy path
    assert stop not in held_back[:6]  # sampled at output 3 without min_tokens
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
