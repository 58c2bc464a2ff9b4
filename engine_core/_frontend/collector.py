"""``RequestOutputCollector``: the hand-off from the output processor to one request's consumer.

The producer (the output processor, driven by the front end's output task) never blocks: each
:meth:`~RequestOutputCollector.put` merges into the single pending item at a cost proportional
to what it adds, so a slow consumer sees fewer, larger outputs and memory per request is bounded
by what the request produced. What an output kind costs beyond that is paid when the consumer
reads, in the consumer's task: joining merged text, and for CUMULATIVE the copy of everything a
completion produced so far (:mod:`engine_core._frontend.cumulative`).

That copy grows with the stream, so a CUMULATIVE consumer that read at every step would spend
the event loop's time in proportion to the square of its length. Its reads are paced instead:
the next output (unless it is the last) is handed out no sooner than ``COPY_PACING_S`` per item
(token id or logprobs position) the previous read copied, and the steps in between merge into
it, as they do for a consumer that is slow on its own. The hold is about nine times what the
copy costs, so copying takes about a tenth of the consumer's time at most, however long the
stream; it is measured in items, not timed, so a pause of the process during a copy does not
lengthen it. A 100,000-token stream's outputs come at most about every 2 ms (4 ms with
logprobs); short ones are not held back noticeably.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio

from engine_core._frontend.cumulative import CumulativeOutputs
from engine_core.outputs import CompletionOutput, RequestOutput
from engine_core.sampling_params import RequestOutputKind

__all__ = ["COPY_PACING_S", "RequestOutputCollector"]

_CUMULATIVE = RequestOutputKind.CUMULATIVE
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY

COPY_PACING_S = 18e-9
"""Seconds a CUMULATIVE output that does not finish its request is held back per item the
previous read copied (copying one costs 1-2 ns; see the module docstring)."""
_PACED_COPIES = 1024
"""Copies smaller than this (a hold under 20 us) hold nothing back: no clock is read."""


class RequestOutputCollector:
    """One pending :class:`RequestOutput` (or exception) of one request, and a way to await it.

    ``put`` takes what the output processor produces for the collector's ``output_kind``: deltas
    for DELTA and CUMULATIVE (completions carry the text, tokens and logprobs of their step),
    whole completions for FINAL_ONLY. It merges into the pending output, matching completions by
    ``index``:

    - DELTA and CUMULATIVE: text is concatenated, ``token_ids`` and ``logprobs`` extended;
      ``cumulative_logprob``, ``finish_reason`` and ``stop_reason`` take the newer values;
    - FINAL_ONLY: the newer completion replaces the pending one;
    - a completion with an index not pending yet is appended (n > 1 streams).

    ``finished`` is OR-ed; ``metrics``, ``num_cached_tokens`` and ``error`` take the newer
    values; ``prompt_logprobs`` are extended (DELTA) or replaced. ``get``/``get_nowait`` hand
    out the pending output as the kind shows it: for CUMULATIVE, each completion it names with
    everything that completion produced so far, paced as the module docstring says (by
    ``clock``). An exception replaces whatever is pending and is raised by the next
    ``get``/``get_nowait``; outputs put after it are dropped. One consumer per collector; works
    under asyncio and trio.
    """

    __slots__ = (
        "output_kind",
        "_deltas",
        "_accumulates",
        "_cumulative",
        "_pending",
        "_merged",
        "_event",
        "_clock",
        "_ready_at",
    )

    def __init__(
        self,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.output_kind = output_kind
        self._deltas = output_kind != _FINAL_ONLY
        self._accumulates = output_kind == _CUMULATIVE
        self._cumulative: CumulativeOutputs | None = None
        """CUMULATIVE, once the consumer took an output that did not finish the request."""
        self._pending: RequestOutput | BaseException | None = None
        self._merged: dict[int, tuple[CompletionOutput, list[str]]] | None = None
        """Once a second delta output merged into the pending one: its completions (copies,
        grown in place) by index, with their text in pieces, joined when taken."""
        self._event: anyio.Event | None = None
        self._clock = clock
        self._ready_at = 0.0
        """CUMULATIVE: when the next output that does not finish the request may be taken."""

    def put(self, item: RequestOutput | BaseException) -> None:
        """Store or merge ``item``; never blocks. Call from the consumer's event loop thread."""
        pending = self._pending
        if pending is None or isinstance(item, BaseException):
            self._pending = item
            self._merged = None
        elif isinstance(pending, RequestOutput):
            if self._deltas:
                self._merge(pending, item)
            else:
                _replace(pending, item)
        if self._event is not None:
            self._event.set()

    def _merge(self, pending: RequestOutput, new: RequestOutput) -> None:
        merged = self._merged
        if merged is None:
            # The first output's lists may be shared with the producer; copy before growing.
            merged = self._merged = {}
            outputs = pending.outputs = [_adopt(c, merged) for c in pending.outputs]
            if pending.prompt_logprobs is not None and not self._accumulates:
                pending.prompt_logprobs = list(pending.prompt_logprobs)
        else:
            outputs = pending.outputs
        for completion in new.outputs:
            entry = merged.get(completion.index)
            if entry is None:
                outputs.append(_adopt(completion, merged))
                continue
            target, texts = entry
            if completion.text:
                _append_text(texts, completion.text)
            target.token_ids.extend(completion.token_ids)
            if completion.logprobs is not None:
                if target.logprobs is None:
                    target.logprobs = list(completion.logprobs)
                else:
                    target.logprobs.extend(completion.logprobs)
            target.cumulative_logprob = completion.cumulative_logprob
            target.finish_reason = completion.finish_reason
            target.stop_reason = completion.stop_reason
        if new.prompt_logprobs is not None:
            if not self._accumulates and pending.prompt_logprobs is not None:
                pending.prompt_logprobs.extend(new.prompt_logprobs)
            else:
                pending.prompt_logprobs = new.prompt_logprobs
        _update_request_fields(pending, new)

    def get_nowait(self) -> RequestOutput | None:
        """Take the pending output, or None when there is none (or, for CUMULATIVE, when it
        is not due yet); raises a pending exception."""
        pending = self._pending
        if pending is None:
            return None
        if isinstance(pending, BaseException):
            self._pending = None
            raise pending
        accumulates, finished = self._accumulates, pending.finished
        if accumulates and not finished and self._ready_at and self._clock() < self._ready_at:
            return None
        self._pending = None
        merged = self._merged
        if merged is not None:
            self._merged = None
            for target, texts in merged.values():
                target.text = texts[0] if len(texts) == 1 else "".join(texts)
        if not accumulates:
            return pending
        cumulative = self._cumulative
        if cumulative is None:
            if finished:
                return pending  # the first output taken is the last: its deltas are the whole
            cumulative = self._cumulative = CumulativeOutputs()
        output = cumulative.add(pending)
        if cumulative.copied >= _PACED_COPIES:
            self._ready_at = self._clock() + cumulative.copied * COPY_PACING_S
        return output

    async def get(self) -> RequestOutput:
        """Wait for an output (for CUMULATIVE, until it is due) and take it; raises a pending
        exception."""
        while True:
            output = self.get_nowait()
            if output is not None:
                return output
            if self._pending is not None:  # not due yet: more may merge into it meanwhile
                await anyio.sleep(max(0.0, self._ready_at - self._clock()))
                continue
            event = self._event = anyio.Event()
            try:
                await event.wait()
            finally:
                self._event = None

    @property
    def has_pending(self) -> bool:
        """Whether an output or exception is waiting to be taken (due or not)."""
        return self._pending is not None


def _adopt(
    c: CompletionOutput, merged: dict[int, tuple[CompletionOutput, list[str]]]
) -> CompletionOutput:
    """A copy of ``c`` that merging may grow, registered in ``merged``."""
    copy = CompletionOutput(
        c.index,
        c.text,
        list(c.token_ids),
        c.cumulative_logprob,
        list(c.logprobs) if c.logprobs is not None else None,
        c.finish_reason,
        c.stop_reason,
    )
    merged[c.index] = (copy, [c.text])
    return copy


def _append_text(texts: list[str], text: str) -> None:
    """Append ``text`` to the pieces of a merged completion's text, joining the last pieces
    while one is not more than twice as long as the next: a consumer that stopped reading
    holds a few pieces (their lengths at least halve from one to the next), not one per step,
    and each character is copied a logarithmic number of times."""
    texts.append(text)
    while len(texts) > 1 and len(texts[-2]) <= 2 * len(texts[-1]):
        last = texts.pop()
        texts[-1] += last


def _replace(pending: RequestOutput, new: RequestOutput) -> None:
    """FINAL_ONLY: the newer completions replace the pending ones with the same index."""
    outputs = pending.outputs
    by_index = {c.index: i for i, c in enumerate(outputs)}
    for completion in new.outputs:
        i = by_index.get(completion.index)
        if i is None:
            outputs.append(completion)
            by_index[completion.index] = len(outputs) - 1
        else:
            outputs[i] = completion
    if new.prompt_logprobs is not None:
        pending.prompt_logprobs = new.prompt_logprobs
    _update_request_fields(pending, new)


def _update_request_fields(pending: RequestOutput, new: RequestOutput) -> None:
    pending.finished = pending.finished or new.finished
    pending.metrics = new.metrics
    pending.num_cached_tokens = new.num_cached_tokens
    if new.error is not None:
        pending.error = new.error
