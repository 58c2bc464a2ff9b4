"""CUMULATIVE outputs: made from deltas by their reader, exactly what they always were.

The output processor emits deltas; a CUMULATIVE request's collector (or, without one, the
processor as it returns outputs) makes them cumulative. These tests pin both halves: the output
handler's work per step does not grow with what a stream produced already, and what consumers
see is the same as when every step copied the whole completion (a model of that behaviour is
the reference).
"""

from __future__ import annotations

import tracemalloc
from dataclasses import dataclass, field

import anyio
import pytest
from helpers.clock import Clock, unpaced
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core import AsyncLLM
from engine_core._core.engine_io import EngineCoreOutputs, FinishedRequest
from engine_core._core.tokenizer import ByteTokenizer
from engine_core._frontend.collector import RequestOutputCollector
from engine_core._frontend.output_processor import OutputProcessor
from engine_core.abc import TokenLogprobs
from engine_core.outputs import CompletionOutput, Logprob, RequestOutput
from engine_core.sampling_params import RequestOutputKind, SamplingParams

CUMULATIVE = RequestOutputKind.CUMULATIVE
DELTA = RequestOutputKind.DELTA
FINAL = RequestOutputKind.FINAL_ONLY


def lp(token: int, logprob: float) -> TokenLogprobs:
    """The sampled token first, then one more candidate."""
    return TokenLogprobs([token, 120], [logprob, -3.0], [1, 2])


def message(
    tokens: dict[str, list[int]],
    finished: dict[str, str] | None = None,
    *,
    logprobs: bool = False,
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] | None = None,
) -> EngineCoreOutputs:
    return EngineCoreOutputs(
        req_ids=list(tokens),
        new_token_ids=list(tokens.values()),
        finished=[FinishedRequest(rid, reason) for rid, reason in (finished or {}).items()],
        logprobs=(
            {rid: [lp(t, -0.25 * (k + 1)) for k, t in enumerate(ts)] for rid, ts in tokens.items()}
            if logprobs
            else {}
        ),
        prompt_logprobs=prompt_logprobs or {},
    )


# -- the output handler's work per step ---------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("consumer_reads", [True, False], ids=["reading", "behind"])
def test_a_step_costs_the_output_handler_the_same_however_long_the_stream(
    n: int, consumer_reads: bool
) -> None:
    """Memory a step allocates in the output handler (the processor and the collector's put)
    is the measure of its work: copying a 50,000-token completion allocates 400 kB per list."""
    proc = OutputProcessor(ByteTokenizer(), clock=Clock(100.0))
    collector = RequestOutputCollector(CUMULATIVE, clock=unpaced())
    params = SamplingParams(n=n, seed=0, logprobs=1, stop="zz", max_tokens=None)
    proc.add_request("r", None, [97], params, collector=collector)
    ids = ["r"] if n == 1 else [f"{i}_r" for i in range(n)]
    long = 50_000
    proc.process_outputs(message({rid: [98] * long for rid in ids}, logprobs=True))
    assert collector.get_nowait() is not None  # the consumer takes the long output
    steps = [message({rid: [99] for rid in ids}, logprobs=True) for _ in range(5)]
    allocated = []
    tracemalloc.start()
    try:
        for s in steps:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            proc.process_outputs(s)
            allocated.append(tracemalloc.get_traced_memory()[1] - before)
            if consumer_reads:
                collector.get_nowait()  # the consumer's copy, in its own task: not measured
    finally:
        tracemalloc.stop()
    assert max(allocated) < 32_000, allocated
    last = collector.get_nowait()
    if not consumer_reads:
        assert last is not None
        expected_ids = [98] * long + [99] * 5
        # While the stream runs, len("zz") - 1 characters are held back for the stop string.
        expected_text = "b" * long + "c" * 4
        for i, c in enumerate(last.outputs):
            assert (c.index, c.token_ids == expected_ids, c.text == expected_text) == (
                i,
                True,
                True,
            )
        assert all(c.logprobs is not None and len(c.logprobs) == long + 5 for c in last.outputs)


# -- the same outputs as a whole copy at every step ---------------------------------------------


@dataclass
class Total:
    """A completion so far, as the old processor kept it."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None


Shown = tuple[int, str, list[int], float | None, list[dict[int, Logprob]] | None, object, object]


def shown(c: CompletionOutput) -> Shown:
    """Everything a completion shows, copied (so later changes to it would be seen)."""
    logprobs = None if c.logprobs is None else [dict(p) for p in c.logprobs]
    return (
        c.index,
        c.text,
        list(c.token_ids),
        c.cumulative_logprob,
        logprobs,
        c.finish_reason,
        c.stop_reason,
    )


class WholeCopyModel:
    """CUMULATIVE as it was: each delta applied to a per-completion total and the whole total
    copied out; a collector that keeps, per index, the newest copy (new indices appended)."""

    def __init__(self, n: int, logprobs: bool) -> None:
        self.totals = {
            i: Total(
                logprobs=[] if logprobs else None, cumulative_logprob=0.0 if logprobs else None
            )
            for i in range(n)
        }
        self.pending: dict[int, Shown] | None = None
        self.finished = False

    def apply(self, delta: RequestOutput) -> list[Shown]:
        copies = []
        for c in delta.outputs:
            total = self.totals[c.index]
            total.text += c.text
            total.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                assert total.logprobs is not None
                total.logprobs.extend(c.logprobs)
            total.cumulative_logprob = c.cumulative_logprob
            total.finish_reason = c.finish_reason
            copies.append(
                (
                    c.index,
                    total.text,
                    list(total.token_ids),
                    c.cumulative_logprob,
                    None if total.logprobs is None else list(total.logprobs),
                    c.finish_reason,
                    c.stop_reason,
                )
            )
        return copies

    def put(self, copies: list[Shown], finished: bool) -> None:
        if self.pending is None:
            self.pending = {}
        self.pending.update({c[0]: c for c in copies})
        self.finished = self.finished or finished

    def abort(self) -> None:
        """The old abort output: each unfinished completion whole, ended "abort"."""
        copies: list[Shown] = [
            (i, t.text, t.token_ids, t.cumulative_logprob, t.logprobs, "abort", None)
            for i, t in self.totals.items()
            if t.finish_reason is None
        ]
        if copies:
            self.put(copies, True)

    def take(self) -> tuple[bool, list[Shown]] | None:
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        return self.finished, list(pending.values())


ALPHABET = [97, 98, 99, 0xC3, 0xA9, 122]  # a b c, the two bytes of "é", z


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, object]:
    n = draw(st.integers(1, 3))
    steps = []
    for _ in range(draw(st.integers(1, 10))):
        tokens = {
            i: draw(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=3))
            for i in range(n)
            if draw(st.booleans())
        }
        finished = {
            i: draw(st.sampled_from(["length", "stop"]))
            for i in range(n)
            if draw(st.integers(0, 4)) == 0
        }
        steps.append((tokens, finished, draw(st.booleans())))
    return {
        "n": n,
        "logprobs": draw(st.booleans()),
        "prompt_logprobs": draw(st.booleans()),
        "stop": draw(st.sampled_from([None, "ca", "é", ["zz", "bb"]])),
        "include_stop": draw(st.booleans()),
        "steps": steps,
        "abort": draw(st.booleans()),
    }


def _engine_messages(scenario: dict[str, object]) -> list[EngineCoreOutputs]:
    n = scenario["n"]
    assert isinstance(n, int)
    ids = ["r"] if n == 1 else [f"{i}_r" for i in range(n)]
    messages = []
    for k, (tokens, finished, _read) in enumerate(scenario["steps"]):  # type: ignore[attr-defined]
        prompt = None
        if k == 0 and scenario["prompt_logprobs"]:
            prompt = {ids[0]: [None, TokenLogprobs([98, 97], [-0.5, -1.5], [1, 2])]}
        messages.append(
            message(
                {ids[i]: ts for i, ts in tokens.items()},
                {ids[i]: reason for i, reason in finished.items()},
                logprobs=bool(scenario["logprobs"]),
                prompt_logprobs=prompt,
            )
        )
    return messages


def _params(scenario: dict[str, object], kind: RequestOutputKind) -> SamplingParams:
    return SamplingParams(
        n=scenario["n"],  # type: ignore[arg-type]
        seed=0,
        logprobs=1 if scenario["logprobs"] else None,
        prompt_logprobs=0 if scenario["prompt_logprobs"] else None,
        stop=scenario["stop"],  # type: ignore[arg-type]
        include_stop_str_in_output=bool(scenario["include_stop"]),
        output_kind=kind,
        max_tokens=None,
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_cumulative_outputs_are_the_whole_copies_they_always_were(
    scenario: dict[str, object],
) -> None:
    n, logprobs = scenario["n"], bool(scenario["logprobs"])
    assert isinstance(n, int)
    clocks = [Clock(100.0), Clock(100.0), Clock(100.0)]
    # The reference: DELTA outputs (no collector) applied to the model of the old CUMULATIVE.
    reference = OutputProcessor(ByteTokenizer(), clock=clocks[0])
    reference.add_request("r", "ab", [97, 98], _params(scenario, DELTA), external_id="user")
    model = WholeCopyModel(n, logprobs)
    # Under test: a collector read at random points, and the outputs returned without one.
    streamed = OutputProcessor(ByteTokenizer(), clock=clocks[1])
    collector = RequestOutputCollector(CUMULATIVE, clock=unpaced())
    streamed.add_request(
        "r", "ab", [97, 98], _params(scenario, CUMULATIVE), external_id="user", collector=collector
    )
    returned = OutputProcessor(ByteTokenizer(), clock=clocks[2])
    returned.add_request("r", "ab", [97, 98], _params(scenario, CUMULATIVE), external_id="user")

    expected_prompt_logprobs = (
        [None, {98: Logprob(-0.5, 1, "b"), 97: Logprob(-1.5, 2, "a")}]
        if scenario["prompt_logprobs"]
        else None
    )
    reads: list[tuple[RequestOutput, tuple[bool, list[Shown]]]] = []

    def read() -> None:
        got = collector.get_nowait()
        want = model.take()
        if want is None:
            assert got is None
            return
        assert got is not None
        assert (got.finished, [shown(c) for c in got.outputs]) == want
        assert (got.request_id, got.prompt, got.prompt_token_ids) == ("user", "ab", [97, 98])
        assert got.prompt_logprobs == expected_prompt_logprobs
        reads.append((got, want))

    for k, msg in enumerate(_engine_messages(scenario)):
        for clock in clocks:
            clock.now = 200.0 + k
        deltas = reference.process_outputs(msg).request_outputs
        out_returned = returned.process_outputs(msg).request_outputs
        streamed.process_outputs(msg)
        assert len(out_returned) == len(deltas) <= 1
        for delta, got in zip(deltas, out_returned, strict=True):
            copies = model.apply(delta)
            model.put(copies, delta.finished)
            assert (got.finished, [shown(c) for c in got.outputs]) == (delta.finished, copies)
            assert got.metrics == delta.metrics
            assert got.prompt_logprobs == expected_prompt_logprobs
        if scenario["steps"][k][2]:  # type: ignore[index]
            read()
    if scenario["abort"] and streamed.has_unfinished_requests():
        streamed.abort_request("r")
        model.abort()
    read()
    # What consumers took was never changed afterwards.
    for got, want in reads:
        assert (got.finished, [shown(c) for c in got.outputs]) == want


# -- end to end ---------------------------------------------------------------------------------

STREAMS = {
    # Greedy counts up from "c": "defg..." until the stop string "pqr" (held back meanwhile).
    "stop-string": SamplingParams(
        temperature=0.0, max_tokens=300, logprobs=1, stop="pqr", prompt_logprobs=1
    ),
    # Three seeded random completions of different lengths (EOS ends some early).
    "n=3": SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=300, logprobs=2),
}


async def _outputs(
    engine: AsyncLLM, params: SamplingParams, *, slow: bool
) -> tuple[list[RequestOutput], list[tuple[bool, list[Shown]]]]:
    """A stream's outputs, and what each showed when it arrived. A slow consumer lets outputs
    merge in the collector."""
    outs, seen = [], []
    async for out in engine.generate("abc", params):
        outs.append(out)
        seen.append((out.finished, [shown(c) for c in out.outputs]))
        if slow and len(outs) % 3 == 0:
            await anyio.sleep(0.003)
    return outs, seen


@pytest.mark.anyio
@pytest.mark.parametrize("multiprocess", [True, False], ids=["mp", "inproc"])
@pytest.mark.parametrize("name", list(STREAMS))
async def test_cumulative_streams_show_what_delta_streams_add_up_to(
    multiprocess: bool, name: str
) -> None:
    base = STREAMS[name]
    with anyio.fail_after(30):
        async with AsyncLLM(
            backend="mock",
            tokenizer="byte",
            multiprocess=multiprocess,
            # Steps of half a millisecond: the consumer that keeps up sees about one per output.
            backend_options={"latency": {"step_s": 0.0005}} if multiprocess else {},
        ) as engine:
            deltas, _ = await _outputs(engine, base.clone(output_kind=DELTA), slow=False)
            (final,) = [o async for o in engine.generate("abc", base.clone(output_kind=FINAL))]
            streams = [await _outputs(engine, base, slow=slow) for slow in (False, True)]
    # The reference: the DELTA stream added up, per completion.
    totals: dict[int, Total] = {}
    last: dict[int, Shown] = {}
    for out in deltas:
        for c in out.outputs:
            t = totals.setdefault(c.index, Total(logprobs=[]))
            t.text += c.text
            t.token_ids += c.token_ids
            assert t.logprobs is not None and c.logprobs is not None
            t.logprobs += c.logprobs
            last[c.index] = (
                c.index,
                t.text,
                t.token_ids,
                c.cumulative_logprob,
                t.logprobs,
                c.finish_reason,
                c.stop_reason,
            )
    assert sorted(last) == list(range(base.n))
    assert [shown(c) for c in final.outputs] == [last[i] for i in range(base.n)]
    if name == "stop-string":
        assert last[0][1:3] == ("defghijklmno", list(range(100, 112)) + [112, 113, 114])
        assert last[0][5:] == ("stop", "pqr")
    for outs, seen in streams:
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert all(o.prompt_logprobs == deltas[0].prompt_logprobs for o in outs)
        # What each output showed when it arrived is what it still shows.
        assert [(o.finished, [shown(c) for c in o.outputs]) for o in outs] == seen
        by_index: dict[int, list[Shown]] = {}
        for _, completions in seen:
            for c in completions:
                by_index.setdefault(c[0], []).append(c)
        assert sorted(by_index) == list(range(base.n))
        for index, mentions in by_index.items():
            want = last[index]
            assert mentions[-1] == want
            for c in mentions[:-1]:  # a prefix of the whole, unfinished
                k = len(c[2])
                assert want[1].startswith(c[1])
                assert (c[2], c[4], c[5], c[6]) == (want[2][:k], want[4][:k], None, None)
