from __future__ import annotations

import anyio
import pytest
from helpers.clock import Clock, unpaced

from engine_core._frontend.collector import COPY_PACING_S, RequestOutputCollector
from engine_core.outputs import CompletionOutput, Logprob, RequestOutput
from engine_core.sampling_params import RequestOutputKind

DELTA = RequestOutputKind.DELTA
CUMULATIVE = RequestOutputKind.CUMULATIVE


def completion(
    index: int,
    text: str,
    token_ids: list[int],
    *,
    cumulative_logprob: float | None = None,
    finish_reason: str | None = None,
) -> CompletionOutput:
    logprobs = (
        [{t: Logprob(-0.5, 1, "x")} for t in token_ids] if cumulative_logprob is not None else None
    )
    return CompletionOutput(
        index,
        text,
        token_ids,
        cumulative_logprob,
        logprobs,
        finish_reason,  # type: ignore[arg-type]
    )


def output(*completions: CompletionOutput, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", "p", [1, 2], list(completions), finished)


def test_delta_merges_pending_outputs() -> None:
    collector = RequestOutputCollector(DELTA)
    first = completion(0, "a", [0], cumulative_logprob=-0.5)
    collector.put(output(first))
    collector.put(output(completion(0, "a", [1], cumulative_logprob=-1.0)))
    got = collector.get_nowait()
    assert got is not None
    (merged,) = got.outputs
    assert merged.text == "aa"
    assert merged.token_ids == [0, 1]
    assert merged.logprobs is not None and len(merged.logprobs) == 2
    assert merged.cumulative_logprob == -1.0
    assert not got.finished
    assert merged.finish_reason is None
    assert first.token_ids == [0]  # the producer's first output was not grown in place
    assert collector.get_nowait() is None


def abc_deltas() -> list[RequestOutput]:
    """Completion 0 in three steps, "a", "b", then "c" and its end, with a logprob per token."""
    return [
        output(completion(0, "a", [0], cumulative_logprob=-0.5)),
        output(completion(0, "b", [1], cumulative_logprob=-1.0)),
        output(
            completion(0, "c", [2], cumulative_logprob=-1.5, finish_reason="length"),
            finished=True,
        ),
    ]


def test_delta_merge_including_the_final_output() -> None:
    collector = RequestOutputCollector(DELTA)
    for delta in abc_deltas():
        collector.put(delta)
    got = collector.get_nowait()
    assert got is not None
    assert got.finished
    (merged,) = got.outputs
    assert (merged.text, merged.token_ids, merged.finish_reason) == ("abc", [0, 1, 2], "length")
    assert merged.logprobs is not None and len(merged.logprobs) == 3
    assert merged.cumulative_logprob == -1.5


def put_and_get(
    collector: RequestOutputCollector, *outputs: RequestOutput
) -> list[tuple[int, str, list[int]]]:
    """Put ``outputs``, then get what the collector has: each completion's index, text and
    token ids."""
    for o in outputs:
        collector.put(o)
    got = collector.get_nowait()
    assert got is not None
    return [(c.index, c.text, c.token_ids) for c in got.outputs]


def test_cumulative_accumulates_deltas_by_index_and_appends_new_indices() -> None:
    collector = RequestOutputCollector(CUMULATIVE, clock=unpaced())
    assert put_and_get(
        collector,
        output(completion(0, "a", [0]), completion(1, "b", [1])),
        output(completion(0, "b", [2]), completion(2, "c", [3])),
    ) == [(0, "ab", [0, 2]), (1, "b", [1]), (2, "c", [3])]
    # Later outputs name the completions that changed since, with all they produced.
    assert put_and_get(collector, output(completion(1, "x", [4]))) == [(1, "bx", [1, 4])]


def test_cumulative_merges_leave_the_requests_prompt_logprobs_alone() -> None:
    prompt_logprobs: list[dict[int, Logprob] | None] = [None, {2: Logprob(-0.5, 1, "x")}]
    collector = RequestOutputCollector(CUMULATIVE, clock=unpaced())
    for k in range(3):
        o = output(completion(0, "a", [k]))
        o.prompt_logprobs = prompt_logprobs  # every CUMULATIVE output carries the same list
        collector.put(o)
    got = collector.get_nowait()
    assert got is not None and got.outputs[0].token_ids == [0, 1, 2]
    assert got.prompt_logprobs is prompt_logprobs
    assert prompt_logprobs == [None, {2: Logprob(-0.5, 1, "x")}]


def test_cumulative_outputs_own_their_lists() -> None:
    collector = RequestOutputCollector(CUMULATIVE, clock=unpaced())
    deltas = abc_deltas()
    (first_delta,) = deltas[0].outputs
    collector.put(deltas[0])
    first = collector.get_nowait()
    assert first is not None
    for delta in deltas[1:]:
        collector.put(delta)
    last = collector.get_nowait()
    assert last is not None and last.finished
    (c,) = last.outputs
    assert (c.text, c.token_ids, c.cumulative_logprob, c.finish_reason) == (
        "abc",
        [0, 1, 2],
        -1.5,
        "length",
    )
    assert c.logprobs == [{t: Logprob(-0.5, 1, "x")} for t in (0, 1, 2)]
    (f,) = first.outputs
    assert (f.text, f.token_ids, f.cumulative_logprob, f.finish_reason) == ("a", [0], -0.5, None)
    assert f.logprobs == [{0: Logprob(-0.5, 1, "x")}]
    assert first_delta.token_ids == [0] and first_delta.logprobs is not None
    assert len(first_delta.logprobs) == 1  # the producer's delta was not grown in place
    assert collector.get_nowait() is None


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE])
def test_a_consumer_that_stopped_reading_gets_everything_merged_exactly(
    kind: RequestOutputKind,
) -> None:
    collector = RequestOutputCollector(kind, clock=unpaced())
    pieces = ["", "a", "bc", "", "def", "g" * 40, "h", "é"] * 2_000
    for k, text in enumerate(pieces):
        collector.put(output(completion(k % 2, text, [k], cumulative_logprob=-0.5 * k)))
    got = collector.get_nowait()
    assert got is not None
    assert [c.index for c in got.outputs] == [0, 1]
    for c in got.outputs:
        assert c.text == "".join(pieces[c.index :: 2])
        assert c.token_ids == list(range(c.index, len(pieces), 2))
        assert c.logprobs == [{t: Logprob(-0.5, 1, "x")} for t in c.token_ids]
        assert c.cumulative_logprob == -0.5 * c.token_ids[-1]
    assert collector.get_nowait() is None


def test_delta_appends_unseen_indices() -> None:
    collector = RequestOutputCollector(DELTA)
    assert put_and_get(
        collector,
        output(completion(1, "x", [5])),
        output(completion(0, "y", [6]), completion(1, "z", [7])),
    ) == [(1, "xz", [5, 7]), (0, "y", [6])]


def test_finished_is_ored() -> None:
    collector = RequestOutputCollector(CUMULATIVE)
    collector.put(output(completion(0, "a", [0], finish_reason="stop"), finished=True))
    collector.put(output(completion(1, "b", [1])))
    got = collector.get_nowait()
    assert got is not None and got.finished


def test_exception_replaces_pending_and_later_outputs_are_dropped() -> None:
    collector = RequestOutputCollector(DELTA)
    collector.put(output(completion(0, "a", [0])))
    collector.put(RuntimeError("engine died"))
    collector.put(output(completion(0, "b", [1])))
    with pytest.raises(RuntimeError, match="engine died"):
        collector.get_nowait()
    assert collector.get_nowait() is None


@pytest.mark.anyio
async def test_get_waits_for_put() -> None:
    collector = RequestOutputCollector(DELTA)
    received: list[RequestOutput] = []

    async def consume() -> None:
        received.append(await collector.get())

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await anyio.wait_all_tasks_blocked()
        assert received == []
        collector.put(output(completion(0, "a", [0])))
        collector.put(output(completion(0, "b", [1])))
    assert len(received) == 1
    assert received[0].outputs[0].text == "ab"
    assert not collector.has_pending


@pytest.mark.anyio
async def test_get_returns_pending_without_waiting_and_raises_exceptions() -> None:
    collector = RequestOutputCollector(CUMULATIVE)
    collector.put(output(completion(0, "a", [0])))
    assert (await collector.get()).outputs[0].text == "a"
    collector.put(ValueError("bad request"))
    with pytest.raises(ValueError, match="bad request"):
        await collector.get()


@pytest.mark.anyio
async def test_cancelled_get_leaves_collector_usable() -> None:
    collector = RequestOutputCollector(DELTA)
    with anyio.move_on_after(0):
        await collector.get()
    collector.put(output(completion(0, "a", [0])))
    assert (await collector.get()).outputs[0].text == "a"


def test_cumulative_reads_are_held_back_in_proportion_to_what_the_previous_copied() -> None:
    clock = Clock()
    collector = RequestOutputCollector(CUMULATIVE, clock=clock)
    long = 600
    collector.put(output(completion(0, "a", list(range(long)), cumulative_logprob=-0.5)))
    assert collector.get_nowait() is not None  # its first output: nothing copied
    collector.put(output(completion(0, "b", [long], cumulative_logprob=-1.0)))
    assert collector.get_nowait() is not None  # copies 601 token ids and 601 positions
    collector.put(output(completion(0, "c", [long + 1], cumulative_logprob=-1.5)))
    assert collector.get_nowait() is None and collector.has_pending
    collector.put(output(completion(0, "d", [long + 2], cumulative_logprob=-2.0)))
    clock.now = 1201 * COPY_PACING_S
    assert collector.get_nowait() is None
    clock.now = 1202 * COPY_PACING_S
    got = collector.get_nowait()
    assert got is not None
    (c,) = got.outputs
    assert (c.text, c.token_ids, c.cumulative_logprob) == ("abcd", list(range(long + 3)), -2.0)
    assert c.logprobs is not None and len(c.logprobs) == long + 3
    # The next one waits for the 2 * 603 items this one copied.
    collector.put(output(completion(0, "e", [long + 3], cumulative_logprob=-2.5)))
    copied_at = clock.now
    clock.now = copied_at + 1205 * COPY_PACING_S
    assert collector.get_nowait() is None
    clock.now = copied_at + 1206 * COPY_PACING_S
    got = collector.get_nowait()
    assert got is not None and got.outputs[0].text == "abcde"


def test_small_copies_hold_nothing_back() -> None:
    collector = RequestOutputCollector(CUMULATIVE, clock=Clock())
    for k in range(200):
        collector.put(output(completion(0, "a", [k], cumulative_logprob=-0.5)))
        got = collector.get_nowait()
        assert got is not None and got.outputs[0].token_ids == list(range(k + 1))


def test_the_last_output_and_errors_are_not_held_back() -> None:
    long = 2000
    for last in (
        output(completion(0, "c", [long + 1], finish_reason="length"), finished=True),
        RuntimeError("engine died"),
    ):
        collector = RequestOutputCollector(CUMULATIVE, clock=Clock())
        collector.put(output(completion(0, "a", list(range(long)))))
        assert collector.get_nowait() is not None
        collector.put(output(completion(0, "b", [long])))
        assert collector.get_nowait() is not None  # copies 2001 token ids
        collector.put(output(completion(0, "b", [long])))
        assert collector.get_nowait() is None
        collector.put(last)
        if isinstance(last, RuntimeError):
            with pytest.raises(RuntimeError, match="engine died"):
                collector.get_nowait()
        else:
            got = collector.get_nowait()
            assert got is not None and got.finished
            assert got.outputs[0].token_ids == [*range(long), long, long, long + 1]


@pytest.mark.parametrize("kind", [DELTA, RequestOutputKind.FINAL_ONLY])
def test_other_kinds_are_not_held_back(kind: RequestOutputKind) -> None:
    collector = RequestOutputCollector(kind, clock=Clock())
    for k in range(3):
        collector.put(output(completion(0, "a", [k])))
        assert collector.get_nowait() is not None


@pytest.mark.anyio
async def test_get_waits_until_a_held_output_is_due() -> None:
    clock = Clock()
    collector = RequestOutputCollector(CUMULATIVE, clock=clock)
    long = 100_000  # its copy holds the next output back for 1.8 ms
    collector.put(output(completion(0, "a" * (long - 1), list(range(long - 1)))))
    received: list[RequestOutput] = []

    async def consume() -> None:
        received.append(await collector.get())

    with anyio.fail_after(5):
        await collector.get()
        collector.put(output(completion(0, "a", [long - 1])))
        assert len((await collector.get()).outputs[0].token_ids) == long
        collector.put(output(completion(0, "b", [long])))
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            assert received == []  # held: the clock has not moved
            collector.put(output(completion(0, "c", [long + 1])))
            clock.now = long * COPY_PACING_S
    (got,) = received
    (c,) = got.outputs
    assert (c.text, c.token_ids) == ("a" * long + "bc", list(range(long + 2)))
