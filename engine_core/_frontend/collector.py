"""``RequestOutputCollector``: the hand-off from the output processor to one request's consumer.

The producer (the output processor, driven by the front end's output task) never blocks: each
:meth:`~RequestOutputCollector.put` merges into the single pending item, so a slow consumer sees
fewer, larger outputs and memory per request stays bounded.
"""

from __future__ import annotations

import anyio

from engine_core.outputs import CompletionOutput, RequestOutput
from engine_core.sampling_params import RequestOutputKind

__all__ = ["RequestOutputCollector"]


def _merge_delta(pending: CompletionOutput, new: CompletionOutput) -> None:
    pending.text += new.text
    pending.token_ids.extend(new.token_ids)
    if new.logprobs is not None:
        if pending.logprobs is None:
            pending.logprobs = list(new.logprobs)
        else:
            pending.logprobs.extend(new.logprobs)
    pending.cumulative_logprob = new.cumulative_logprob
    pending.finish_reason = new.finish_reason
    pending.stop_reason = new.stop_reason


class RequestOutputCollector:
    """One pending :class:`RequestOutput` (or exception) of one request, and a way to await it.

    ``put`` merges into the pending output, matching completions by ``index``:

    - DELTA: text is concatenated, ``token_ids`` and ``logprobs`` extended;
      ``cumulative_logprob``, ``finish_reason`` and ``stop_reason`` take the newer values;
    - CUMULATIVE and FINAL_ONLY: the newer completion replaces the pending one;
    - a completion with an index not pending yet is appended (n > 1 streams).

    ``finished`` is OR-ed; ``metrics``, ``num_cached_tokens`` and ``error`` take the newer values.
    An exception replaces whatever is pending and is raised by the next ``get``/``get_nowait``;
    outputs put after it are dropped. One consumer per collector; works under asyncio and trio.
    """

    __slots__ = ("output_kind", "_pending", "_owned", "_event")

    def __init__(self, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        self.output_kind = output_kind
        self._pending: RequestOutput | BaseException | None = None
        self._owned = False  # the pending output's lists were copied, so merging may grow them
        self._event: anyio.Event | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        """Store or merge ``item``; never blocks. Call from the consumer's event loop thread."""
        pending = self._pending
        if pending is None or isinstance(item, BaseException):
            self._pending = item
            self._owned = False
        elif isinstance(pending, RequestOutput):
            self._merge(pending, item)
        if self._event is not None:
            self._event.set()

    def _merge(self, pending: RequestOutput, new: RequestOutput) -> None:
        delta = self.output_kind == RequestOutputKind.DELTA
        if delta and not self._owned:
            # The first output's lists may be shared with the producer; copy before growing.
            pending.outputs = [_owned_copy(c) for c in pending.outputs]
            if pending.prompt_logprobs is not None:
                pending.prompt_logprobs = list(pending.prompt_logprobs)
            self._owned = True
        outputs = pending.outputs
        by_index = {c.index: i for i, c in enumerate(outputs)}
        for completion in new.outputs:
            i = by_index.get(completion.index)
            if i is None:
                outputs.append(_owned_copy(completion) if delta else completion)
                by_index[completion.index] = len(outputs) - 1
            elif delta:
                _merge_delta(outputs[i], completion)
            else:
                outputs[i] = completion
        if new.prompt_logprobs is not None:
            if delta and pending.prompt_logprobs is not None:
                pending.prompt_logprobs.extend(new.prompt_logprobs)
            else:
                pending.prompt_logprobs = new.prompt_logprobs
        pending.finished = pending.finished or new.finished
        pending.metrics = new.metrics
        pending.num_cached_tokens = new.num_cached_tokens
        if new.error is not None:
            pending.error = new.error

    def get_nowait(self) -> RequestOutput | None:
        """Take the pending output, or None when there is none; raises a pending exception."""
        pending = self._pending
        if pending is None:
            return None
        self._pending = None
        if isinstance(pending, BaseException):
            raise pending
        return pending

    async def get(self) -> RequestOutput:
        """Wait for an output and take it; raises a pending exception."""
        while self._pending is None:
            event = self._event = anyio.Event()
            try:
                await event.wait()
            finally:
                self._event = None
        output = self.get_nowait()
        assert output is not None
        return output

    @property
    def has_pending(self) -> bool:
        """Whether an output or exception is waiting to be taken."""
        return self._pending is not None


def _owned_copy(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(
        c.index,
        c.text,
        list(c.token_ids),
        c.cumulative_logprob,
        list(c.logprobs) if c.logprobs is not None else None,
        c.finish_reason,
        c.stop_reason,
    )
