"""A request inside the engine core, and its state machine.

Glossary:

- **token**: one id of the vocabulary; a request's sequence is its prompt tokens followed by its
  output tokens.
- **block**: ``block_size`` consecutive token positions of one request's KV cache; a request's
  ``block_table`` maps its positions to physical blocks of the pool.
- **slot**: one token position inside one physical block (``block_id * block_size + offset``).
- **step**: one scheduling round: schedule, run the model once, apply its output.
- **chunk**: the part of a prompt computed in one step when the prompt does not fit the step's
  token budget (chunked prefill).
- ``num_computed_tokens``: positions whose KV is in the cache. Each step the scheduler lets a
  request catch up with ``num_tokens``; there is no separate prefill or decode phase.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Protocol

from engine_core._core.block_hash import block_keys, extra_key_bytes

if TYPE_CHECKING:
    from engine_core._core.block_pool import KVCacheBlock
    from engine_core._core.drafts import DraftState
    from engine_core.lora import LoRARequest
    from engine_core.sampling_params import SamplingParams

__all__ = ["GrammarMatcher", "InvalidTransition", "Request", "RequestStatus"]


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status > PREEMPTED`` means finished."""

    WAITING = 0
    WAITING_FOR_GRAMMAR = 1
    RUNNING = 2
    WAITING_FOR_REMOTE_KVS = 3
    """Parked with its blocks allocated while a KV connector loads its external tokens; its
    computed-token count is provisional until the load is reported (``docs/kv_connector.md``)."""
    PREEMPTED = 4
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self)


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

_S = RequestStatus
_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
_FINISHED = frozenset(s for s in RequestStatus if s.is_finished)
# The one table of allowed transitions; Request.set_status is the one place that enforces it.
ALLOWED_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.WAITING: frozenset(
        {_S.RUNNING, _S.WAITING_FOR_REMOTE_KVS, _S.FINISHED_ABORTED, _S.FINISHED_ERROR}
    ),
    # A parked load ends (reported, failed or cancelled): back to the queue, or an error.
    _S.WAITING_FOR_REMOTE_KVS: frozenset({_S.WAITING, _S.FINISHED_ABORTED, _S.FINISHED_ERROR}),
    _S.WAITING_FOR_GRAMMAR: frozenset({_S.WAITING, _S.FINISHED_ABORTED, _S.FINISHED_ERROR}),
    _S.RUNNING: frozenset({_S.PREEMPTED}) | _FINISHED,
    # A preempted request ends with a stop or the length cap on a token of a step that was in
    # flight when it was preempted (async scheduling).
    _S.PREEMPTED: frozenset({_S.RUNNING, _S.WAITING_FOR_REMOTE_KVS}) | _FINISHED,
    **{s: frozenset() for s in _FINISHED},
}


class GrammarMatcher(Protocol):
    """The grammar state of a constrained request, as the scheduler advances it (the engine's
    structured-output module implements it; the scheduler imports nothing of llguidance)."""

    eos_token_ids: frozenset[int]
    """The tokens that end the grammar's output once it is complete."""
    terminated: bool
    """Whether the grammar has accepted the EOS token that ends it."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar does not allow it (the request
        then ends: the grammar is not used again)."""
        ...

    def is_stopped(self) -> bool:
        """Whether the grammar is complete: it allows no token but EOS any more."""
        ...

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of ``token_ids``, in order, the grammar would accept from its current state
        (speculative decoding truncates drafts to them); the state does not change."""
        ...


class InvalidTransition(RuntimeError):
    """A request was moved between states the state machine does not connect (a bug)."""


class Request:
    """One request's state in the engine core.

    Plain Python with ``__slots__``: the scheduler touches these fields for every request in
    every step, so they are attributes, not properties, where it matters.
    """

    __slots__ = (
        "request_id",
        "sampling_params",
        "arrival_time",
        "priority",
        "cache_salt",
        "lora_int_id",
        "num_prompt_tokens",
        "all_token_ids",
        "num_computed_tokens",
        "num_output_placeholders",
        "status",
        "max_tokens",
        "min_tokens",
        "stop_token_ids",
        "eos_token_ids",
        "stop_reason",
        "error",
        "block_keys",
        "blocks",
        "group_blocks",
        "released_blocks",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_preemptions",
        "recompute_until",
        "num_bypassed_steps",
        "num_prompt_logprobs_sent",
        "use_structured_output",
        "grammar",
        "drafting",
        "kv_transfer_params",
        "_first_block_extra",
        "_block_size",
        "_hash_blocks",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        block_size: int,
        arrival_time: float = 0.0,
        priority: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        cache_salt: str | None = None,
        max_tokens: int | None = None,
        hash_blocks: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_int_id = 0 if lora_request is None else lora_request.lora_int_id
        """The LoRA adapter it runs with (0: the base model)."""
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        """Tokens scheduled to be sampled in a step still in flight (async scheduling): their
        positions count as computed once the step after is scheduled, their values are not
        known yet."""
        # A constrained request waits for its grammar before it can be scheduled.
        self.use_structured_output = sampling_params.structured_outputs is not None
        self.status = (
            RequestStatus.WAITING_FOR_GRAMMAR
            if self.use_structured_output
            else RequestStatus.WAITING
        )
        self.grammar: GrammarMatcher | None = None
        """The matcher of a constrained request, once its grammar is compiled."""
        self.drafting: DraftState | None = None
        """Speculative decoding: its drafts and acceptance (None: never considered)."""
        self.kv_transfer_params: dict[str, Any] | None = None
        """The KV connector's parameters from the client (``EngineCoreRequest``)."""
        limit = sampling_params.max_tokens if max_tokens is None else max_tokens
        self.max_tokens = limit if limit is not None else 1 << 62
        self.min_tokens = sampling_params.min_tokens
        # EOS stops with stop_reason None; stop_token_ids stop with the token as stop_reason.
        self.eos_token_ids = frozenset(() if sampling_params.ignore_eos else eos_token_ids)
        self.stop_token_ids = self.eos_token_ids | frozenset(sampling_params.stop_token_ids or ())
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.blocks: list[KVCacheBlock] = []
        self.group_blocks: list[list[KVCacheBlock]] | None = None
        """With several KV-cache groups (or a window group): one block table per group, a
        released block's entry being the null block; ``blocks`` is then ``group_blocks[0]``."""
        self.released_blocks: list[int] | None = None
        """Per group, the entries before it that are released (window and chunked groups)."""
        self.num_cached_blocks = 0
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.recompute_until = 0
        """After a preemption: the tokens it had computed, counted as recomputed when it is
        admitted again (``Scheduler.num_recomputed_tokens``; 0: none owed)."""
        self.num_bypassed_steps = 0
        """Steps in which requests behind it in the queue were admitted while its blocks were
        not free (``EngineConfig.max_bypass_steps`` bounds them)."""
        self.num_prompt_logprobs_sent = 0
        self._block_size = block_size
        self._hash_blocks = hash_blocks
        self._first_block_extra = extra_key_bytes(
            cache_salt, b"" if lora_request is None else lora_request.key_bytes()
        )
        self.block_keys: list[bytes] = (
            block_keys(self.all_token_ids, block_size, 0, None, self._first_block_extra)
            if hash_blocks
            else []
        )

    # -- derived values -------------------------------------------------------------------------

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def samples_in_flight(self) -> bool:
        """Async scheduling: whether the step scheduled last samples this request's newest
        placeholder (it computes up to the position before it), so the step's results bring
        its next token."""
        placeholders = self.num_output_placeholders
        return bool(placeholders) and (
            self.num_computed_tokens == len(self.all_token_ids) + placeholders - 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    # -- mutation -------------------------------------------------------------------------------

    def set_status(self, new: RequestStatus) -> None:
        """Move to ``new``; raises :class:`InvalidTransition` if the table does not allow it."""
        if new not in ALLOWED_TRANSITIONS[self.status]:
            raise InvalidTransition(
                f"request {self.request_id!r}: {self.status.name} -> {new.name} is not allowed"
            )
        self.status = new

    def append_output_token(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """Append one generated token, keying the block it fills when it fills one, and apply
        the stop rules to it: returns the finished status it ends the request with, or None.

        The stop rules, in order (the one place they are written):

        1. a stop token (EOS, or one of ``stop_token_ids``) once more than ``min_tokens``
           outputs exist: FINISHED_STOPPED; one of ``stop_token_ids`` that is not EOS becomes
           ``stop_reason``;
        2. ``max_tokens`` outputs, or ``max_model_len`` tokens in all: FINISHED_LENGTH_CAPPED.

        The status is not set here: the scheduler ends the request (and a constrained request's
        grammar adds rules around these).

        NOTE: appending and the stop rules are one method, not two, because this runs for every
        token of every request: a second call per token costs a tenth of a decode step's update.
        """
        tokens = self.all_token_ids
        tokens.append(token_id)
        num_tokens = len(tokens)
        if self._hash_blocks and num_tokens % self._block_size == 0:
            self._key_new_blocks()
        num_output = num_tokens - self.num_prompt_tokens
        if token_id in self.stop_token_ids and num_output > self.min_tokens:
            if token_id not in self.eos_token_ids:
                self.stop_reason = token_id
            return _STOPPED
        if num_output >= self.max_tokens or num_tokens >= max_model_len:
            return _LENGTH_CAPPED
        return None

    def _key_new_blocks(self) -> None:
        keys = self.block_keys
        keys.extend(
            block_keys(
                self.all_token_ids,
                self._block_size,
                len(keys),
                keys[-1] if keys else None,
                self._first_block_extra,
            )
        )

    def __lt__(self, other: Request) -> bool:
        # Priority order: lower value first, then earlier arrival, then id.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
