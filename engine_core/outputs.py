"""What a request produces, as the caller sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["CompletionOutput", "FinishReason", "Logprob", "RequestMetrics", "RequestOutput"]

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(slots=True)
class Logprob:
    """The log-probability of one candidate token at one position."""

    logprob: float
    rank: int | None = None
    """1-based rank of the token in the distribution."""
    decoded_token: str | None = None


# One entry per position: {token_id: Logprob} with the top-k plus the sampled token.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the completion; None for EOS or length."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps of one request, in seconds of the engine's clock (``time.monotonic``)."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    spec_num_drafts: int = 0
    """Speculative decoding: steps in which the request verified drafts (summed over its
    completions; known once the engine ended them: a completion the front end ends on a stop
    string does not report)."""
    spec_num_draft_tokens: int = 0
    """Speculative decoding: drafts verified."""
    spec_num_accepted_tokens: int = 0
    """Speculative decoding: drafts accepted."""

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        """Tokens per verifying step, the sampled one included (1 + accepted / drafts, as
        vLLM counts it); None before any."""
        if not self.spec_num_drafts:
            return None
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """The state of one request (all its completions) at one point of its generation."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: str | None = field(default=None)
    """Why the request failed, when ``finish_reason`` is ``"error"``."""
