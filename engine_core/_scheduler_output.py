"""What the scheduler hands the backend each step (wire types; re-exported by ``engine_core.abc``).

The batch order of a step is ``cached.req_ids`` followed by ``new_reqs``; a backend returns its
sampled tokens in that order.
"""

from __future__ import annotations

import msgspec

from engine_core.sampling_params import SamplingParams

__all__ = ["CachedRequestData", "NewRequestData", "SchedulerOutput"]


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the backend has not seen, or one resumed after preemption, sent in full."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    """The whole block table of the request."""
    num_computed_tokens: int
    """Tokens whose KV is already in the cache (prefix-cache hits); compute starts here."""
    num_scheduled_tokens: int
    output_token_ids: list[int] = []
    """Tokens generated before a preemption; the sequence is prompt + these."""
    eos_token_ids: list[int] = []
    """EOS ids that stop this request (empty with ``ignore_eos``). With
    ``sampling_params.stop_token_ids`` they are masked until ``min_tokens`` tokens exist."""


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """Compact diffs for requests the backend already holds, as parallel lists."""

    req_ids: list[str] = []
    new_block_ids: list[list[int] | None] = []
    """Blocks appended to each block table this step (None: none)."""
    num_computed_tokens: list[int] = []
    num_scheduled_tokens: list[int] = []


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's batch."""

    new_reqs: list[NewRequestData]
    cached: CachedRequestData
    total_num_scheduled_tokens: int
    finished_req_ids: list[str] = []
    """Requests that ended since the previous step: drop their state."""
    preempted_req_ids: list[str] = []
    """Requests preempted this step: drop their state; they come back as new requests."""

    @property
    def num_reqs(self) -> int:
        return len(self.cached.req_ids) + len(self.new_reqs)

    @property
    def req_ids(self) -> list[str]:
        """Batch order: cached requests, then new ones."""
        return self.cached.req_ids + [r.req_id for r in self.new_reqs]

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
