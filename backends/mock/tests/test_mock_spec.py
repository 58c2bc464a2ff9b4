"""The mock under speculative decoding, step by step: exact verification, rollback, the KV
ledger, grammar rows, its drafter and the latency of drafts."""

from __future__ import annotations

import numpy as np
import pytest
from engine_core_mock import MockBackend
from mock_driver import Driver, FakeTime

from engine_core._core.engine_io import EngineCoreRequest
from engine_core._engine.core import EngineCore
from engine_core.abc import SpecSupport, StepCostModel
from engine_core.config import EngineConfig, SpeculativeConfig
from engine_core.sampling_params import SamplingParams, StructuredOutputsParams
from engine_core.testing import check_spec_decode


def test_greedy_verification_accepts_the_longest_right_prefix() -> None:
    d = Driver()
    assert d.step(new=[d.new("r", [1, 2, 3])]).sampled_token_ids == [[4]]
    assert d.verify("r", [5, 6, 9]).sampled_token_ids == [[5, 6, 7]]
    # 3 computed + the last token + 2 accepted drafts: the rejected one rolled back.
    assert d.backend.num_computed_tokens("r") == 6
    assert d.verify("r", [8, 9, 10, 11]).sampled_token_ids == [[8, 9, 10, 11, 12]]
    assert d.verify("r", [0]).sampled_token_ids == [[13]]
    assert d.backend.num_computed_tokens("r") == 12
    assert d.decode(["r"]).sampled_token_ids == [[14]]


def test_the_scheduler_must_agree_with_the_rollback() -> None:
    d = Driver()
    d.step(new=[d.new("r", [1, 2, 3])])
    d.verify("r", [5, 0, 0])
    with pytest.raises(RuntimeError, match="the scheduler says 7 tokens are computed, the backend"):
        d.step(cached=[("r", 7, 1, None)])


def test_drafts_must_follow_every_known_token() -> None:
    d = Driver()
    d.step(new=[d.new("r", [1, 2, 3])])
    with pytest.raises(
        RuntimeError,
        match="cannot schedule 4 tokens after 3 computed ones; the "
        "backend knows 4 tokens and 2 drafts",
    ):
        d.step(cached=[("r", 3, 4, None)], drafts=[[5, 6]])
    d = Driver()
    d.step(new=[d.new("r", [1, 2, 3])])
    with pytest.raises(RuntimeError, match="2 drafts must follow all its 4 tokens, but 2 are"):
        d.step(cached=[("r", 3, 2, None)], drafts=[[5, 6]])


def _reference(params: dict[str, object], num: int) -> list[int]:
    d = Driver()
    return d.run([d.new("r", [10, 20, 30], **params)], num)["r"]


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.8, "seed": 7},
        {"temperature": 1.0},  # seeded from the engine seed and the request id
        {"min_tokens": 6, "stop_token_ids": [34, 35]},
        {"logit_bias": {40: 100.0}, "temperature": 0.5, "seed": 1},
    ],
)
def test_verification_reproduces_decoding(params: dict[str, object]) -> None:
    expected = _reference(params, 24)
    d = Driver()
    tokens = d.step(new=[d.new("r", [10, 20, 30], **params)]).sampled_token_ids[0]
    step = 0
    while len(tokens) < 24:
        step += 1
        truth = expected[len(tokens) : len(tokens) + 4]
        # Right drafts, then one wrong one at a place that moves from step to step.
        wrong = step % (len(truth) + 1)
        drafts = truth[:wrong] + ([(truth[wrong] + 1) % 258] if wrong < len(truth) else [])
        got = d.verify("r", drafts).sampled_token_ids[0]
        assert len(got) == min(wrong, len(drafts)) + 1
        tokens += got
    assert tokens[:24] == expected[: len(tokens[:24])]


def test_logprobs_one_entry_per_returned_token() -> None:
    d = Driver()
    d.step(new=[d.new("r", [1, 2, 3], logprobs=1)])
    out = d.verify("r", [5, 6, 0])
    assert out.sampled_token_ids == [[5, 6, 7]]
    assert out.logprobs is not None and out.logprobs[0] is not None
    assert [e.token_ids[0] for e in out.logprobs[0]] == [5, 6, 7]
    assert [e.ranks[0] for e in out.logprobs[0]] == [1, 1, 1]


def _rows(allowed: list[list[int]]) -> np.ndarray:
    rows = np.zeros((len(allowed), 9), dtype=np.int32)  # 258 tokens: 9 words
    for i, tokens in enumerate(allowed):
        for t in tokens:
            rows[i, t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
    return rows


def test_one_grammar_row_per_verified_position() -> None:
    d = Driver()
    so = StructuredOutputsParams(choice=["x"])
    out = d.step(new=[d.new("c", [97], structured_outputs=so)], bitmask=_rows([[98]]))
    assert out.sampled_token_ids == [[98]]
    # Rows: position 0 allows 99, position 1 allows only 120: the second draft (100) is
    # rejected and 120 is sampled there.
    out = d.verify("c", [99, 100, 101], bitmask=_rows([[99], [120], [121], [122]]))
    assert out.sampled_token_ids == [[99, 120]]
    with pytest.raises(RuntimeError, match="grammar bitmask has 1 rows but the batch has 3"):
        d.verify("c", [121, 122], bitmask=_rows([[121]]))


def test_only_verified_blocks_hold_the_prefix() -> None:
    # block_size 4: the drafts fill block 1 (positions 4..7).
    d = Driver(block_size=4)
    d.step(new=[d.new("a", [1, 2, 3], blocks=[0, 1, 2])])
    assert d.verify("a", [99, 6, 7, 8]).sampled_token_ids == [[5]]  # all rejected
    with pytest.raises(RuntimeError, match="no request has finished writing it"):
        d.step(new=[d.new("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], computed=8, blocks=[0, 1, 3])])
    d = Driver(block_size=4)
    d.step(new=[d.new("a", [1, 2, 3], blocks=[0, 1, 2])])
    assert d.verify("a", [5, 6, 7, 8]).sampled_token_ids == [[5, 6, 7, 8, 9]]
    out = d.step(new=[d.new("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], computed=8, blocks=[0, 1, 3])])
    assert out.sampled_token_ids == [[10]]


def test_the_drafter_guesses_the_rule_and_is_asked_for_counts() -> None:
    d = Driver(spec={"acceptance_rate": 1.0})
    out = d.step(new=[d.new("a", [1, 2, 3]), d.new("b", [50])], num_draft_tokens=3)
    assert out.sampled_token_ids == [[4], [51]]
    assert out.draft_token_ids == [[5, 6, 7], [52, 53, 54]]
    out = d.step(
        cached=[("a", 3, 4, None), ("b", 1, 1, None)],
        drafts=[[5, 6, 7], []],
        num_draft_tokens=2,
        draft_req_ids=["b"],
    )
    assert out.sampled_token_ids == [[5, 6, 7, 8], [52]]
    assert out.draft_token_ids == [[], [53, 54]]
    assert d.decode(["a", "b"]).draft_token_ids is None  # none asked for


def test_the_drafter_for_sampled_requests_guesses_their_samples() -> None:
    params = {"temperature": 1.0, "seed": 5}
    expected = _reference(params, 12)
    d = Driver(spec={"acceptance_rate": 1.0, "num_tokens": 3})
    out = d.step(new=[d.new("r", [10, 20, 30], **params)], num_draft_tokens=8)
    assert out.draft_token_ids == [expected[1:4]]  # capped at num_tokens
    d = Driver(spec={"acceptance_rate": 1.0, "wrong_positions": [2]})
    out = d.step(new=[d.new("r", [10, 20, 30], **params)], num_draft_tokens=3)
    assert out.draft_token_ids is not None
    drafts = out.draft_token_ids[0]
    assert drafts[0] == expected[1] and drafts[1] != expected[2]
    assert d.verify("r", drafts).sampled_token_ids == [expected[1:3]]


def test_latency_counts_drafts_and_drafting_only_when_asked() -> None:
    c = FakeTime()
    d = Driver(
        sleep=c.sleep,
        clock=c.clock,
        latency={"step_s": 0.005, "per_token_s": 0.0001},
        spec={"draft_latency": {"step_s": 0.001, "per_token_s": 0.00001}},
    )
    d.step(new=[d.new("a", [1, 2]), d.new("b", [3])])
    assert c.slept == [pytest.approx(0.005 + 3 * 0.0001, rel=0, abs=1e-12)]
    d.step(cached=[("a", 2, 3, None), ("b", 1, 1, None)], drafts=[[4, 5], []], num_draft_tokens=4)
    # 4 target tokens; 4 draft passes over 2 requests.
    assert c.slept[-1] == pytest.approx(0.005 + 4 * 0.0001 + 4 * (0.001 + 2 * 0.00001))
    a = d.backend.num_computed_tokens("a")
    d.step(cached=[("a", a, 1, None), ("b", 2, 1, None)], num_draft_tokens=2, draft_req_ids=["a"])
    assert c.slept[-1] == pytest.approx(0.005 + 2 * 0.0001 + 2 * (0.001 + 0.00001))
    c2 = FakeTime()
    d2 = Driver(
        sleep=c2.sleep,
        clock=c2.clock,
        latency={"step_s": 0.005},
        spec={"draft_latency": {"step_s": 0.001}, "parallel_drafting": True},
    )
    d2.step(new=[d2.new("a", [1, 2])], num_draft_tokens=4)
    assert c2.slept == [pytest.approx(0.006)]


def test_spec_support_and_cost_model() -> None:
    d = Driver(
        latency={"step_s": 0.005, "per_token_s": 5e-5},
        spec={"draft_latency": {"step_s": 0.001, "per_token_s": 1e-6}, "parallel_drafting": True},
    )
    cost = StepCostModel(
        step_s=0.005,
        per_token_s=5e-5,
        draft_step_s=0.001,
        draft_per_token_s=1e-6,
        parallel_drafting=True,
    )
    assert d.backend.step_cost_model() == cost
    assert d.backend.spec_support() == SpecSupport(
        proposers=["mock"], exact_verification=True, cost_model=cost
    )
    plain = Driver().backend
    assert plain.step_cost_model() is None
    assert plain.spec_support() == SpecSupport(proposers=["mock"])


@pytest.mark.parametrize(
    "options",
    [{}, {"spec": {"acceptance_rate": 0.5}}, {"copy_prompt": {"fraction": 0.5, "period": 8}}],
)
def test_the_mock_passes_the_speculative_decoding_conformance_kit(
    options: dict[str, object],
) -> None:
    check_spec_decode(
        MockBackend, EngineConfig(tokenizer="byte", max_model_len=512, backend_options=options)
    )


@pytest.mark.parametrize("p", [0.5, 0.7, 0.9])
def test_mean_acceptance_length_through_the_engine(p: float) -> None:
    """Static k = 4: the engine's counters give 1 + accepted / drafts within 3 % of
    ``(1 - p**5) / (1 - p)`` over more than 10k drafts."""
    k = 4
    core = EngineCore(
        EngineConfig(
            backend="mock",
            tokenizer="byte",
            max_num_seqs=64,
            max_model_len=1024,
            backend_options={"spec": {"acceptance_rate": p}},
            speculative_config=SpeculativeConfig(
                method="mock", num_speculative_tokens=k, dynamic=False
            ),
        )
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
        model = (1 - p ** (k + 1)) / (1 - p)
        num_requests = int(11 * model) + 1  # about 1000 / model drafts each: 11k drafts
        for i in range(num_requests):
            core.add_request(EngineCoreRequest(f"r{i}", [i % 250 + 1], params))
        while core.has_unfinished_requests():
            core.step()
        stats = core.get_stats()
    finally:
        core.close()
    assert stats.spec_num_drafts >= 10_000
    assert stats.spec_num_draft_tokens >= k * stats.spec_num_drafts - 4 * num_requests
    mean = 1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts
    assert abs(mean / model - 1) <= 0.03, (mean, model)


def test_drafts_after_the_last_prompt_token_keep_its_prompt_logprob() -> None:
    # A prefill chunk leaves the last prompt token; the next step computes it and drafts.
    d = Driver()
    out = d.step(new=[d.new("r", [1, 2, 3, 4], scheduled=3, prompt_logprobs=0)])
    assert out.sampled_token_ids == [[]]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs["r"]) == 3
    out = d.step(cached=[("r", 3, 3, None)], drafts=[[5, 6]])
    assert out.sampled_token_ids == [[5, 6, 7]]
    assert out.prompt_logprobs is not None
    assert [e.token_ids[0] for e in out.prompt_logprobs["r"]] == [4]
