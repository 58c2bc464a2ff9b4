"""What the scheduler hands the backend each step (wire types; re-exported by ``engine_core.abc``).

The batch order of a step is ``cached.req_ids`` followed by ``new_reqs``; a backend returns its
sampled tokens in that order. Speculative decoding adds drafts to cached requests
(``CachedRequestData.spec_token_ids``) and asks backend proposers for the next step's drafts
(``SchedulerOutput.num_draft_tokens``); ``engine_core.abc`` documents the contract.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol, TypeVar

import msgspec

from engine_core.kv_connector import KVConnectorMetadata
from engine_core.sampling_params import SamplingParams

__all__ = ["CachedRequestData", "ComputedState", "NewRequestData", "SchedulerOutput"]


class ComputedState(Protocol):
    """A backend's per-request state, as far as :meth:`CachedRequestData.diffs` needs it."""

    num_computed_tokens: int


StateT = TypeVar("StateT", bound=ComputedState)


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the backend has not seen, or one resumed after preemption, sent in full."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int | list[int]]
    """The whole block table of the request: a list of ids (one KV-cache group), or one such
    list per group (``block_ids[g]``, all of one length; a released block is a null id)."""
    num_computed_tokens: int
    """Tokens whose KV is already in the cache (prefix-cache hits); compute starts here."""
    num_scheduled_tokens: int
    output_token_ids: list[int] = []
    """Tokens generated before a preemption; the sequence is prompt + these."""
    eos_token_ids: list[int] = []
    """EOS ids that stop this request (empty with ``ignore_eos``). With
    ``sampling_params.stop_token_ids`` they are masked until ``min_tokens`` tokens exist."""
    lora_int_id: int = 0
    """The LoRA adapter the request runs with (``LoRARequest.lora_int_id``; 0: the base
    model). The backend's ``add_lora`` for it has returned; it is listed in the step's
    ``SchedulerOutput.lora_ids``. A cached request keeps it."""

    # NOTE: a new request never carries drafts (speculative decoding): admitted or resumed, it
    # computes its sequence and samples one token; drafts come with its later steps as cached.


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """Compact diffs for requests the backend already holds, as parallel lists."""

    req_ids: list[str] = []
    new_block_ids: list[list[int | list[int]] | None] = []
    """Blocks appended to each block table this step (None: none); with several KV-cache
    groups, one list per group (of one length)."""
    num_computed_tokens: list[int] = []
    num_scheduled_tokens: list[int] = []
    """Tokens computed this step, drafts included."""
    spec_token_ids: list[list[int]] = []
    """Speculative decoding: each request's drafts, verified this step (an empty list: none).
    The column is empty when no request of the step has drafts, else parallel to ``req_ids``.
    A request with ``s`` drafts has ``num_scheduled_tokens == 1 + s``: its last known token at
    position ``num_computed_tokens``, then the drafts in order (see :meth:`drafts_of`)."""

    def drafts_of(self, index: int) -> list[int]:
        """The drafts of the ``index``-th request (an empty list: none)."""
        return self.spec_token_ids[index] if self.spec_token_ids else []

    def diffs(
        self, states: Mapping[str, StateT]
    ) -> Iterator[tuple[StateT, list[int | list[int]] | None, int, int]]:
        """Each request's backend state (looked up in ``states``) with its new block ids, its
        computed tokens before the step and its scheduled tokens. Raises ``RuntimeError`` when
        the columns disagree in length, an id is unknown, or the backend computed a different
        number of tokens than the scheduler says."""
        num = len(self.req_ids)
        if not (
            len(self.new_block_ids)
            == len(self.num_computed_tokens)
            == len(self.num_scheduled_tokens)
            == num
        ):
            raise RuntimeError("CachedRequestData columns have different lengths")
        if self.spec_token_ids and len(self.spec_token_ids) != num:
            raise RuntimeError("CachedRequestData.spec_token_ids has a different length")
        for req_id, new_block_ids, computed, num_scheduled in zip(
            self.req_ids,
            self.new_block_ids,
            self.num_computed_tokens,
            self.num_scheduled_tokens,
            strict=True,
        ):
            state = states.get(req_id)
            if state is None:
                raise RuntimeError(f"cached request {req_id!r} is unknown to the backend")
            if computed != state.num_computed_tokens:
                raise RuntimeError(
                    f"request {req_id!r}: the scheduler says {computed} tokens are computed, "
                    f"the backend computed {state.num_computed_tokens}"
                )
            yield state, new_block_ids, computed, num_scheduled


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's batch. ``total_num_scheduled_tokens`` counts drafts too."""

    new_reqs: list[NewRequestData]
    cached: CachedRequestData
    total_num_scheduled_tokens: int
    finished_req_ids: list[str] = []
    """Requests that ended since the previous step: drop their state."""
    preempted_req_ids: list[str] = []
    """Requests preempted this step: drop their state; they come back as new requests."""
    num_draft_tokens: int = 0
    """Speculative decoding with a backend proposer: how many drafts to return for each
    request that samples a token this step (``ModelRunnerOutput.draft_token_ids``), for its
    next step; 0: none (always so with the core's ``"ngram"`` proposer). It may be one more
    than the next step verifies: the extra draft is scored against the token sampled after the
    others, which measures acceptance at no cost."""
    draft_req_ids: list[str] | None = None
    """The requests to draft for (None: every request that samples a token this step), when
    the engine drafts only some of them (per-request gating, probes while speculation is
    off)."""
    kv_connector_metadata: KVConnectorMetadata | None = None
    """The KV connector's loads, saves and cancellations for this step (None: no connector, or
    nothing for it); the backend hands it to its connector worker half
    (``engine_core.kv_connector``). With a connector a step may schedule no tokens
    (``total_num_scheduled_tokens == 0``) while transfers are in flight: the backend then runs
    no forward pass, only its connector's calls, and returns an empty output with the report."""
    lora_ids: tuple[int, ...] = ()
    """LoRA: the adapters the running requests use (sorted ``lora_int_id`` values, 0 never
    listed; at most ``EngineConfig.max_loras``): every adapter of this step's requests is
    among them. Empty: LoRA off, or only the base model runs."""

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
