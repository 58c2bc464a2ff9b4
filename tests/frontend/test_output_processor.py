from __future__ import annotations

import pytest
from helpers.clock import Clock

from engine_core._core.engine_io import EngineCoreOutputs, FinishedRequest
from engine_core._core.tokenizer import ByteTokenizer
from engine_core._frontend.collector import RequestOutputCollector
from engine_core._frontend.output_processor import OutputProcessor
from engine_core.abc import TokenLogprobs
from engine_core.errors import InvalidRequestError, RequestError, RetryableRequestError
from engine_core.outputs import Logprob, RequestOutput
from engine_core.sampling_params import RequestOutputKind, SamplingParams

CUMULATIVE = RequestOutputKind.CUMULATIVE
DELTA = RequestOutputKind.DELTA
FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def make_processor(clock: Clock | None = None) -> OutputProcessor:
    return OutputProcessor(ByteTokenizer(), max_model_len=64, clock=clock or Clock(100.0))


def step(
    tokens: dict[str, list[int]],
    finished: list[FinishedRequest] | None = None,
    **fields: object,
) -> EngineCoreOutputs:
    return EngineCoreOutputs(
        req_ids=list(tokens),
        new_token_ids=list(tokens.values()),
        finished=finished or [],
        **fields,  # type: ignore[arg-type]
    )


def length(req_id: str) -> FinishedRequest:
    return FinishedRequest(req_id, "length")


def texts(outputs: list[RequestOutput]) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_add_request_builds_engine_request() -> None:
    proc = make_processor()
    params = SamplingParams(max_tokens=None, temperature=0)
    (req,) = proc.add_request("r1", "abc", [97, 98, 99], params, arrival_time=5.0, priority=2)
    assert req.request_id == "r1"
    assert req.prompt_token_ids == [97, 98, 99]
    assert req.eos_token_ids == [257]
    assert req.sampling_params.max_tokens == 61  # max_model_len - prompt length
    assert params.max_tokens is None  # the caller's params are untouched
    assert (req.arrival_time, req.priority) == (5.0, 2)
    assert proc.num_unfinished_requests == 1
    with pytest.raises(ValueError, match="already in flight"):
        proc.add_request("r1", "abc", [97], params)


def test_cumulative_outputs() -> None:
    proc = make_processor()
    proc.add_request("r1", "abc", [97, 98, 99], SamplingParams(), external_id="user")
    outs = []
    outs += proc.process_outputs(step({"r1": [100]})).request_outputs
    outs += proc.process_outputs(step({"r1": [101]})).request_outputs
    outs += proc.process_outputs(step({"r1": [102]}, [length("r1")])).request_outputs
    assert texts(outs) == ["d", "de", "def"]
    assert [o.outputs[0].token_ids for o in outs] == [[100], [100, 101], [100, 101, 102]]
    assert [o.finished for o in outs] == [False, False, True]
    assert [o.outputs[0].finish_reason for o in outs] == [None, None, "length"]
    assert {o.request_id for o in outs} == {"user"}
    assert outs[0].prompt == "abc" and outs[0].prompt_token_ids == [97, 98, 99]
    assert not proc.has_unfinished_requests()


def run(proc: OutputProcessor, steps: list[EngineCoreOutputs]) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    for s in steps:
        outs += proc.process_outputs(s).request_outputs
    return outs


@pytest.mark.parametrize("stop", [None, "fgh"])
def test_delta_concatenation_equals_cumulative(stop: str | None) -> None:
    steps = [
        step({"r": [100]}),
        step({"r": [101, 102]}),
        step({"r": [103]}),
        step({"r": [104, 105]}, [length("r")]),
    ]
    results = {}
    for kind in (CUMULATIVE, DELTA, FINAL_ONLY):
        proc = make_processor()
        proc.add_request("r", None, [97], SamplingParams(output_kind=kind, stop=stop))
        results[kind] = run(proc, steps)
    cumulative, delta, final = results[CUMULATIVE], results[DELTA], results[FINAL_ONLY]
    expected = "de" if stop else "defghi"
    assert cumulative[-1].outputs[0].text == expected
    assert "".join(texts(delta)) == expected
    assert [o.finished for o in delta] == [False] * (len(delta) - 1) + [True]
    assert [t for o in delta for t in o.outputs[0].token_ids] == cumulative[-1].outputs[0].token_ids
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].text == expected
    assert final[0].outputs[0].token_ids == cumulative[-1].outputs[0].token_ids


def test_delta_holds_back_partial_stop_string() -> None:
    proc = make_processor()
    proc.add_request("r", None, [97], SamplingParams(output_kind=DELTA, stop="fg"))
    results = [
        proc.process_outputs(step({"r": [t]}))
        for t in (100, 101, 102, 103, 104)  # d e f g h: "h" arrives after the stop
    ]
    outs = [o for r in results for o in r.request_outputs]
    assert texts(outs) == ["", "d", "e", ""]
    assert [o.outputs[0].token_ids for o in outs] == [[100], [101], [102], [103]]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
    assert outs[-1].outputs[0].stop_reason == "fg"
    assert [r.reqs_to_abort for r in results] == [[], [], [], ["r"], []]


def test_stop_string_drops_later_tokens_of_the_step() -> None:
    proc = make_processor()
    proc.add_request("r", None, [97], SamplingParams(stop="e", include_stop_str_in_output=True))
    result = proc.process_outputs(step({"r": [100, 101, 102, 103]}))
    (out,) = result.request_outputs
    assert (out.outputs[0].text, out.outputs[0].token_ids) == ("de", [100, 101])
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", "e")
    assert result.reqs_to_abort == ["r"]


def test_stop_string_on_the_engine_last_step_needs_no_abort() -> None:
    proc = make_processor()
    proc.add_request("r", None, [97], SamplingParams(stop="d"))
    result = proc.process_outputs(step({"r": [100]}, [length("r")]))
    (out,) = result.request_outputs
    assert (out.outputs[0].text, out.outputs[0].finish_reason) == ("", "stop")
    assert result.reqs_to_abort == []


@pytest.mark.parametrize(
    ("params", "text"),
    [
        (SamplingParams(skip_special_tokens=False), "d"),
        (SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True), "d </s>"),
        (SamplingParams(), "d"),
    ],
)
def test_eos_from_engine(params: SamplingParams, text: str) -> None:
    proc = make_processor()
    proc.add_request("r", None, [97], params)
    (out,) = proc.process_outputs(
        step({"r": [100, 257]}, [FinishedRequest("r", "stop")])
    ).request_outputs
    c = out.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == (text, [100, 257], "stop", None)


def test_ignore_eos_keeps_control_tokens() -> None:
    proc = make_processor()
    proc.add_request("r", None, [97], SamplingParams(ignore_eos=True, skip_special_tokens=False))
    (out,) = proc.process_outputs(step({"r": [256, 257, 65]}, [length("r")])).request_outputs
    assert (out.outputs[0].text, out.outputs[0].finish_reason) == ("<s> </s> A", "length")


def test_stop_token_id_reported_as_stop_reason() -> None:
    proc = make_processor()
    proc.add_request("r", None, [97], SamplingParams(stop_token_ids=[101]))
    (out,) = proc.process_outputs(
        step({"r": [100, 101]}, [FinishedRequest("r", "stop", 101)])
    ).request_outputs
    c = out.outputs[0]
    assert (c.text, c.token_ids, c.stop_reason) == ("d", [100, 101], 101)


def test_error_from_engine() -> None:
    proc = make_processor()
    proc.add_request("bad", "x", [999], SamplingParams())
    proc.add_request("good", "a", [97], SamplingParams(max_tokens=1))
    finished = [FinishedRequest("bad", "error", None, "token ids [999] are outside the vocabulary")]
    outs = proc.process_outputs(step({"good": [98]}, [*finished, length("good")])).request_outputs
    by_id = {o.request_id: o for o in outs}
    bad = by_id["bad"]
    assert bad.finished and bad.error == "token ids [999] are outside the vocabulary"
    assert (bad.outputs[0].finish_reason, bad.outputs[0].text, bad.outputs[0].token_ids) == (
        "error",
        "",
        [],
    )
    assert by_id["good"].outputs[0].text == "b" and by_id["good"].error is None
    assert not proc.has_unfinished_requests()


def test_unknown_ids_are_ignored() -> None:
    proc = make_processor()
    result = proc.process_outputs(step({"ghost": [1]}, [length("ghost")]))
    assert result.request_outputs == [] and result.reqs_to_abort == []


def lp(*entries: tuple[int, float, int]) -> TokenLogprobs:
    return TokenLogprobs([e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries])


def test_logprobs_and_cumulative_logprob() -> None:
    proc = make_processor()
    proc.add_request("r", None, [97], SamplingParams(logprobs=1))
    proc.add_request("plain", None, [97], SamplingParams())
    first = step(
        {"r": [100], "plain": [100]},
        logprobs={"r": [lp((100, -0.5, 2), (120, -0.25, 1))]},
    )
    second = step(
        {"r": [101], "plain": [101]},
        [length("r"), length("plain")],
        logprobs={"r": [lp((101, -1.0, 1))]},
    )
    outs = run(proc, [first, second])
    r = [o for o in outs if o.request_id == "r"]
    assert r[0].outputs[0].logprobs == [{100: Logprob(-0.5, 2, "d"), 120: Logprob(-0.25, 1, "x")}]
    assert r[0].outputs[0].cumulative_logprob == -0.5
    assert r[1].outputs[0].logprobs == [
        {100: Logprob(-0.5, 2, "d"), 120: Logprob(-0.25, 1, "x")},
        {101: Logprob(-1.0, 1, "e")},
    ]
    assert r[1].outputs[0].cumulative_logprob == -1.5
    plain = [o for o in outs if o.request_id == "plain"]
    assert plain[-1].outputs[0].logprobs is None
    assert plain[-1].outputs[0].cumulative_logprob is None


def test_logprobs_of_tokens_after_a_stop_string_are_dropped() -> None:
    proc = make_processor()
    proc.add_request("r", None, [97], SamplingParams(logprobs=0, stop="d", output_kind=DELTA))
    entries = [lp((100, -1.0, 1)), lp((101, -2.0, 1))]
    (out,) = proc.process_outputs(step({"r": [100, 101]}, logprobs={"r": entries})).request_outputs
    assert out.outputs[0].logprobs == [{100: Logprob(-1.0, 1, "d")}]
    assert out.outputs[0].cumulative_logprob == -1.0
    assert out.outputs[0].token_ids == [100]


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA])
def test_prompt_logprobs(kind: RequestOutputKind) -> None:
    proc = make_processor()
    proc.add_request("r", None, [97, 98, 99], SamplingParams(prompt_logprobs=0, output_kind=kind))
    chunk1 = step({}, prompt_logprobs={"r": [None, lp((98, -0.5, 3))]})
    chunk2 = step({"r": [100]}, prompt_logprobs={"r": [lp((99, -0.25, 1))]})
    outs = run(proc, [chunk1, chunk2, step({"r": [101]})])
    expected = [None, {98: Logprob(-0.5, 3, "b")}, {99: Logprob(-0.25, 1, "c")}]
    assert outs[0].prompt_logprobs == expected
    assert outs[1].prompt_logprobs == (expected if kind == CUMULATIVE else None)


def test_metrics_and_cached_tokens() -> None:
    clock = Clock(100.0)
    proc = make_processor(clock)
    proc.add_request("r", None, [97], SamplingParams(max_tokens=2), arrival_time=99.5)
    clock.now = 101.0
    first = run(proc, [step({"r": [100]}, num_cached_tokens={"r": 16})])[0]
    clock.now = 102.5
    last = run(proc, [step({"r": [101]}, [length("r")])])[0]
    assert first.num_cached_tokens == 16 and last.num_cached_tokens == 16
    assert first.metrics is not None and last.metrics is not None
    m1, m2 = first.metrics, last.metrics
    assert (m1.arrival_time, m1.first_token_time, m1.last_token_time, m1.finished_time) == (
        99.5,
        101.0,
        101.0,
        None,
    )
    assert (m2.arrival_time, m2.first_token_time, m2.last_token_time, m2.finished_time) == (
        99.5,
        101.0,
        102.5,
        102.5,
    )
    assert m2.time_to_first_token == 1.5


def test_parallel_sampling_fans_out() -> None:
    proc = make_processor()
    params = SamplingParams(n=3, seed=7, prompt_logprobs=1)
    reqs = proc.add_request("p", None, [97], params, external_id="user")
    assert [r.request_id for r in reqs] == ["0_p", "1_p", "2_p"]
    assert [r.sampling_params.seed for r in reqs] == [7, 8, 9]
    assert [r.sampling_params.n for r in reqs] == [1, 1, 1]
    assert [r.sampling_params.prompt_logprobs for r in reqs] == [1, None, None]
    unseeded = proc.add_request("q", None, [97], SamplingParams(n=2))
    assert [r.sampling_params.seed for r in unseeded] == [None, None]
    assert proc.num_unfinished_requests == 2


def test_parallel_sampling_cumulative_streams_changed_completions() -> None:
    proc = make_processor()
    proc.add_request("p", None, [97], SamplingParams(n=3, seed=1), external_id="user")
    outs = run(
        proc,
        [
            step({"0_p": [100], "1_p": [110]}),
            step({"0_p": [101], "2_p": [120]}, [length("0_p")]),
            step({"1_p": [111], "2_p": [121]}, [length("1_p"), length("2_p")]),
        ],
    )
    assert [[(c.index, c.text) for c in o.outputs] for o in outs] == [
        [(0, "d"), (1, "n")],
        [(0, "de"), (2, "x")],
        [(1, "no"), (2, "xy")],
    ]
    assert [o.finished for o in outs] == [False, False, True]
    assert {o.request_id for o in outs} == {"user"}
    assert not proc.has_unfinished_requests()


def test_parallel_sampling_final_only_aggregates_once() -> None:
    proc = make_processor()
    proc.add_request("p", None, [97], SamplingParams(n=3, seed=1, output_kind=FINAL_ONLY))
    outs = run(
        proc,
        [
            step({"2_p": [120], "0_p": [100]}, [length("2_p")]),
            step({"0_p": [101], "1_p": [110]}, [length("0_p")]),
            step({"1_p": [111]}, [length("1_p")]),
        ],
    )
    (out,) = outs
    assert out.finished
    assert [(c.index, c.text, c.token_ids) for c in out.outputs] == [
        (0, "de", [100, 101]),
        (1, "no", [110, 111]),
        (2, "x", [120]),
    ]


def test_finished_child_ignores_late_tokens() -> None:
    proc = make_processor()
    proc.add_request("p", None, [97], SamplingParams(n=2, stop="d"))
    first = proc.process_outputs(step({"0_p": [100], "1_p": [110]}))
    assert first.reqs_to_abort == ["0_p"]
    (late,) = run(proc, [step({"0_p": [101], "1_p": [111]})])
    assert [(c.index, c.text) for c in late.outputs] == [(1, "no")]


def test_abort_by_internal_and_external_id() -> None:
    proc = make_processor()
    proc.add_request("a1", None, [97], SamplingParams(), external_id="user")
    proc.add_request("a2", None, [97], SamplingParams(n=2), external_id="user")
    proc.add_request("b", None, [97], SamplingParams(n=2))
    assert proc.abort_request("b") == ["0_b", "1_b"]
    assert proc.abort_request("user") == ["a1", "0_a2", "1_a2"]
    assert proc.abort_request("user") == []
    assert not proc.has_unfinished_requests()
    assert run(proc, [step({"a1": [100], "0_b": [100]})]) == []


def test_abort_of_a_child_id_aborts_the_parent() -> None:
    proc = make_processor()
    proc.add_request("p", None, [97], SamplingParams(n=2))
    proc.process_outputs(step({"0_p": [100]}, [length("0_p")]))
    assert proc.abort_request("1_p") == ["1_p"]
    assert not proc.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kind", "text", "token_ids"),
    [(CUMULATIVE, "de", [100, 101]), (DELTA, "", []), (FINAL_ONLY, "de", [100, 101])],
)
def test_collector_receives_outputs_and_abort(
    kind: RequestOutputKind, text: str, token_ids: list[int]
) -> None:
    proc = make_processor()
    collector = RequestOutputCollector(kind)
    proc.add_request("r", None, [97], SamplingParams(output_kind=kind), collector=collector)
    result = proc.process_outputs(step({"r": [100]}))
    assert result.request_outputs == []
    if kind != FINAL_ONLY:
        got = collector.get_nowait()
        assert got is not None and got.outputs[0].text == "d"
    proc.process_outputs(step({"r": [101]}))
    if kind == DELTA:
        assert collector.get_nowait() is not None
    assert proc.abort_request("r") == ["r"]
    got = collector.get_nowait()
    assert got is not None and got.finished
    c = got.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason) == (text, token_ids, "abort")


def test_a_collector_of_another_output_kind_is_refused() -> None:
    proc = make_processor()
    with pytest.raises(ValueError, match="collector is for DELTA outputs, the request asks for"):
        proc.add_request("r", None, [97], SamplingParams(), collector=RequestOutputCollector(DELTA))
    assert not proc.has_unfinished_requests()


def test_collector_merges_parallel_outputs() -> None:
    proc = make_processor()
    collector = RequestOutputCollector(DELTA)
    params = SamplingParams(n=2, seed=0, output_kind=DELTA)
    proc.add_request("p", None, [97], params, collector=collector)
    proc.process_outputs(step({"0_p": [100], "1_p": [110]}))
    proc.process_outputs(step({"0_p": [101], "1_p": [111]}, [length("0_p"), length("1_p")]))
    got = collector.get_nowait()
    assert got is not None and got.finished
    assert [(c.index, c.text, c.token_ids) for c in got.outputs] == [
        (0, "de", [100, 101]),
        (1, "no", [110, 111]),
    ]


def test_propagate_error_reaches_collectors() -> None:
    proc = make_processor()
    collector = RequestOutputCollector(CUMULATIVE)
    proc.add_request("r", None, [97], SamplingParams(), collector=collector)
    proc.propagate_error(RuntimeError("engine died"))
    with pytest.raises(RuntimeError, match="engine died"):
        collector.get_nowait()


def test_detokenize_false() -> None:
    proc = make_processor()
    proc.add_request("r", None, [97], SamplingParams(detokenize=False, logprobs=0))
    entries = {"r": [lp((100, -1.0, 1))]}
    (out,) = proc.process_outputs(
        step({"r": [100]}, [length("r")], logprobs=entries)
    ).request_outputs
    assert out.outputs[0].text == "" and out.outputs[0].token_ids == [100]
    assert out.outputs[0].logprobs == [{100: Logprob(-1.0, 1, None)}]


@pytest.mark.parametrize(
    ("retryable", "error_type"), [(False, InvalidRequestError), (True, RetryableRequestError)]
)
def test_engine_error_is_raised_through_the_collector(
    retryable: bool, error_type: type[RequestError]
) -> None:
    proc = make_processor()
    collector = RequestOutputCollector(CUMULATIVE)
    proc.add_request("r", None, [97], SamplingParams(), external_id="user", collector=collector)
    fin = FinishedRequest("r", "error", None, "the engine is paused", retryable)
    result = proc.process_outputs(step({}, [fin]))
    assert result.request_outputs == [] and result.reqs_to_abort == []
    with pytest.raises(error_type, match="the engine is paused") as info:
        collector.get_nowait()
    assert type(info.value) is error_type
    assert info.value.request_id == "user"
    assert not proc.has_unfinished_requests()


def test_engine_error_of_one_child_ends_the_parent() -> None:
    proc = make_processor()
    collector = RequestOutputCollector(CUMULATIVE)
    proc.add_request("p", None, [97], SamplingParams(n=3, seed=0), collector=collector)
    proc.process_outputs(step({"1_p": [100]}, [length("1_p")]))
    assert collector.get_nowait() is not None
    failed = FinishedRequest("0_p", "error", None, "no room")
    result = proc.process_outputs(step({"2_p": [110]}, [failed]))
    assert result.reqs_to_abort == ["2_p"]
    with pytest.raises(InvalidRequestError, match="no room"):
        collector.get_nowait()
    assert not proc.has_unfinished_requests()
