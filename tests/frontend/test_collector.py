from __future__ import annotations

import anyio
import pytest

from engine_core._frontend.collector import COPY_PACING, RequestOutputCollector
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


def test_delta_merge_including_the_final_output() -> None:
    collector = RequestOutputCollector(DELTA)
    collector.put(output(completion(0, "a", [0], cumulative_logprob=-0.5)))
    collector.put(output(completion(0, "b", [1], cumulative_logprob=-1.0)))
    collector.put(
        output(
            completion(0, "c", [2], cumulative_logprob=-1.5, finish_reason="length"),
            finished=True,
        )
    )
    got = collector.get_nowait()
    assert got is not None
    assert got.finished
    (merged,) = got.outputs
    assert (merged.text, merged.token_ids, merged.finish_reason) == ("abc", [0, 1, 2], "length")
    assert merged.logprobs is not None and len(merged.logprobs) == 3
    assert merged.cumulative_logprob == -1.5


def frozen() -> float:
    """A clock that never moves: copies take no time, so no output is held back."""
    return 0.0


def test_cumulative_accumulates_deltas_by_index_and_appends_new_indices() -> None:
    collector = RequestOutputCollector(CUMULATIVE, clock=frozen)
    collector.put(output(completion(0, "a", [0]), completion(1, "b", [1])))
    collector.put(output(completion(0, "b", [2]), completion(2, "c", [3])))
    got = collector.get_nowait()
    assert got is not None
    assert [(c.index, c.text, c.token_ids) for c in got.outputs] == [
        (0, "ab", [0, 2]),
        (1, "b", [1]),
        (2, "c", [3]),
    ]
    # Later outputs name the completions that changed since, with all they produced.
    collector.put(output(completion(1, "x", [4])))
    got = collector.get_nowait()
    assert got is not None
    assert [(c.index, c.text, c.token_ids) for c in got.outputs] == [(1, "bx", [1, 4])]


def test_cumulative_outputs_own_their_lists() -> None:
    collector = RequestOutputCollector(CUMULATIVE, clock=frozen)
    first_delta = completion(0, "a", [0], cumulative_logprob=-0.5)
    collector.put(output(first_delta))
    first = collector.get_nowait()
    assert first is not None
    collector.put(output(completion(0, "b", [1], cumulative_logprob=-1.0)))
    collector.put(
        output(
            completion(0, "c", [2], cumulative_logprob=-1.5, finish_reason="length"),
            finished=True,
        )
    )
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
    collector = RequestOutputCollector(kind, clock=frozen)
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
    collector.put(output(completion(1, "x", [5])))
    collector.put(output(completion(0, "y", [6]), completion(1, "z", [7])))
    got = collector.get_nowait()
    assert got is not None
    assert [(c.index, c.text, c.token_ids) for c in got.outputs] == [
        (1, "xz", [5, 7]),
        (0, "y", [6]),
    ]


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


class Ticking:
    """A clock that moves on by ``step`` at every reading: each copy takes ``step`` seconds."""

    def __init__(self, step: float) -> None:
        self.step = step
        self.now = 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_cumulative_reads_are_paced_by_the_time_their_copies_take() -> None:
    clock = Ticking(1.0)
    collector = RequestOutputCollector(CUMULATIVE, clock=clock)
    collector.put(output(completion(0, "a", [0])))
    first = collector.get_nowait()
    assert first is not None and first.outputs[0].text == "a"
    copied_at = clock.now
    collector.put(output(completion(0, "b", [1])))
    held = 0
    while (got := collector.get_nowait()) is None:
        held += 1
        assert collector.has_pending
        collector.put(output(completion(0, "c", [2 + held])))
    # Held for COPY_PACING times the copy (one tick), the steps meanwhile merged into it.
    assert clock.now >= copied_at + COPY_PACING
    assert held > 0
    (c,) = got.outputs
    assert (c.text, c.token_ids) == ("ab" + "c" * held, [0, 1, *range(3, 3 + held)])


def test_the_last_output_and_errors_are_not_held_back() -> None:
    collector = RequestOutputCollector(CUMULATIVE, clock=Ticking(1.0))
    collector.put(output(completion(0, "a", [0])))
    assert collector.get_nowait() is not None
    collector.put(output(completion(0, "b", [1])))
    assert collector.get_nowait() is None
    collector.put(output(completion(0, "c", [2], finish_reason="length"), finished=True))
    got = collector.get_nowait()
    assert got is not None and got.finished
    assert (got.outputs[0].text, got.outputs[0].token_ids) == ("abc", [0, 1, 2])

    collector = RequestOutputCollector(CUMULATIVE, clock=Ticking(1.0))
    collector.put(output(completion(0, "a", [0])))
    assert collector.get_nowait() is not None
    collector.put(output(completion(0, "b", [1])))
    collector.put(RuntimeError("engine died"))
    with pytest.raises(RuntimeError, match="engine died"):
        collector.get_nowait()


@pytest.mark.parametrize("kind", [DELTA, RequestOutputKind.FINAL_ONLY])
def test_other_kinds_are_not_paced(kind: RequestOutputKind) -> None:
    collector = RequestOutputCollector(kind, clock=Ticking(1.0))
    for k in range(3):
        collector.put(output(completion(0, "a", [k])))
        assert collector.get_nowait() is not None


@pytest.mark.anyio
async def test_get_waits_until_a_held_output_is_due() -> None:
    clock = Ticking(0.002)  # each copy takes 2 ms: the next output is due 18 ms later
    collector = RequestOutputCollector(CUMULATIVE, clock=clock)
    collector.put(output(completion(0, "a", [0])))
    with anyio.fail_after(5):
        assert (await collector.get()).outputs[0].text == "a"
        copied_at = clock.now
        collector.put(output(completion(0, "b", [1])))
        collector.put(output(completion(0, "c", [2])))
        got = await collector.get()
    assert clock.now >= copied_at + 0.002 * COPY_PACING
    assert (got.outputs[0].text, got.outputs[0].token_ids) == ("abc", [0, 1, 2])
