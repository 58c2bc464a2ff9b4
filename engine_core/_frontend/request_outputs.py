"""The outputs the output processor emits: a request as its output kind shows it.

Every streamed output is a delta, DELTA and CUMULATIVE alike: a completion carries the text,
tokens and logprobs its step added, so building it costs the new tokens only. A CUMULATIVE
request's reader makes it cumulative (:mod:`engine_core._frontend.cumulative`): its collector
when the consumer takes it, or, for a request without a collector, :meth:`StepOutputs.emit`
as it returns it. FINAL_ONLY completions gather their pieces as they come and are emitted once,
whole, when they finish. An ``n > 1`` request gets one output per step carrying the completions
that changed (FINAL_ONLY: all ``n`` at once, when the last one finishes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_core._frontend.request_state import CompletionState, RequestState
from engine_core.outputs import (
    CompletionOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from engine_core.sampling_params import RequestOutputKind

__all__ = [
    "ProcessedOutputs",
    "StepOutputs",
    "abort_output",
    "completion_output",
    "request_output",
]

_DELTA = int(RequestOutputKind.DELTA)
_FINAL_ONLY = int(RequestOutputKind.FINAL_ONLY)


@dataclass(slots=True)
class ProcessedOutputs:
    """What one :meth:`~engine_core._frontend.output_processor.OutputProcessor.process_outputs`
    call produced."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    """Outputs of requests that have no collector."""
    reqs_to_abort: list[str] = field(default_factory=list)
    """Engine request ids the front end finished (stop strings); the engine must abort them."""


class StepOutputs:
    """What one ``process_outputs`` call gathers: the result it returns, and the changed
    completions of n > 1 requests, which go out together as one output at the end."""

    __slots__ = ("now", "result", "parents")

    def __init__(self, now: float) -> None:
        self.now = now
        self.result = ProcessedOutputs()
        self.parents: dict[str, tuple[RequestState, list[CompletionOutput]]] = {}

    def emit(self, state: RequestState, output: RequestOutput) -> None:
        """Hand an output to its request's collector, or to the caller through the result
        (made cumulative first for a CUMULATIVE request)."""
        if state.collector is not None:
            state.collector.put(output)
        elif state.cumulative is not None:
            self.result.request_outputs.append(state.cumulative.add(output))
        else:
            self.result.request_outputs.append(output)

    def add_parallel(self, state: RequestState, output: CompletionOutput) -> None:
        """Hold the output of one completion of an n > 1 request for the request's output at
        the end of the call (FINAL_ONLY: until all ``n`` are finished)."""
        if state.kind == _FINAL_ONLY:
            state.final_outputs[output.index] = output
            if state.finished:
                done = [c for c in state.final_outputs if c is not None]
                self.emit(state, request_output(state, done))
        else:
            pending = self.parents.get(state.request_id)
            if pending is None:
                self.parents[state.request_id] = (state, [output])
            else:
                pending[1].append(output)

    def finish(self) -> ProcessedOutputs:
        """Emit the gathered outputs of n > 1 requests; the call's result."""
        for state, changed in self.parents.values():
            self.emit(state, request_output(state, changed))
        return self.result


def request_output(state: RequestState, outputs: list[CompletionOutput]) -> RequestOutput:
    """The request as its output kind shows it now, with ``outputs`` as its completions."""
    prompt_logprobs = state.prompt_logprobs
    if state.kind == _DELTA and prompt_logprobs is not None:
        # DELTA sends prompt logprobs once: all of them arrived with the first token.
        if state.prompt_logprobs_sent:
            prompt_logprobs = None
        state.prompt_logprobs_sent = True
    m = state.metrics
    if state.kind != _FINAL_ONLY:
        # Streamed outputs get a snapshot: the live metrics keep changing.
        m = RequestMetrics(
            m.arrival_time,
            m.first_token_time,
            m.last_token_time,
            m.finished_time,
            m.spec_num_drafts,
            m.spec_num_draft_tokens,
            m.spec_num_accepted_tokens,
        )
    return RequestOutput(
        state.external_id,
        state.prompt,
        state.prompt_token_ids,
        outputs,
        state.finished,
        state.num_cached_tokens or 0,
        m,
        prompt_logprobs,
        state.error,
    )


def completion_output(
    completion: CompletionState,
    text: str,
    token_ids: list[int],
    step_logprobs: list[PositionLogprobs] | None,
    finished: bool,
) -> CompletionOutput | None:
    """What one step changed of a completion (its new ``text`` and ``token_ids``), as its output
    kind shows it (None: nothing to show yet). Costs the step's tokens, whatever came before."""
    if completion.request.kind != _FINAL_ONLY:
        return CompletionOutput(
            completion.index,
            text,
            token_ids,
            completion.cumulative_logprob,
            step_logprobs,
            completion.finish_reason,
            completion.stop_reason,
        )
    completion.token_ids.extend(token_ids)
    logprobs = completion.logprobs
    if logprobs is not None and step_logprobs:
        logprobs.extend(step_logprobs)
    if text:
        completion.text_parts.append(text)
    if not finished:
        return None
    return _final_completion(completion)


def _final_completion(completion: CompletionState) -> CompletionOutput:
    """Everything a finished (or aborted) FINAL_ONLY completion produced; its state is done."""
    parts = completion.text_parts
    return CompletionOutput(
        completion.index,
        parts[0] if len(parts) == 1 else "".join(parts),
        completion.token_ids,
        completion.cumulative_logprob,
        completion.logprobs,
        completion.finish_reason,
        completion.stop_reason,
    )


def abort_output(state: RequestState, aborted: list[CompletionState]) -> RequestOutput:
    """The last output of an aborted request (for its collector): its unfinished completions,
    ended "abort" with nothing new (FINAL_ONLY: every completion, whole)."""
    if state.kind != _FINAL_ONLY:
        outputs = [
            CompletionOutput(
                c.index,
                "",
                [],
                c.cumulative_logprob,
                [] if c.logprobs is not None else None,
                "abort",
            )
            for c in aborted
        ]
    else:
        if not state.final_outputs:
            state.final_outputs = [None] * state.n
        for c in aborted:
            state.final_outputs[c.index] = _final_completion(c)
        outputs = [c for c in state.final_outputs if c is not None]
    return request_output(state, outputs)
