"""What goes into and out of the engine core, read by both sides of the pipe: the requests, the
per-step outputs, the startup report (:class:`EngineInfo`) and the stats (msgspec structs; no
pickle anywhere), and the control calls a client may forward (:data:`UTILITY_METHODS`, checked by
:func:`check_utility_call`, with :class:`PauseMode`)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import msgspec

from engine_core.abc import TokenLogprobs
from engine_core.lora import LoRARequest
from engine_core.sampling_params import SamplingParams

__all__ = [
    "PauseMode",
    "UTILITY_METHODS",
    "check_utility_call",
    "EngineCoreOutputs",
    "DPEngineCoreOutputs",
    "EngineLoad",
    "EngineCoreRequest",
    "EngineInfo",
    "EngineStats",
    "KVGroupStats",
    "FinishedRequest",
    "KVEvents",
]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, tag="add"):
    """A tokenized request as the engine core receives it (tagged ``"add"`` on the wire)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    eos_token_ids: list[int] = []
    """EOS ids of the tokenizer and generation config; ignored with ``ignore_eos``."""
    cache_salt: str | None = None
    data_parallel_rank: int | None = None
    """Pin the request to this engine of a data-parallel deployment (None: the router
    decides). Engines ignore it."""
    resume_output_token_ids: list[int] = []
    """Tokens an engine that died already generated for this request: the engine continues after
    them, counting them as output (``max_tokens``, stop rules, penalties) without emitting them
    again."""
    kv_transfer_params: dict[str, Any] | None = None
    """For the KV connector (prefill/decode disaggregation, ``docs/disaggregation.md``): where
    the request's KV comes from, or that a remote engine decodes it. Engines without a
    connector ignore it."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter the request runs with (None: the base model)."""


class KVEvents(msgspec.Struct, array_like=True, omit_defaults=True):
    """How an engine's prefix cache changed in one step: the 16-byte digests of blocks that
    became cached and of blocks that stopped being cached (disjoint; each block's last change in
    the step), after forgetting everything when ``cleared``."""

    stored: list[bytes] = []
    removed: list[bytes] = []
    cleared: bool = False
    host_stored: list[bytes] = []
    """Digests of blocks that entered the engine's host KV tier (a cheaper hit: they are loaded,
    not computed)."""
    host_removed: list[bytes] = []
    """Digests of blocks that left it."""


class EngineLoad(msgspec.Struct, array_like=True):
    """An engine's load after a step (sent by the engines of a data-parallel deployment)."""

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_blocks: int


class FinishedRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request that ended in this step (its last tokens, if any, are in the same message)."""

    req_id: str
    finish_reason: str
    stop_reason: int | str | None = None
    error: str | None = None
    retryable: bool = False
    """The request was rejected for now (the engine is paused); sending it again later may work."""
    spec_num_drafts: int = 0
    """Speculative decoding: the steps in which the request verified drafts."""
    spec_num_draft_tokens: int = 0
    """Speculative decoding: the drafts it verified."""
    spec_num_accepted_tokens: int = 0
    """Speculative decoding: the drafts accepted."""
    kv_transfer_params: dict[str, Any] | None = None
    """What the KV connector returned for the request when it finished
    (``KVConnectorScheduler.request_finished``; None: nothing)."""


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, tag="out"):
    """Everything one step produced, in columns: one entry per request that got tokens (tagged
    ``"out"`` on the wire)."""

    req_ids: list[str] = []
    new_token_ids: list[list[int]] = []
    finished: list[FinishedRequest] = []
    logprobs: dict[str, list[TokenLogprobs]] = {}
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
    num_cached_tokens: dict[str, int] = {}
    """Prefix-cache hit length of requests emitting their first tokens."""
    timestamp: float = 0.0

    @property
    def is_empty(self) -> bool:
        """Whether the step produced nothing to report (no tokens, endings or prompt
        logprobs)."""
        return not (self.req_ids or self.finished or self.prompt_logprobs)


class DPEngineCoreOutputs(EngineCoreOutputs, tag="dpout"):
    """A step's outputs from an engine of a data-parallel deployment (tagged ``"dpout"``): the
    same columns, then the step's prefix-cache changes and the engine's load, so the router
    hears of both with the tokens, in order. An engine alone sends plain
    :class:`EngineCoreOutputs`, without a byte of either."""

    kv_events: KVEvents | None = None
    """Prefix-cache changes of the step."""
    load: EngineLoad | None = None
    """The engine's load after the step."""

    @property
    def is_empty(self) -> bool:
        """Whether the step produced nothing to report (no tokens, endings, prompt logprobs or
        prefix-cache changes)."""
        return not (self.req_ids or self.finished or self.prompt_logprobs or self.kv_events)


class KVGroupStats(msgspec.Struct, frozen=True, kw_only=True):
    """One KV-cache group's blocks (``EngineStats.kv_groups``)."""

    kind: str
    """``"full_attention"``, ``"sliding_attention"`` or ``"chunked_attention"``."""
    window: int | None
    """The sliding window (or the chunk) in tokens; None for full attention."""
    blocks_in_use: int
    """Blocks of the pool this group's tables hold now (released ones not counted)."""


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the engine's state and counters."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    """Fraction of KV blocks in use (0..1)."""
    prefix_cache_hit_rate: float
    """Hit tokens / queried tokens over all admitted requests."""
    num_preemptions: int
    num_steps: int
    num_recomputed_tokens: int = 0
    """Tokens computed again after a preemption (recompute preemption's cost)."""
    seconds_since_progress: float = 0.0
    """Seconds since a step last computed a token while requests were queued (0 while idle):
    past ``EngineConfig.stall_timeout_s`` the engine reports itself unhealthy."""
    num_kv_blocks: int
    num_free_kv_blocks: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_malformed_messages: int = 0
    """Input frames the engine process could not decode. Those that carried a readable request
    id were answered with an error for that request; the others were dropped."""
    device_busy_s: float = 0.0
    """Seconds during which the backend had a step in flight (cumulative; under async
    scheduling the device time its steps report, where the backend measures it): against wall
    time, how much of it the host kept the device fed."""
    num_engines: int = 1
    """Engines of a data-parallel deployment (the counts above are summed over the live ones)."""
    num_engines_alive: int = 1
    engines: list[EngineStats] = []
    """Each live engine's own stats, by rank (data parallelism only)."""
    engine_ranks: list[int] = []
    """The rank of each entry of ``engines``."""
    kv_groups: list[KVGroupStats] = []
    """Per KV-cache group, in the order of the block tables (one entry for a model whose
    layers are all full attention)."""
    spec_num_speculative_tokens: int = 0
    """Speculative decoding: the most drafts a request verifies in a step (0: off)."""
    spec_num_drafts: int = 0
    """Verifications: (request, step) pairs with at least one draft (vLLM's ``num_drafts``)."""
    spec_num_draft_tokens: int = 0
    """Drafts verified."""
    spec_num_accepted_tokens: int = 0
    """Drafts accepted. Acceptance rate: accepted / draft tokens; mean acceptance length:
    1 + accepted / drafts."""
    spec_accepted_per_pos: list[int] = []
    """Drafts accepted at each position (0-based)."""
    spec_drafted_per_pos: list[int] = []
    """Drafts verified at each position."""
    spec_current_k: int = 0
    """The draft count the policy chose for the last step (0: not speculating)."""
    spec_steps_by_k: dict[int, int] = {}
    """Steps by the draft count chosen."""
    spec_shadow_drafts: int = 0
    """Drafts scored without being verified: the one past the verified drafts, scored against
    the token sampled after them, and those of requests probed while not drafted."""
    spec_shadow_accepted: int = 0
    """Of those, the right ones."""
    kv_offload_hit_tokens: int = 0
    """KV connector (host tier): prompt tokens whose KV was loaded instead of computed."""
    kv_offload_bytes_loaded: int = 0
    kv_offload_bytes_stored: int = 0
    kv_offload_load_s: float = 0.0
    """Seconds the finished loads took, summed."""
    kv_offload_store_s: float = 0.0
    kv_offload_failed_blocks: int = 0
    """Blocks whose load failed (dropped, corrupt, late): recomputed, or their request failed."""
    kv_offload_resident_blocks: int = 0
    """Blocks stored in the host tier now (all groups)."""
    kv_offload_capacity_blocks: int = 0
    """Blocks the host tier holds at most (0: no host tier)."""
    kv_offload_free_blocks: int = 0
    """Host blocks neither stored nor being written (idle: capacity - resident; any other
    difference is a leak)."""
    kv_parked_requests: int = 0
    """Requests waiting for their KV load now (``WAITING_FOR_REMOTE_KVS``)."""
    kv_loads_cancelled: int = 0
    """Parked loads given up on (the queue needed their blocks, the lease ran out, an abort)."""
    engine_role: str = "both"
    """Prefill/decode disaggregation: the engine's role (``EngineConfig.engine_roles``)."""
    lora_running: dict[str, int] = {}
    """LoRA: running requests per adapter name (adapters with live requests only)."""
    lora_waiting: dict[str, int] = {}
    """LoRA: waiting requests per adapter name (for a slot, or for the adapter's load)."""
    lora_loaded: list[str] = []
    """LoRA: the names of the adapters loaded now."""
    kv_transfer: dict[str, float] = {}
    """The ``"pd"`` connector's counters (``docs/disaggregation.md``): ``pd_exports``,
    ``pd_exports_confirmed``, ``pd_lease_expired``, ``pd_transfers``, ``pd_transfer_failed``
    (the decode side recomputed), ``pd_released_unread``, ``pd_other_host``, ``pd_bytes``,
    ``pd_transfer_s``; summed over the engines of a deployment. Empty without it."""


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a started engine core reports to its client (the READY handshake)."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    backend: str
    backend_options: dict[str, Any] = {}
    """The options the backend runs with (those ``backend="auto"`` added included)."""
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    """The token budget of a step."""
    async_scheduling: bool = False
    speculative_method: str | None = None
    """The draft method, when speculative decoding is on."""
    kv_groups: str = ""
    """The KV-cache groups, when the layers are not all full attention (e.g.
    ``full_attention x2, sliding_attention(1024) x2, ...``); empty: one group."""
    backend_settings: dict[str, str | int | float | bool] = {}
    """What the backend resolved for itself (``Backend.resolved_settings``: its device,
    kernels, CPU threads)."""

    def describe(self) -> str:
        """The resolved configuration in one line, for a startup log."""
        options = f" {self.backend_options}" if self.backend_options else ""
        if self.backend_settings:
            settings = ", ".join(f"{k} {v}" for k, v in self.backend_settings.items())
            options += f" ({settings})"
        return (
            f"backend {self.backend}{options}; KV cache {self.num_kv_blocks} blocks of "
            f"{self.block_size} tokens"
            + (f" (groups: {self.kv_groups})" if self.kv_groups else "")
            + f"; max_model_len {self.max_model_len}; "
            f"max_num_seqs {self.max_num_seqs}; token budget {self.max_num_batched_tokens} per "
            f"step; async scheduling {'on' if self.async_scheduling else 'off'}; speculative "
            f"decoding {self.speculative_method or 'off'}"
        )


class PauseMode(enum.StrEnum):
    """What :meth:`EngineCore.pause_generation` does with in-flight requests. A ``str`` enum:
    callers pass the plain strings as well, and the wire carries the same values."""

    ABORT = "abort"
    """They end as aborted; new requests are rejected (retryable) until resumed."""
    WAIT = "wait"
    """They run to completion; new requests are rejected (retryable) until resumed."""
    KEEP = "keep"
    """They freeze in place; new requests queue."""

    @classmethod
    def parse(cls, mode: str) -> PauseMode:
        """``mode`` as a member; ``ValueError`` naming the modes when it is none of them."""
        try:
            return cls(mode)
        except ValueError:
            raise ValueError(f"mode must be one of {', '.join(cls)}, got {mode!r}") from None


UTILITY_METHODS = frozenset(
    {
        "get_stats",
        "reset_prefix_cache",
        "profile",
        "sleep",
        "wake_up",
        "check_health",
        "pause_generation",
        "resume_generation",
        "is_paused",
        "kv_cache_snapshot",
        "add_lora",
        "remove_lora",
        "list_loras",
        "pin_lora",
    }
)
"""The control calls a client forwards to the engine core by name (methods of ``EngineCore``)."""


def check_utility_call(method: str, args: Sequence[Any]) -> None:
    """``ValueError`` unless ``method`` is one of :data:`UTILITY_METHODS` (and, for
    ``pause_generation``, its mode one of :class:`PauseMode`'s): each client refuses a bad call
    before it reaches the engine, and the engine refuses it again."""
    if method not in UTILITY_METHODS:
        raise ValueError(f"unknown utility method {method!r}")
    if method == "pause_generation" and args:
        PauseMode.parse(args[0])
