"""Engine configuration: one validated, serializable struct shared by every layer."""

from __future__ import annotations

import json
import os
from typing import Any, Literal

import msgspec

__all__ = [
    "COMMAND_LINE_ENV",
    "EngineConfig",
    "SpeculativeConfig",
    "backend_options_hint",
    "parse_size",
]

DEFAULT_MAX_MODEL_LEN = 8192

COMMAND_LINE_ENV = "ENGINE_CORE_COMMAND_LINE"
"""Set (to 1) by the ``engine-core`` command, and so inherited by its engine process: hints in
error messages then show flags rather than Python."""


def backend_options_hint(options: dict[str, Any]) -> str:
    """How to pass ``options`` as the user would type them: ``--backend-options '{...}'`` under
    the ``engine-core`` command, else ``backend_options={...}``."""
    if os.environ.get(COMMAND_LINE_ENV) == "1":
        return f"--backend-options '{json.dumps(options)}'"
    return f"backend_options={options!r}"


def _positive(
    name: str, value: int | float | None, *, allow_none: bool = True, integer: bool = False
) -> None:
    if value is None and allow_none:
        return
    kinds = int if integer else (int, float)
    if not isinstance(value, kinds) or isinstance(value, bool) or not value > 0:  # NaN too
        raise ValueError(f"{name} must be {'an int ' if integer else ''}> 0, got {value!r}")


SPEC_METHODS_IN_CORE = frozenset({"ngram"})
"""Speculative methods whose drafts the engine core proposes itself (from token ids alone); any
other method names a proposer of the backend (``SpecSupport.proposers``)."""


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_size(name: str, value: Any) -> int:
    """Bytes from an int or a size such as ``"8GiB"``, ``"512MB"``, ``"1.5g"`` (decimal units:
    k, M, G, T; binary: KiB, MiB, GiB, TiB). ``ValueError`` naming ``name`` for a negative
    value or one that is not a size."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size in bytes (e.g. 8GiB), got {value!r}")
    if isinstance(value, int):
        number: float = value
    elif isinstance(value, str):
        text = value.strip().replace("_", "")
        digits = text.rstrip("bBkKmMgGtTiI ")
        unit = text[len(digits) :].strip().lower()
        try:
            number = float(digits) * _SIZE_UNITS[unit]
        except (ValueError, KeyError):
            raise ValueError(
                f"{name} must be a size in bytes (e.g. 8GiB, 512MB, 0), got {value!r}"
            ) from None
    else:
        raise ValueError(f"{name} must be a size in bytes (e.g. 8GiB), got {value!r}")
    if not number >= 0 or number != number:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return int(number)


VICTIM_POLICIES = ("last_admitted", "least_progress")
"""The built-in values of ``EngineConfig.preemption_victim``."""


def check_victim_policy_name(value: Any) -> None:
    """``ValueError`` naming ``preemption_victim`` unless ``value`` is a built-in policy or a
    ``"module:attribute"`` path."""
    if isinstance(value, str) and (
        value in VICTIM_POLICIES or (value.count(":") == 1 and all(value.split(":")))
    ):
        return
    raise ValueError(
        "preemption_victim must be 'last_admitted', 'least_progress' or 'module:attribute' "
        f"(a PreemptionVictimPolicy), got {value!r}"
    )


def _non_negative_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


class SpeculativeConfig(
    msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True, forbid_unknown_fields=True
):
    """Speculative decoding: each step a request may verify up to ``num_speculative_tokens``
    guessed tokens (drafts) besides the one it samples, and keeps the longest prefix of them the
    model agrees with. Output is token-identical to decoding without speculation (greedy, and
    seeded sampling on a backend with ``SpecSupport.exact_verification``).

    Validated at construction; the engine refuses it at startup for a backend that cannot verify
    drafts (``Backend.spec_support()`` None) or does not offer ``method``.
    """

    method: str = "ngram"
    """Where drafts come from: ``"ngram"`` (prompt lookup, proposed by the engine core from the
    request's own tokens; works with every backend that verifies), ``"draft_model"`` (a smaller
    model of the same tokenizer, in ``model``), ``"mock"`` (the mock backend's drafter), or any
    proposer name a backend lists in ``SpecSupport.proposers``."""
    num_speculative_tokens: int = 4
    """The most drafts a request verifies in one step (k_max)."""
    prompt_lookup_min: int = 2
    """``"ngram"``: the shortest suffix of the sequence searched for earlier in it."""
    prompt_lookup_max: int = 4
    """``"ngram"``: the longest suffix searched for (the longest match wins; on a tie the
    earliest occurrence)."""
    model: str | None = None
    """``"draft_model"``: the draft model's HF directory (same vocabulary as the target)."""
    dynamic: bool = True
    """Choose the number of drafts each step (and per request) from the measured acceptance
    and the backend's step cost: speculation turns itself off as the batch grows, where
    verifying drafts costs more than it gains, and back on as it shrinks. False: every
    request verifies up to ``num_speculative_tokens`` drafts in every step."""
    allowed_k: list[int] | None = None
    """The draft counts per step the dynamic policy may choose from (a backend may capture one
    CUDA graph per count). None: every count from 0 to ``num_speculative_tokens``. 0 is always
    allowed, and so is ``num_speculative_tokens``."""
    verification: Literal["exact", "rejection"] = "exact"
    """``"exact"``: a backend samples each verified position as decoding would (seeded requests
    give the tokens they give without speculation); ``"rejection"``: rejection sampling against
    the drafter's distribution (a backend that offers it; more drafts accepted, not seed-exact)."""

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"speculative method must be a non-empty name, got {self.method!r}")
        _positive(
            "num_speculative_tokens", self.num_speculative_tokens, allow_none=False, integer=True
        )
        _positive("prompt_lookup_min", self.prompt_lookup_min, allow_none=False, integer=True)
        _positive("prompt_lookup_max", self.prompt_lookup_max, allow_none=False, integer=True)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= prompt_lookup_min "
                f"({self.prompt_lookup_min})"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs model (the draft's directory)")
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"dynamic must be a bool, got {self.dynamic!r}")
        if self.verification not in ("exact", "rejection"):
            raise ValueError(
                f"verification must be 'exact' or 'rejection', got {self.verification!r}"
            )
        if self.allowed_k is not None:
            if not isinstance(self.allowed_k, list) or not self.allowed_k:
                raise ValueError(f"allowed_k must be a non-empty list, got {self.allowed_k!r}")
            for k in self.allowed_k:
                _non_negative_int("each of allowed_k", k)
                if k > self.num_speculative_tokens:
                    raise ValueError(
                        f"allowed_k holds {k}, more than num_speculative_tokens "
                        f"({self.num_speculative_tokens})"
                    )

    @property
    def proposed_in_core(self) -> bool:
        """Whether the engine core proposes the drafts (``"ngram"``), not the backend."""
        return self.method in SPEC_METHODS_IN_CORE

    @property
    def k_choices(self) -> list[int]:
        """The draft counts a step may use, ascending: ``allowed_k`` with 0 and
        ``num_speculative_tokens`` added, or 0..``num_speculative_tokens``."""
        k_max = self.num_speculative_tokens
        if self.allowed_k is None:
            return list(range(k_max + 1))
        return sorted({0, k_max, *self.allowed_k})


class EngineConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Everything that configures one engine. All fields are keyword-only and validated.

    ``max_model_len`` and ``max_num_batched_tokens`` left as None are resolved when the engine
    starts (from the backend's model and ``max_model_len`` respectively).
    """

    model: str | None = None
    """HF-format model directory, or None (the mock backend then uses a synthetic geometry)."""
    tokenizer: str | None = None
    """Tokenizer directory, ``"byte"`` for the built-in byte tokenizer, or None (= ``model``,
    else ``"byte"``)."""
    backend: str = "auto"
    """The backend to run (``engine-core backends`` lists them): ``"mock"``, ``"cuda"``, or
    ``"auto"``: a usable backend other than the mock where there is one, else the mock."""
    backend_options: dict[str, Any] = msgspec.field(default_factory=dict)
    """The backend's own options, a dict (on the command line: JSON); each backend documents
    its names."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    num_kv_blocks: int | None = None
    """Override the number of KV blocks computed from the backend's free memory."""
    kv_cache_memory_fraction: float = 0.9
    """Share of the device's free memory the engine may use (the KV cache gets it, less what
    the model's steps need)."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output) in tokens. None: the model's limit."""
    max_num_seqs: int = 256
    """Most requests running at once (the batch); more wait in the queue."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step. None: max(8192, max_num_seqs), at least max_model_len
    without chunked prefill."""
    enable_chunked_prefill: bool = True
    """Split a long prompt's prefill over several steps, beside other requests' decodes."""
    long_prefill_token_threshold: int = 0
    """Most prompt tokens one request prefills in a step (0: no limit but the budget)."""
    max_num_partial_prefills: int = 0
    """Most requests that prefill in one step (a prompt's chunk, or a preempted request's
    recomputation); those beyond it wait for a later step (vLLM's name). 0: no limit."""
    max_long_partial_prefills: int = 0
    """Of those, most whose remaining prompt is longer than ``long_prefill_token_threshold``,
    so that a few long prompts cannot take every prefill slot: a long prompt past it waits and
    shorter ones behind it are admitted (vLLM's name). 0: no limit of its own. Set with
    ``long_prefill_token_threshold`` 0, the threshold becomes 4 % of ``max_model_len``
    (as vLLM does). With it set, the short slots hold in blocks as well: while other requests
    run, a long prompt is admitted only with ``long_prefill_token_threshold`` tokens of blocks
    left free for each short slot (``max_num_partial_prefills - max_long_partial_prefills``,
    one when the total is not limited; at most half the cache), until it was overtaken in
    ``max_bypass_steps`` steps."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes already computed."""
    preemption_victim: str = "least_progress"
    """Whom recompute preemption evicts when the KV cache runs out: ``"least_progress"`` (the
    default: the running request with the fewest computed tokens, the least work to recompute;
    under ``priority`` the worst priority first), ``"last_admitted"`` (the latest admitted;
    under ``priority`` the worst priority, then the latest arrival: vLLM's choice), or
    ``"module:attribute"``, a :class:`~engine_core.abc.PreemptionVictimPolicy` subclass (or
    factory) imported in the engine process."""
    max_bypass_steps: int = 64
    """Steps in which requests behind a waiting request whose KV blocks are not free may be
    admitted before it (no head-of-line blocking); after that many, nothing overtakes it until
    its blocks are free. 0: nobody overtakes (a request that does not fit holds up the queue)."""
    stall_timeout_s: float | None = 60.0
    """With requests queued and no token computed for this long, the engine reports itself
    unhealthy (``check_health`` raises, ``/health`` answers 503 with the reason) and logs its
    queue state once. None: no check."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """Order of the waiting requests: first come first served, or by request priority
    (lower first)."""
    async_scheduling: bool | None = None
    """Schedule step n+1 while step n runs on the device (its sampled tokens are placeholders
    until its results arrive). None: on when the backend supports it and its steps wait on a
    device (``Backend.step_in_thread``); True with a backend that does not support it fails at
    startup."""
    multiprocess: bool | None = None
    """Run the engine core in its own process. None: AsyncLLM does, LLM does not."""
    engine_runtime: Literal["asyncio", "trio"] = "asyncio"
    """Event loop of the engine-core process (asyncio runs on uvloop where installed, unless
    ``ENGINE_CORE_NO_UVLOOP`` is set)."""
    step_timeout_s: float | None = 300.0
    """A step whose model call runs longer than this (one that hangs while its process
    stays alive) is cut: the engine is treated as dead (its process reports a
    ``TimeoutError`` and exits; ``engine-core serve`` ends its responses with a 503 and
    exits 3). Lower it where steps are short (``--step-timeout-s 30``) to fail sooner.
    None: no limit."""
    engine_heartbeat_timeout_s: float | None = 10.0
    """An engine-core process that sends nothing for this long while requests are in flight
    or a control call waits for its reply is declared dead and killed. It sends a heartbeat
    while it has work and nothing else went out for a fifth of this, so only a frozen
    process (stopped, deadlocked, a step holding the GIL) stays silent. None: no check."""
    startup_timeout_s: float = 300.0
    """How long the engine may take to start (load the model, allocate the KV cache)."""
    grammar_compile_timeout_s: float = 10.0
    """A structured-output grammar that takes longer to compile fails its request."""
    max_queued_requests: int | None = None
    """Requests that may wait beyond the running batch; past it new ones fail at once as
    retryable (the server: 503). None: no limit."""
    max_n: int = 128
    """Most completions one request may ask for (``SamplingParams.n``); OpenAI's limit."""
    max_stop_strings: int = 64
    """Most stop strings one request may give."""
    max_stop_string_len: int = 1024
    """Longest stop string, in characters: a stream holds back that many characters until it
    knows they do not start a stop string, and the stop-string automaton grows with the total
    length of a request's stop strings."""
    seed: int = 0
    """Seed of the engine's randomness (random weights, benchmark prompts); requests seed
    their own sampling."""
    dtype: str = "auto"
    """Model weights' data type (``"auto"``: the backend picks, bf16 on a GPU)."""
    quantization: Literal["fp8"] | None = None
    """Quantise the weights at load: ``"fp8"`` stores the linear layers' and experts' weights
    in FP8 (e4m3) with per-output-channel scales, activations quantised per token as they go.
    None: as the checkpoint is (an FP8 checkpoint, whose ``quantization_config`` says so, loads
    in FP8 either way)."""
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = "auto"
    """Data type of the KV cache: ``"auto"`` (the model's) or ``"fp8"`` (= ``"fp8_e4m3"``: one
    byte per element with per-tensor scales, about twice the blocks; needs a device with FP8)."""
    tensor_parallel_size: int = 1
    """Devices one model is split over (1 so far)."""
    data_parallel_size: int = 1
    """Engine-core processes behind the one front end (each with its own KV cache)."""
    data_parallel_rank: int = 0
    """Which of them this engine is (set per engine by the front end)."""
    router: Literal["prefix", "least_loaded", "round_robin"] | None = None
    """How requests are spread over the engines. ``"prefix"``: to the engine holding the
    longest prefix of the prompt among those near the least loaded (the default with prefix
    caching on); ``"least_loaded"``: fewest requests in flight (the default without);
    ``"round_robin"``."""
    router_balance_abs: int | None = None
    """An engine is near the least loaded while it has at most this many more requests in
    flight (or ``router_balance_rel`` times as many). None: ``max(4, max_num_seqs // 2)``."""
    router_balance_rel: float = 1.0
    dp_failover: Literal["retry", "fail", "resume"] = "retry"
    """When an engine dies, its requests that had streamed nothing go to another engine
    (``"retry"``, ``"resume"``) or end with a retryable error (``"fail"``); those that had
    started end with a retryable error naming the engine, except that ``"resume"`` continues
    greedy ones on another engine from the tokens already streamed."""
    dp_restart_engines: bool = False
    """Restart a dead engine (with backoff) and let it rejoin. While every engine is dead and
    one is restarting, requests wait for it (``dp_restart_wait_s``) instead of failing:
    :class:`~engine_core.errors.EngineDeadError` only once no restart is left."""
    dp_restart_wait_s: float = 60.0
    """With ``dp_restart_engines``: how long a request waits for an engine while every engine
    is dead (then it ends with a retryable error)."""
    data_parallel_backend: Literal["mp", "ray"] = "mp"
    """Where the engines run: ``"mp"``, child processes of the front end on this machine;
    ``"ray"``, one Ray actor per engine, each in its own placement group, on the nodes of a Ray
    cluster (the extra ``engine-core[ray]``), talking to the front end over CURVE-encrypted
    TCP."""
    ray_address: str | None = None
    """With ``data_parallel_backend="ray"``: the Ray cluster to join (``ray.init(address=...)``,
    e.g. ``"auto"`` or ``"10.0.0.1:6379"``). None: ``RAY_ADDRESS``, else a cluster started on
    this machine with ``ray start``, else a new local one."""
    ray_placement_strategy: Literal["SPREAD", "STRICT_SPREAD", "PACK"] = "SPREAD"
    """How the engines' placement groups spread over the Ray nodes: ``"SPREAD"``, to the nodes
    with the fewest engines of the deployment; ``"STRICT_SPREAD"``, never two on one node;
    ``"PACK"``, onto the nodes that hold engines already."""
    ray_gpus_per_engine: int | None = None
    """GPUs in each engine's placement-group bundle (with one CPU). None:
    ``tensor_parallel_size``, or 0 for the mock backend."""
    ray_driver_host: str | None = None
    """The address of this machine that the engines dial (it must be reachable from every
    node). None: this node's IP address as Ray knows it."""
    placement_timeout_s: float = 300.0
    """How long the engines' placement groups may take to be placed before startup fails,
    naming what was asked and what the cluster has."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (None: off); a dict is converted. The engine then schedules
    synchronously: ``async_scheduling`` None resolves to off, True is an error."""
    kv_offload_bytes: int | str = 0
    """Host-memory KV tier (CPU offload): bytes of host memory for offloaded KV blocks, an int
    or a size such as ``"8GiB"`` (converted to an int); 0: off. Turns on the built-in ``"host"``
    KV connector (``docs/kv_connector.md``) unless ``kv_connector`` names another."""
    kv_connector: str | None = None
    """A KV connector by name (built-in ``"host"``, or one of the ``engine_core.kv_connectors``
    entry points); None: ``"host"`` when ``kv_offload_bytes`` > 0, else none."""
    kv_connector_options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Options passed to the KV connector's halves."""
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    """What a request whose KV load failed does once its computed tokens are cut back to the
    first failed block: compute the rest locally, or end with finish_reason "error"."""
    kv_lease_s: float = 30.0
    """The longest the engine keeps blocks for a connector: a parked load not reported by then
    is cancelled (the request recomputes), a held finished request's blocks are freed."""
    kv_max_parked_fraction: float = 0.5
    """The most of the KV cache that requests waiting for their KV load may hold (0..1]; past
    it a request computes instead of loading."""
    enable_lora: bool = False
    """Serve LoRA adapters (``docs/lora.md``): requests may name one with a ``LoRARequest``.
    Needs a backend that declares LoRA support (``Backend.lora_support``)."""
    max_loras: int = 1
    """With LoRA: most distinct adapters in one step (running requests' adapters count first;
    requests of another adapter wait, they are not dropped)."""
    max_lora_rank: int = 16
    """With LoRA: the largest adapter rank accepted (``r`` in ``adapter_config.json``)."""
    max_cpu_loras: int | None = None
    """With LoRA: adapters kept loaded in host memory (least recently used evicted first,
    pinned ones never; one in use by a request is never evicted). None: ``max_loras``; at
    least ``max_loras``."""
    engine_roles: list[str] | None = None
    """Prefill/decode disaggregation (``docs/disaggregation.md``): each engine's role,
    ``"prefill"``, ``"decode"`` or ``"both"``, one per engine (``data_parallel_size`` of them);
    None: every engine ``"both"`` (no disaggregation). With at least one prefill and one decode
    engine, prompts are computed on prefill engines and their KV handed to decode engines."""

    @property
    def router_policy(self) -> str:
        """``router``, or its default."""
        if self.router is not None:
            return self.router
        return "prefix" if self.enable_prefix_caching else "least_loaded"

    @property
    def balance_abs(self) -> int:
        """``router_balance_abs``, or its default."""
        if self.router_balance_abs is not None:
            return self.router_balance_abs
        return max(4, self.max_num_seqs // 2)

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            self.speculative_config = msgspec.convert(self.speculative_config, SpeculativeConfig)
        if self.speculative_config is not None:
            if not isinstance(self.speculative_config, SpeculativeConfig):
                raise TypeError(
                    "speculative_config must be a SpeculativeConfig or a dict, got "
                    f"{type(self.speculative_config).__name__}"
                )
            if self.async_scheduling:
                raise ValueError(
                    "async_scheduling=True does not work with speculative decoding, which "
                    "schedules synchronously (leave async_scheduling None or set it False)"
                )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.engine_runtime not in ("asyncio", "trio"):
            raise ValueError(
                f"engine_runtime must be 'asyncio' or 'trio', got {self.engine_runtime!r}"
            )
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"backend must be a non-empty name, got {self.backend!r}")
        _positive("block_size", self.block_size, allow_none=False, integer=True)
        _positive("dp_restart_wait_s", self.dp_restart_wait_s, allow_none=False)
        _positive("num_kv_blocks", self.num_kv_blocks, integer=True)
        _positive("max_model_len", self.max_model_len, integer=True)
        _positive("max_num_seqs", self.max_num_seqs, allow_none=False, integer=True)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens, integer=True)
        _positive("step_timeout_s", self.step_timeout_s)
        _positive("engine_heartbeat_timeout_s", self.engine_heartbeat_timeout_s)
        _positive("startup_timeout_s", self.startup_timeout_s, allow_none=False)
        _positive("grammar_compile_timeout_s", self.grammar_compile_timeout_s, allow_none=False)
        _positive("max_queued_requests", self.max_queued_requests, integer=True)
        _positive("max_n", self.max_n, allow_none=False, integer=True)
        _positive("max_stop_strings", self.max_stop_strings, allow_none=False, integer=True)
        _positive("max_stop_string_len", self.max_stop_string_len, allow_none=False, integer=True)
        _positive("tensor_parallel_size", self.tensor_parallel_size, allow_none=False, integer=True)
        _positive("data_parallel_size", self.data_parallel_size, allow_none=False, integer=True)
        rank = self.data_parallel_rank
        if (
            not isinstance(rank, int)
            or isinstance(rank, bool)
            or not 0 <= rank < max(self.data_parallel_size, 1)
        ):
            raise ValueError(
                f"data_parallel_rank must be an int in [0, data_parallel_size), got {rank!r}"
            )
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be 'fp8' or None, got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(
                f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got {self.kv_cache_dtype!r}"
            )
        if self.router not in (None, "prefix", "least_loaded", "round_robin"):
            raise ValueError(
                f"router must be 'prefix', 'least_loaded' or 'round_robin', got {self.router!r}"
            )
        if self.router_balance_abs is not None and (
            not isinstance(self.router_balance_abs, int) or self.router_balance_abs < 0
        ):
            raise ValueError(
                f"router_balance_abs must be an int >= 0, got {self.router_balance_abs!r}"
            )
        if not isinstance(self.router_balance_rel, (int, float)) or not (
            self.router_balance_rel >= 1.0
        ):
            raise ValueError(f"router_balance_rel must be >= 1, got {self.router_balance_rel!r}")
        if self.dp_failover not in ("retry", "fail", "resume"):
            raise ValueError(
                f"dp_failover must be 'retry', 'fail' or 'resume', got {self.dp_failover!r}"
            )
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(
                f"data_parallel_backend must be 'mp' or 'ray', got {self.data_parallel_backend!r}"
            )
        if self.ray_placement_strategy not in ("SPREAD", "STRICT_SPREAD", "PACK"):
            raise ValueError(
                "ray_placement_strategy must be 'SPREAD', 'STRICT_SPREAD' or 'PACK', "
                f"got {self.ray_placement_strategy!r}"
            )
        if self.ray_gpus_per_engine is not None and (
            not isinstance(self.ray_gpus_per_engine, int)
            or isinstance(self.ray_gpus_per_engine, bool)
            or self.ray_gpus_per_engine < 0
        ):
            raise ValueError(
                f"ray_gpus_per_engine must be an int >= 0, got {self.ray_gpus_per_engine!r}"
            )
        _positive("placement_timeout_s", self.placement_timeout_s, allow_none=False)
        if not (0.0 < self.kv_cache_memory_fraction <= 1.0):
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction!r}"
            )
        _non_negative_int("max_num_partial_prefills", self.max_num_partial_prefills)
        _non_negative_int("max_long_partial_prefills", self.max_long_partial_prefills)
        _non_negative_int("max_bypass_steps", self.max_bypass_steps)
        if (
            self.max_num_partial_prefills
            and self.max_long_partial_prefills > self.max_num_partial_prefills
        ):
            raise ValueError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})"
            )
        _positive("stall_timeout_s", self.stall_timeout_s)
        check_victim_policy_name(self.preemption_victim)
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0, "
                f"got {self.long_prefill_token_threshold!r}"
            )
        if self.max_num_batched_tokens is not None:
            if self.max_num_batched_tokens < self.max_num_seqs:
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                    f"max_num_seqs ({self.max_num_seqs})"
                )
            if (
                not self.enable_chunked_prefill
                and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len
            ):
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                    f"max_model_len ({self.max_model_len}) when enable_chunked_prefill is False"
                )
        if not isinstance(self.backend_options, dict):
            raise TypeError(f"backend_options must be a dict, got {type(self.backend_options)}")
        self.kv_offload_bytes = parse_size("kv_offload_bytes", self.kv_offload_bytes)
        if self.kv_connector is not None and (
            not isinstance(self.kv_connector, str) or not self.kv_connector
        ):
            raise ValueError(f"kv_connector must be a non-empty name, got {self.kv_connector!r}")
        if not isinstance(self.kv_connector_options, dict):
            raise TypeError(
                f"kv_connector_options must be a dict, got {type(self.kv_connector_options)}"
            )
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(
                "kv_load_failure_policy must be 'recompute' or 'fail', "
                f"got {self.kv_load_failure_policy!r}"
            )
        _positive("kv_lease_s", self.kv_lease_s, allow_none=False)
        _check_engine_roles(self.engine_roles, self.data_parallel_size)
        if self.disaggregated and self.kv_connector not in (None, "pd"):
            raise ValueError(
                f"engine_roles {self.engine_roles} disaggregate prefill and decode through the "
                f"'pd' KV connector; kv_connector {self.kv_connector!r} cannot serve with it"
            )
        if self.disaggregated and not self.enable_prefix_caching:
            raise ValueError(
                f"engine_roles {self.engine_roles} need enable_prefix_caching: the decode "
                "engines take the prefill engines' blocks through the prefix cache's hooks"
            )
        if self.disaggregated and self.kv_offload_bytes:
            raise ValueError(
                "kv_offload_bytes (the host KV tier) and disaggregating engine_roles do not run "
                "together yet: give one of them"
            )
        if not isinstance(self.kv_max_parked_fraction, (int, float)) or not (
            0.0 < self.kv_max_parked_fraction <= 1.0
        ):
            raise ValueError(
                f"kv_max_parked_fraction must be in (0, 1], got {self.kv_max_parked_fraction!r}"
            )
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a bool, got {self.enable_lora!r}")
        _positive("max_loras", self.max_loras, allow_none=False, integer=True)
        _positive("max_lora_rank", self.max_lora_rank, allow_none=False, integer=True)
        _positive("max_cpu_loras", self.max_cpu_loras, integer=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                "every adapter of a step is loaded"
            )

    @property
    def kv_connector_name(self) -> str | None:
        """The KV connector in use: ``kv_connector``, else ``"pd"`` for an engine of a
        disaggregated deployment (:attr:`disaggregated`), else ``"host"`` when
        ``kv_offload_bytes`` > 0, else None."""
        if self.kv_connector is not None:
            return self.kv_connector
        if self.disaggregated:
            return "pd"
        return "host" if self.kv_offload_bytes else None

    @property
    def roles(self) -> list[str]:
        """Each engine's role (``engine_roles``, or ``"both"`` for every engine)."""
        if self.engine_roles is None:
            return ["both"] * self.data_parallel_size
        return list(self.engine_roles)

    @property
    def disaggregated(self) -> bool:
        """Whether prefill and decode run on different engines (a prefill and a decode
        engine among ``engine_roles``)."""
        roles = self.engine_roles
        return roles is not None and "prefill" in roles and "decode" in roles

    @property
    def engine_role(self) -> str:
        """This engine's role (``engine_roles[data_parallel_rank]``)."""
        roles = self.roles
        rank = self.data_parallel_rank
        return roles[rank] if 0 <= rank < len(roles) else "both"

    @property
    def gpus_per_engine(self) -> int:
        """``ray_gpus_per_engine``, or its default."""
        if self.ray_gpus_per_engine is not None:
            return self.ray_gpus_per_engine
        return 0 if self.backend == "mock" else self.tensor_parallel_size

    @property
    def lora_capacity(self) -> int:
        """Adapters kept loaded: ``max_cpu_loras``, or ``max_loras``."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer to load: ``tokenizer``, else ``model``, else ``"byte"``."""
        return self.tokenizer or self.model or "byte"

    def resolved(self, *, model_max_len: int | None) -> EngineConfig:
        """A copy with ``max_model_len`` and ``max_num_batched_tokens`` filled in."""
        max_model_len = self.max_model_len or model_max_len or DEFAULT_MAX_MODEL_LEN
        if model_max_len is not None and max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's limit ({model_max_len})"
            )
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = max(8192, self.max_num_seqs)
            if not self.enable_chunked_prefill:
                batched = max(batched, max_model_len)
        threshold = self.long_prefill_token_threshold
        if threshold == 0 and self.max_long_partial_prefills:
            threshold = max(1, int(max_model_len * 0.04))  # vLLM's default with the limits
        return msgspec.structs.replace(
            self,
            max_model_len=max_model_len,
            max_num_batched_tokens=batched,
            long_prefill_token_threshold=threshold,
        )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments, naming any unknown one."""
        unknown = sorted(set(kwargs) - set(cls.__struct_fields__))
        if unknown:
            raise TypeError(f"unknown EngineConfig field(s): {', '.join(unknown)}")
        return cls(**kwargs)


ENGINE_ROLES = ("prefill", "decode", "both")
"""The roles an engine may have (``EngineConfig.engine_roles``)."""


def _check_engine_roles(roles: Any, num_engines: int) -> None:
    """``ValueError`` naming ``engine_roles`` for a list that is not one known role per engine,
    or that has prefill engines without a decode engine (or the reverse)."""
    if roles is None:
        return
    if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
        raise ValueError(f"engine_roles must be a list of role names, got {roles!r}")
    unknown = sorted({r for r in roles if r not in ENGINE_ROLES})
    if unknown:
        raise ValueError(
            f"engine_roles has unknown role(s) {unknown}: each is one of {', '.join(ENGINE_ROLES)}"
        )
    if len(roles) != num_engines:
        raise ValueError(
            f"engine_roles lists {len(roles)} role(s) but data_parallel_size is {num_engines}: "
            "give one role per engine"
        )
    takes_prefill = any(r in ("prefill", "both") for r in roles)
    takes_decode = any(r in ("decode", "both") for r in roles)
    if not takes_prefill:
        raise ValueError(f"engine_roles {roles} has no engine that computes prompts (prefill)")
    if not takes_decode:
        raise ValueError(f"engine_roles {roles} has no engine that decodes (decode)")
