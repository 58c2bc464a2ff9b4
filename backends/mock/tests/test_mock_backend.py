"""The mock backend: the conformance suite, its token rules, logprobs and an engine end to end."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from array import array
from typing import Any

import msgspec
import pytest
from engine_core_mock import MockBackend
from mock_driver import Driver
from xxhash import xxh3_64_intdigest

from engine_core._core.engine_io import EngineCoreRequest, FinishedRequest
from engine_core._engine.core import EngineCore
from engine_core.abc import (
    AsyncModelRunnerOutput,
    CachedRequestData,
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams, StructuredOutputsParams
from engine_core.testing import BACKEND_CHECKS, check_backend

LN2 = math.log(2.0)
CONSTRAINED = StructuredOutputsParams(regex="[a-z]+")

# -- conformance ---------------------------------------------------------------------------------

CONFIGS = {
    "default": None,
    "block-4": EngineConfig(tokenizer="byte", block_size=4, max_model_len=256),
    "block-32-vocab-32000": EngineConfig(
        block_size=32, max_model_len=1024, backend_options={"vocab_size": 32000}
    ),
}


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
@pytest.mark.parametrize("check", BACKEND_CHECKS, ids=lambda c: c.__name__)
def test_conformance(check: Any, config: EngineConfig | None) -> None:
    check(MockBackend, config)


class TokenOnPartialChunk(MockBackend):
    def sample_tokens(self, grammar_bitmask: Any | None) -> ModelRunnerOutput:
        output = super().sample_tokens(grammar_bitmask)
        output.sampled_token_ids = [t or [0] for t in output.sampled_token_ids]
        return output


class ReversedBatch(MockBackend):
    def sample_tokens(self, grammar_bitmask: Any | None) -> ModelRunnerOutput:
        output = super().sample_tokens(grammar_bitmask)
        output.req_ids.reverse()
        output.sampled_token_ids.reverse()
        return output


class BatchDependentGreedy(MockBackend):
    def sample_tokens(self, grammar_bitmask: Any | None) -> ModelRunnerOutput:
        output = super().sample_tokens(grammar_bitmask)
        size = len(output.req_ids)
        output.sampled_token_ids = [
            [(t + size) % 256 for t in ts] for ts in output.sampled_token_ids
        ]
        return output


class NoPromptLogprobs(MockBackend):
    def sample_tokens(self, grammar_bitmask: Any | None) -> ModelRunnerOutput:
        output = super().sample_tokens(grammar_bitmask)
        output.prompt_logprobs = None
        return output


class TokensKnownOnlyOnTheHost(MockBackend):
    """Claims async scheduling but learns a step's sampled tokens only when the core takes
    them, so it cannot run the next step, scheduled before that."""

    def sample_tokens_async(self, grammar_bitmask: Any | None) -> AsyncModelRunnerOutput:
        batch = list(self._batch or [])
        sizes = [len(state.tokens) for state in batch]
        output = self._sample(grammar_bitmask)
        for state, size in zip(batch, sizes, strict=True):
            del state.tokens[size:]  # forget them until get_output

        class Later(AsyncModelRunnerOutput):
            def get_output(self) -> ModelRunnerOutput:
                for state, tokens in zip(batch, output.sampled_token_ids, strict=True):
                    state.tokens += tokens
                return output

        return Later()


def test_suite_runs_async_backends_with_a_step_in_flight() -> None:
    with pytest.raises(RuntimeError, match="cannot schedule 1 tokens after"):
        check_backend(TokensKnownOnlyOnTheHost)


@pytest.mark.parametrize(
    ("backend_cls", "message"),
    [
        (TokenOnPartialChunk, "ran a partial prefill chunk but got tokens"),
        (ReversedBatch, "the batch order is"),
        (BatchDependentGreedy, "decode in a mixed batch: got tokens"),
        (NoPromptLogprobs, "expected 20 prompt logprobs entries, got 0"),
    ],
)
def test_suite_rejects_broken_backends(backend_cls: type[MockBackend], message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_backend(backend_cls)


# -- greedy --------------------------------------------------------------------------------------


def test_greedy_counts_up_from_the_last_prompt_token() -> None:
    d = Driver()
    assert d.run([d.new("r", b"abc")], 4) == {"r": list(b"defg")}


def test_greedy_wraps_around_the_vocabulary() -> None:
    d = Driver()
    assert d.run([d.new("r", [255])], 4) == {"r": [256, 257, 0, 1]}


def test_resumed_request_continues_from_its_outputs() -> None:
    d = Driver()
    output = d.step(new=[d.new("r", [10, 11], outputs=[50, 51])])
    assert output.sampled_token_ids == [[52]]


def test_partial_prefill_chunks_give_no_token_until_the_last() -> None:
    d = Driver()
    first = d.step(new=[d.new("r", list(range(10)), scheduled=4)])
    second = d.step(cached=[("r", 4, 4, None)])
    last = d.step(cached=[("r", 8, 2, None)])
    assert [first.sampled_token_ids, second.sampled_token_ids, last.sampled_token_ids] == [
        [[]],
        [[]],
        [[10]],
    ]


def test_batch_order_is_cached_then_new() -> None:
    d = Driver()
    d.step(new=[d.new("old", [1])])
    output = d.step(new=[d.new("young", [100])], cached=[("old", 1, 1, None)])
    assert output.req_ids == ["old", "young"]
    assert output.sampled_token_ids == [[3], [101]]


# -- seeded sampling -----------------------------------------------------------------------------


def _sampled(
    seed: int | None, *, batch: bool = False, engine_seed: int = 0, req_id: str = "r"
) -> list[int]:
    d = Driver(seed=engine_seed)
    requests = [d.new(req_id, [1, 2, 3], temperature=1.0, seed=seed)]
    if batch:
        requests = [
            d.new("before", [9] * 7, temperature=0.7, seed=5),
            *requests,
            d.new("after", [4], temperature=0.0),
        ]
    return d.run(requests, 8)[req_id]


def test_seeded_sampling_is_the_stable_hash_of_seed_and_history() -> None:
    tokens = _sampled(7)
    expected_first = xxh3_64_intdigest(array("I", [1, 2, 3]).tobytes(), seed=7) % 258
    expected_second = xxh3_64_intdigest(array("I", [1, 2, 3, tokens[0]]).tobytes(), seed=7) % 258
    assert tokens[:2] == [expected_first, expected_second]


def test_seeded_sampling_ignores_the_batch_and_the_instance() -> None:
    alone = _sampled(7)
    assert _sampled(7, batch=True) == alone
    assert _sampled(7) == alone


def test_seeded_sampling_differs_across_seeds() -> None:
    assert _sampled(7) != _sampled(8)


def test_unseeded_sampling_derives_the_seed_from_engine_seed_and_request_id() -> None:
    reference = _sampled(None, engine_seed=1, req_id="a")
    assert _sampled(None, engine_seed=1, req_id="a") == reference
    assert _sampled(None, engine_seed=2, req_id="a") != reference
    assert _sampled(None, engine_seed=1, req_id="b") != reference


def test_seeded_sampling_is_identical_in_another_process() -> None:
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_mock_backend as t; "
        "print(t._sampled(7), t._sampled(None, req_id='x'))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    here = os.path.dirname(__file__)
    result = subprocess.run(
        [sys.executable, "-c", script, here], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.strip() == f"{_sampled(7)} {_sampled(None, req_id='x')}"


# -- masks ---------------------------------------------------------------------------------------


def test_eos_is_masked_until_min_tokens_then_allowed() -> None:
    d = Driver()
    masked = d.new("masked", [254], eos=[257], min_tokens=3)
    allowed = d.new("allowed", [254], eos=[257], min_tokens=2)
    assert d.run([masked, allowed], 4) == {
        "masked": [255, 256, 0, 1],
        "allowed": [255, 256, 257, 0],
    }


def test_stop_token_ids_are_masked_until_min_tokens() -> None:
    d = Driver()
    assert d.run([d.new("r", [9], stop_token_ids=[10, 11], min_tokens=1)], 3) == {"r": [12, 13, 14]}


def _words(*allowed: int, vocab_size: int = 258) -> list[int]:
    """A bitmask row as signed int32 words, as a numpy int32 row would hold them."""
    words = [0] * -(-vocab_size // 32)
    for token in allowed:
        words[token // 32] |= 1 << (token % 32)
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


def test_bitmask_picks_the_first_allowed_token_at_or_after_the_rule() -> None:
    d = Driver()
    first = d.step(new=[d.new("r", [14], structured_outputs=CONSTRAINED)], bitmask=[_words(8, 20)])
    second = d.step(cached=[("r", 1, 1, None)], bitmask=[_words(8, 20)])
    third = d.step(cached=[("r", 2, 1, None)], bitmask=[_words(5, 31)])
    # Whitespace (a newline, 10; a space, 32) only when nothing else is allowed, and then by
    # the same rule (after 33 comes 34: wrapping around, 10 is the first).
    fourth = d.step(cached=[("r", 3, 1, None)], bitmask=[_words(10, 33)])
    fifth = d.step(cached=[("r", 4, 1, None)], bitmask=[_words(10, 32)])
    assert [
        first.sampled_token_ids,
        second.sampled_token_ids,
        third.sampled_token_ids,
        fourth.sampled_token_ids,
        fifth.sampled_token_ids,
    ] == [[[20]], [[8]], [[31]], [[33]], [[10]]]


def test_bitmask_rows_follow_the_constrained_requests_of_the_batch() -> None:
    d = Driver()
    requests = [
        d.new("free", [1]),
        d.new("c1", [1], structured_outputs=CONSTRAINED),
        d.new("partial", [1, 2, 3], scheduled=1, structured_outputs=CONSTRAINED),
        d.new("c2", [1], structured_outputs=CONSTRAINED),
    ]
    # The partial prefill chunk samples nothing and has no row.
    with_partial = d.step(new=requests[:3], bitmask=[_words(40)])
    without_partial = d.step(
        new=[requests[3]],
        cached=[("free", 1, 1, None), ("c1", 1, 1, None), ("partial", 1, 1, None)],
        bitmask=[_words(60), _words(70)],
    )
    assert with_partial.sampled_token_ids == [[2], [40], []]
    assert without_partial.sampled_token_ids == [[3], [60], [], [70]]


def test_a_bitmask_row_for_a_partial_prefill_chunk_raises() -> None:
    d = Driver()
    requests = [
        d.new("c1", [1], structured_outputs=CONSTRAINED),
        d.new("partial", [1, 2, 3], scheduled=1, structured_outputs=CONSTRAINED),
    ]
    with pytest.raises(RuntimeError, match="grammar bitmask has 2 rows but the batch has 1"):
        d.step(new=requests, bitmask=[_words(40), _words(50)])


def test_bitmask_and_min_tokens_mask_together() -> None:
    d = Driver()
    request = d.new("r", [256], eos=[257], min_tokens=1, structured_outputs=CONSTRAINED)
    assert d.step(new=[request], bitmask=[_words(5, 257)]).sampled_token_ids == [[5]]


def test_a_bitmask_that_allows_nothing_keeps_the_rules_token() -> None:
    # A model's sampler would draw from all -inf logits: the mock keeps its own token, which
    # the grammar check then refuses (the request ends with an error, not the engine).
    d = Driver()
    request = d.new("r", [1], structured_outputs=CONSTRAINED)
    assert d.step(new=[request], bitmask=[_words()]).sampled_token_ids == [[2]]
    stop_only = d.new("s", [256], eos=[257], min_tokens=1, structured_outputs=CONSTRAINED)
    # Not the stop id min_tokens masks: the next token after it (wrapping around).
    assert d.step(new=[stop_only], bitmask=[_words(257)]).sampled_token_ids == [[0]]


def test_a_bitmask_with_the_wrong_number_of_rows_raises() -> None:
    d = Driver()
    request = d.new("r", [1], structured_outputs=CONSTRAINED)
    with pytest.raises(RuntimeError, match="grammar bitmask has 2 rows"):
        d.step(new=[request], bitmask=[_words(1), _words(2)])


def test_numpy_bitmask() -> None:
    np = pytest.importorskip("numpy")
    d = Driver()
    request = d.new("r", [14], structured_outputs=CONSTRAINED)
    bitmask = np.array([_words(31, 200)], dtype=np.int32)
    assert d.step(new=[request], bitmask=bitmask).sampled_token_ids == [[31]]


# -- logprobs ------------------------------------------------------------------------------------


def test_greedy_logprobs_put_the_token_first_then_the_top_k() -> None:
    d = Driver()
    output = d.step(new=[d.new("r", [100], logprobs=2), d.new("plain", [7])])
    assert output.logprobs == [
        [TokenLogprobs([101, 101, 102], [-LN2, -LN2, -2 * LN2], [1, 1, 2])],
        None,
    ]


def test_sampled_logprobs_rank_the_token_around_the_greedy_one() -> None:
    d = Driver()
    output = d.step(new=[d.new("r", [100], temperature=1.0, seed=3, logprobs=0)])
    token = output.sampled_token_ids[0][0]
    rank = (token - 101) % 258 + 1
    assert output.logprobs == [[TokenLogprobs([token], [-rank * LN2], [rank])]]


def test_no_logprobs_when_none_are_asked() -> None:
    d = Driver()
    output = d.step(new=[d.new("r", [100])])
    assert (output.logprobs, output.prompt_logprobs) == (None, None)


def test_prompt_logprobs_cover_the_positions_computed_in_each_step() -> None:
    d = Driver()
    first = d.step(new=[d.new("r", [5, 7, 6], scheduled=2, prompt_logprobs=1)])
    second = d.step(cached=[("r", 2, 1, None)])
    third = d.step(cached=[("r", 3, 1, None)])
    assert first.prompt_logprobs == {"r": [None, TokenLogprobs([7, 6], [-2 * LN2, -LN2], [2, 1])]}
    assert second.prompt_logprobs == {"r": [TokenLogprobs([6, 8], [-257 * LN2, -LN2], [257, 1])]}
    assert (second.sampled_token_ids, third.prompt_logprobs) == ([[7]], None)


def test_resumed_request_does_not_repeat_prompt_logprobs() -> None:
    d = Driver()
    output = d.step(new=[d.new("r", [5, 7], outputs=[8], prompt_logprobs=1)])
    assert (output.sampled_token_ids, output.prompt_logprobs) == ([[9]], None)


# -- the engine end to end -----------------------------------------------------------------------


def _engine_run(
    core: EngineCore, requests: list[EngineCoreRequest]
) -> tuple[dict[str, list[int]], list[FinishedRequest]]:
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finished: list[FinishedRequest] = []
    while core.has_unfinished_requests():
        outputs = core.step()
        for req_id, new_tokens in zip(outputs.req_ids, outputs.new_token_ids, strict=True):
            tokens[req_id] += new_tokens
        finished += outputs.finished
    return tokens, finished


def test_engine_core_runs_requests_to_completion_on_the_mock() -> None:
    core = EngineCore(EngineConfig(backend="mock", tokenizer="byte", max_model_len=512))
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    requests = [
        EngineCoreRequest("abc", list(b"abc"), greedy),
        EngineCoreRequest("eos", [250], greedy.clone(max_tokens=10), eos_token_ids=[257]),
        EngineCoreRequest(
            "min", [254], greedy.clone(max_tokens=5, min_tokens=3), eos_token_ids=[257]
        ),
        EngineCoreRequest("long", list(range(40)) * 10, greedy.clone(max_tokens=3)),
    ]
    try:
        tokens, finished = _engine_run(core, requests)
        assert isinstance(core.backend, MockBackend)
        assert core.num_kv_blocks == 7372
    finally:
        core.close()
    assert tokens == {
        "abc": list(b"defg"),
        "eos": [251, 252, 253, 254, 255, 256, 257],
        "min": [255, 256, 0, 1, 2],
        "long": [40, 41, 42],
    }
    assert sorted((f.req_id, f.finish_reason) for f in finished) == [
        ("abc", "length"),
        ("eos", "stop"),
        ("long", "length"),
        ("min", "length"),
    ]


def test_engine_core_with_prefix_caching_and_preemption_keeps_exact_tokens() -> None:
    # 8 blocks of 4 tokens for three 14-token prompts (3 shared blocks) growing to 21 tokens.
    config = EngineConfig(
        backend="mock",
        tokenizer="byte",
        block_size=4,
        num_kv_blocks=8,
        max_model_len=32,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        async_scheduling=False,  # the figures below are those of the synchronous schedule
    )
    core = EngineCore(config)
    shared = list(b"shared prefix")
    params = SamplingParams(temperature=0.0, max_tokens=7)
    requests = [EngineCoreRequest(f"r{i}", [*shared, 65 + i], params) for i in range(3)]
    try:
        tokens, _ = _engine_run(core, requests)
        stats = core.get_stats()
    finally:
        core.close()
    assert tokens == {f"r{i}": list(range(66 + i, 73 + i)) for i in range(3)}
    assert (stats.num_preemptions, stats.prefix_cache_hits) == (1, 40)


def test_a_decoded_scheduler_output_works() -> None:
    # The engine may send SchedulerOutputs across a process boundary as msgpack.
    d = Driver()
    scheduler_output = SchedulerOutput([d.new("r", [1, 2], logprobs=1)], CachedRequestData(), 2)
    encoded = msgspec.msgpack.encode(scheduler_output)
    d.backend.execute_model(msgspec.msgpack.decode(encoded, type=SchedulerOutput))
    output = d.backend.sample_tokens(None)
    assert output.sampled_token_ids == [[3]]
    assert output.logprobs == [[TokenLogprobs([3, 3], [-LN2, -LN2], [1, 1])]]


def test_steps_run_in_a_thread_only_when_they_block() -> None:
    from engine_core_mock import MockBackend

    from engine_core.config import EngineConfig

    def make(**options: object) -> MockBackend:
        return MockBackend(EngineConfig(tokenizer="byte", backend_options=options))

    assert make().step_in_thread is False
    assert make(latency={"step_s": 0.001}).step_in_thread is True
    assert make(fault={"kind": "hang", "at_step": 3}).step_in_thread is True


def test_a_fault_with_a_rank_hits_that_engine_only() -> None:
    from engine_core_mock import MockBackend

    from engine_core.config import EngineConfig

    def make(rank: int) -> MockBackend:
        fault = {"kind": "exit", "at_step": 2, "rank": 1}
        config = EngineConfig(
            tokenizer="byte",
            data_parallel_size=2,
            data_parallel_rank=rank,
            backend_options={"fault": fault},
        )
        return MockBackend(config)

    assert make(0).fault is None
    fault = make(1).fault
    assert fault is not None and (fault.kind, fault.at_step, fault.rank) == ("exit", 2, 1)
