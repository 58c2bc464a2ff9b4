"""``OutputProcessor``: turns the engine core's per-step outputs into ``RequestOutput``s.

It holds the front end's state of every request it sent: detokenization and stop strings,
logprobs, metrics and parallel sampling (``n > 1`` fans out into ``n`` engine requests and
gathers their completions back into one output). It is the only per-request Python loop of the
front end, so per-token work is kept to a decoder step and a few appends, and no step costs more
for a request because it already produced much: the outputs it emits are deltas, made
cumulative by their reader (:mod:`engine_core._frontend.request_outputs`).

Requests with a :class:`~engine_core._frontend.collector.RequestOutputCollector` get their
outputs pushed into it (``AsyncLLM``); the outputs of the others are returned (``LLM``). A
request the engine fails (``FinishedRequest.error``) ends with an output with finish_reason
"error" and ``error`` set, or, with a collector, with an exception put into it:
``RetryableRequestError`` when the engine says retrying may work (it is paused), else
``InvalidRequestError``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine_core._core.engine_io import EngineCoreOutputs, EngineCoreRequest, FinishedRequest
from engine_core._core.tokenizer import Tokenizer
from engine_core._frontend.collector import RequestOutputCollector
from engine_core._frontend.detokenizer import Detokenizer, LogprobsDecoder
from engine_core._frontend.request_outputs import (
    ProcessedOutputs,
    StepOutputs,
    abort_output,
    completion_output,
    request_output,
)
from engine_core._frontend.request_state import CompletionState, RequestState
from engine_core.abc import TokenLogprobs
from engine_core.errors import InvalidRequestError, RetryableRequestError
from engine_core.outputs import PositionLogprobs
from engine_core.sampling_params import SamplingParams

__all__ = ["OutputProcessor", "ProcessedOutputs"]


def _in_flight(request_id: str) -> ValueError:
    return ValueError(f"request_id {request_id!r} is already in flight")


def _fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """(engine request id, parameters) of each completion of a request: the request itself
    when ``n == 1``, else ``n`` children with their own ids and seeds."""
    if params.n == 1:
        return [(request_id, params)]
    return [
        (
            f"{index}_{request_id}",
            params.clone(
                n=1,
                seed=None if params.seed is None else params.seed + index,
                # Prompt logprobs are the same for every child: ask one of them.
                prompt_logprobs=params.prompt_logprobs if index == 0 else None,
            ),
        )
        for index in range(params.n)
    ]


class OutputProcessor:
    """Front-end state of in-flight requests; see the module docstring.

    ``tokenizer`` decodes outputs (None: no text). ``max_model_len``, when given, fills
    ``max_tokens=None`` with the room left after the prompt. ``clock`` timestamps metrics.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        *,
        max_model_len: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.clock = clock
        self._requests: dict[str, RequestState] = {}
        self._completions: dict[str, CompletionState] = {}
        self._by_external: dict[str, list[str]] = {}
        self._logprob_decoder = LogprobsDecoder(tokenizer)
        self._eos_token_ids = list(tokenizer.eos_token_ids) if tokenizer is not None else []

    # -- requests -------------------------------------------------------------------------------

    @property
    def num_unfinished_requests(self) -> int:
        """Requests (as callers see them: a parent counts once) still in flight."""
        return len(self._requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def request_ids(self) -> list[str]:
        """Internal ids of the requests in flight (parents once)."""
        return list(self._requests)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        external_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        collector: RequestOutputCollector | None = None,
    ) -> list[EngineCoreRequest]:
        """Register a request and return the engine requests to send for it.

        ``request_id`` is the internal id (unique among live requests), ``external_id`` the
        caller's (defaults to ``request_id``; outputs carry it). With ``params.n > 1`` the
        request is the parent of ``n`` engine requests ``"<index>_<request_id>"`` (seed +
        index when a seed is given); all are registered before this returns. Outputs go to
        ``collector`` when given, else they are returned by :meth:`process_outputs`.
        """
        if request_id in self._requests or request_id in self._completions:
            raise _in_flight(request_id)
        if collector is not None and collector.output_kind != params.output_kind:
            # The collector finishes what the processor starts (CUMULATIVE: from deltas).
            raise ValueError(
                f"the collector is for {collector.output_kind.name} outputs, the request asks "
                f"for {params.output_kind.name}"
            )
        if params.max_tokens is None and self.max_model_len is not None:
            params = params.clone(max_tokens=max(1, self.max_model_len - len(prompt_token_ids)))
        state = RequestState(
            request_id,
            request_id if external_id is None else external_id,
            prompt,
            prompt_token_ids,
            params,
            self.clock() if arrival_time is None else arrival_time,
            collector,
        )
        engine_requests = [
            self._add_completion(state, index, child_id, child_params, priority, cache_salt)
            for index, (child_id, child_params) in enumerate(_fan_out(request_id, params))
        ]
        self._register(state)
        return engine_requests

    def _add_completion(
        self,
        state: RequestState,
        index: int,
        request_id: str,
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
    ) -> EngineCoreRequest:
        """Add completion ``index`` (engine request ``request_id``) to ``state``; return the
        engine request for it. Nothing is registered yet, so a clash leaves no trace."""
        if request_id in self._completions:
            raise _in_flight(request_id)
        prompt_token_ids = state.prompt_token_ids
        state.completions.append(
            CompletionState(
                request_id,
                index,
                state,
                Detokenizer(self.tokenizer, prompt_token_ids, params),
                params.logprobs is not None,
            )
        )
        return EngineCoreRequest(
            request_id,
            prompt_token_ids,
            params,
            state.metrics.arrival_time,
            priority,
            self._eos_token_ids,
            cache_salt,
        )

    def _register(self, state: RequestState) -> None:
        """Make a request and its completions live (the inverse of :meth:`_forget`)."""
        for completion in state.completions:
            self._completions[completion.request_id] = completion
        self._requests[state.request_id] = state
        self._by_external.setdefault(state.external_id, []).append(state.request_id)

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request by internal or external id; return the engine ids to abort.

        An internal id of a parent (or of one of its children) aborts all its children; an
        external id aborts every request it names. Requests with a collector get a last output
        with finish_reason "abort". Unknown ids are ignored (empty list).
        """
        if request_id in self._requests:
            ids = [request_id]
        elif request_id in self._completions:
            ids = [self._completions[request_id].request.request_id]
        else:
            ids = list(self._by_external.get(request_id, ()))
        engine_ids: list[str] = []
        for rid in ids:
            state = self._requests.get(rid)
            if state is None:
                continue
            aborted = self._end(state)
            engine_ids.extend(c.request_id for c in aborted)
            if state.collector is not None:
                state.collector.put(abort_output(state, aborted))
        return engine_ids

    def propagate_error(self, exc: BaseException) -> None:
        """Put ``exc`` into every collector (the engine died); state is kept."""
        for state in self._requests.values():
            if state.collector is not None:
                state.collector.put(exc)

    def _end(self, state: RequestState) -> list[CompletionState]:
        """End a request now: its unfinished completions finish "abort" (returned) and it is
        forgotten."""
        aborted = [c for c in state.completions if c.finish_reason is None]
        for completion in aborted:
            completion.finish_reason = "abort"
        state.num_finished = state.n
        self._forget(state)
        return aborted

    def _forget(self, state: RequestState) -> None:
        for completion in state.completions:
            self._completions.pop(completion.request_id, None)
        self._requests.pop(state.request_id, None)
        siblings = self._by_external.get(state.external_id)
        if siblings is not None:
            siblings.remove(state.request_id)
            if not siblings:
                del self._by_external[state.external_id]

    # -- outputs --------------------------------------------------------------------------------

    def process_outputs(self, outputs: EngineCoreOutputs) -> ProcessedOutputs:
        """Apply one engine message; see :class:`ProcessedOutputs`.

        Ids that are not in flight (aborted or finished here) are ignored. n > 1 requests get
        one output per message carrying the completions that changed (all ``n`` at once, when
        finished, for FINAL_ONLY). Errors the engine reports are handled as the module
        docstring says; nothing is raised here.
        """
        completions = self._completions
        now = self.clock()
        step = StepOutputs(now)
        if outputs.prompt_logprobs:
            self._add_prompt_logprobs(outputs.prompt_logprobs)
        finished = {f.req_id: f for f in outputs.finished} if outputs.finished else None
        cached = outputs.num_cached_tokens or None
        logprobs = outputs.logprobs or None
        for request_id, token_ids in zip(outputs.req_ids, outputs.new_token_ids, strict=True):
            completion = completions.get(request_id)
            if completion is None:
                continue
            metrics = completion.request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            if cached is not None and request_id in cached:
                state = completion.request
                if state.num_cached_tokens is None:
                    state.num_cached_tokens = cached[request_id]
            metrics.last_token_time = now
            fin = finished.pop(request_id, None) if finished is not None else None
            entries = logprobs.get(request_id) if logprobs is not None else None
            self._update(completion, token_ids, fin, entries, step)
        if finished:
            for fin in finished.values():
                completion = completions.get(fin.req_id)
                if completion is not None:
                    self._update(completion, [], fin, None, step)
        return step.finish()

    def _update(
        self,
        completion: CompletionState,
        token_ids: list[int],
        fin: FinishedRequest | None,
        entries: list[TokenLogprobs] | None,
        step: StepOutputs,
    ) -> None:
        """Apply one step's tokens (and finish) to one completion and emit its output."""
        if fin is not None and fin.spec_num_drafts:
            metrics = completion.request.metrics
            metrics.spec_num_drafts += fin.spec_num_drafts
            metrics.spec_num_draft_tokens += fin.spec_num_draft_tokens
            metrics.spec_num_accepted_tokens += fin.spec_num_accepted_tokens
        detokenizer = completion.detokenizer
        if token_ids:
            before = detokenizer.num_tokens
            stop = detokenizer.update(
                token_ids, fin is not None and fin.finish_reason == "stop" and fin.error is None
            )
            if stop is not None:
                kept = detokenizer.num_tokens - before
                if kept < len(token_ids):
                    token_ids = token_ids[:kept]
                completion.finish_reason, completion.stop_reason = "stop", stop
                if fin is None:
                    step.result.reqs_to_abort.append(completion.request_id)
        if (
            fin is not None
            and completion.finish_reason is None
            and self._finish(completion, fin, step)
        ):
            return  # the whole request failed; its collector has the exception
        step_logprobs = None
        if completion.logprobs is not None:
            step_logprobs = self._logprobs(completion, entries, len(token_ids)) if entries else []
        finished = completion.finish_reason is not None
        if finished:
            detokenizer.finish()
            self._completion_done(completion, step.now)
        text = detokenizer.take(finished)
        output = completion_output(completion, text, token_ids, step_logprobs, finished)
        if output is not None:
            state = completion.request
            if state.n == 1:
                step.emit(state, request_output(state, [output]))
            else:
                step.add_parallel(state, output)

    def _finish(self, completion: CompletionState, fin: FinishedRequest, step: StepOutputs) -> bool:
        """Take the engine's finish of a completion; True when that failed the whole request
        (then it has no output to emit)."""
        if fin.error is None:
            completion.finish_reason = fin.finish_reason  # type: ignore[assignment]
            completion.stop_reason = fin.stop_reason
        elif completion.request.collector is not None:
            self._fail(completion, fin, step)
            return True
        else:
            completion.finish_reason = "error"
            completion.request.error = fin.error
        return False

    def _completion_done(self, completion: CompletionState, now: float) -> None:
        """A completion finished: it stops being live, and its request with its last one."""
        del self._completions[completion.request_id]
        state = completion.request
        state.num_finished += 1
        if state.finished:
            state.metrics.finished_time = now
            self._forget(state)

    def _fail(self, completion: CompletionState, fin: FinishedRequest, step: StepOutputs) -> None:
        """An engine-reported error of a request with a collector: the collector gets the
        exception and the whole request ends (running siblings are aborted in the engine)."""
        state = completion.request
        completion.finish_reason = "error"
        step.result.reqs_to_abort.extend(c.request_id for c in self._end(state))
        error = RetryableRequestError if fin.retryable else InvalidRequestError
        assert state.collector is not None and fin.error is not None
        state.collector.put(error(fin.error, state.external_id))

    # -- logprobs -------------------------------------------------------------------------------

    def _logprobs(
        self, completion: CompletionState, entries: list[TokenLogprobs], count: int
    ) -> list[PositionLogprobs]:
        """Positions of one step (the first ``count``: tokens after a stop string are dropped);
        adds the sampled tokens' logprobs to ``cumulative_logprob``."""
        decode = completion.detokenizer.decodes
        if len(entries) > count:
            entries = entries[:count]
        total = completion.cumulative_logprob or 0.0
        positions = []
        for entry in entries:
            positions.append(self._logprob_decoder.position(entry, decode))
            total += entry.logprobs[0]
        completion.cumulative_logprob = total
        return positions

    def _add_prompt_logprobs(self, mapping: dict[str, list[TokenLogprobs | None]]) -> None:
        for request_id, entries in mapping.items():
            completion = self._completions.get(request_id)
            if completion is None:
                continue
            prompt_logprobs = completion.request.prompt_logprobs
            if prompt_logprobs is None:
                continue
            decode = completion.detokenizer.decodes
            position = self._logprob_decoder.position
            prompt_logprobs.extend(None if e is None else position(e, decode) for e in entries)
