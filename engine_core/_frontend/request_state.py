"""Front-end state of one in-flight request and of each of its completions."""

from __future__ import annotations

from engine_core._frontend.collector import RequestOutputCollector
from engine_core._frontend.cumulative import CumulativeOutputs
from engine_core._frontend.detokenizer import Detokenizer
from engine_core.outputs import (
    CompletionOutput,
    FinishReason,
    PositionLogprobs,
    RequestMetrics,
)
from engine_core.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["CompletionState", "RequestState"]


class RequestState:
    """One request as the caller sees it: one completion, or the parent of ``n``."""

    __slots__ = (
        "request_id",
        "external_id",
        "prompt",
        "prompt_token_ids",
        "kind",
        "n",
        "completions",
        "num_finished",
        "final_outputs",
        "metrics",
        "collector",
        "cumulative",
        "num_cached_tokens",
        "prompt_logprobs",
        "prompt_logprobs_sent",
        "error",
    )

    def __init__(
        self,
        request_id: str,
        external_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        collector: RequestOutputCollector | None,
    ) -> None:
        self.request_id = request_id
        self.external_id = external_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.kind = int(params.output_kind)
        self.n = params.n
        self.completions: list[CompletionState] = []
        self.num_finished = 0
        self.final_outputs: list[CompletionOutput | None] = [None] * self.n if self.n > 1 else []
        """FINAL_ONLY with n > 1: the finished completions by index."""
        self.metrics = RequestMetrics(arrival_time)
        self.collector = collector
        self.cumulative = (
            CumulativeOutputs()
            if collector is None and self.kind == RequestOutputKind.CUMULATIVE
            else None
        )
        """CUMULATIVE without a collector: what makes its outputs cumulative as they are
        returned (a collector does it for its consumer)."""
        self.num_cached_tokens: int | None = None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [] if params.prompt_logprobs is not None else None
        )
        self.prompt_logprobs_sent = False
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return self.num_finished == self.n


class CompletionState:
    """One engine request: one completion of a request."""

    __slots__ = (
        "request_id",
        "index",
        "request",
        "detokenizer",
        "token_ids",
        "text_parts",
        "logprobs",
        "cumulative_logprob",
        "finish_reason",
        "stop_reason",
    )

    def __init__(
        self,
        request_id: str,
        index: int,
        request: RequestState,
        detokenizer: Detokenizer,
        logprobs: bool,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.request = request
        self.detokenizer = detokenizer
        # Streamed kinds keep no output here: their outputs are deltas (see request_outputs).
        self.token_ids: list[int] = []
        """All output tokens (FINAL_ONLY)."""
        self.text_parts: list[str] = []
        """Output text pieces, joined when finished (FINAL_ONLY)."""
        self.logprobs: list[PositionLogprobs] | None = [] if logprobs else None
        """None when no logprobs were asked for; else all of them (FINAL_ONLY)."""
        self.cumulative_logprob: float | None = 0.0 if logprobs else None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
