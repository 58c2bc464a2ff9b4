"""The backend contract: what a plugin author implements.

A backend is a separately installed distribution that registers, in the entry-point group
``engine_core.backends``, an object satisfying :class:`BackendProvider`. Discovery imports only
that object, so it must be cheap (no torch import): it says whether the backend is usable here and
loads the :class:`Backend` class on demand.

The engine core drives a backend in this order:

1. ``Backend(config)`` with the :class:`~engine_core.EngineConfig` (model, dtype,
   ``backend_options``...);
2. :meth:`Backend.kv_cache_spec` -> per-layer KV geometry, from which the core computes the bytes
   of one block;
3. :meth:`Backend.available_kv_cache_memory` -> bytes the backend can give to the KV cache;
4. :meth:`Backend.initialize_kv_cache` with the number of blocks the core chose;
5. each step, :meth:`Backend.execute_model` runs the forward pass of a
   :class:`SchedulerOutput`, then :meth:`Backend.sample_tokens` (with the grammar bitmask when the
   batch has constrained requests) returns a :class:`ModelRunnerOutput`; the split lets the core
   compute the bitmask while the forward pass runs;
   with async scheduling (:attr:`Backend.supports_async_scheduling`), the step is launched
   instead: :meth:`Backend.execute_model` then :meth:`Backend.sample_tokens_async`, whose
   :class:`AsyncModelRunnerOutput` the core waits on later, after it has scheduled and launched
   the next step (see "Async scheduling" below);
6. control calls (:meth:`Backend.profile`, :meth:`Backend.sleep`, :meth:`Backend.wake_up`) and
   finally :meth:`Backend.close`.

A backend that needs the served tokenizer (to read prompts as text) loads it with
:func:`load_tokenizer` of ``config.tokenizer_name``. ``engine_core.testing`` holds a conformance
suite any backend runs against itself.

Async scheduling
----------------

A backend that sets :attr:`Backend.supports_async_scheduling` lets the core keep one step in
flight while it schedules the next. The calls then come in this order::

    execute_model(s1); h1 = sample_tokens_async(m1)
    execute_model(s2); h1.get_output(); h2 = sample_tokens_async(m2)
    execute_model(s3); h2.get_output(); h3 = sample_tokens_async(m3)   ...

- ``execute_model(s{n+1})`` comes before step n's output is known. A request of step n that
  sampled a token is scheduled in step n+1 as if that token were known: ``num_computed_tokens
  + num_scheduled_tokens`` counts it, so the backend takes the token it sampled in step n as
  the input at that position (on the device: the host never needs to see it first).
- Nothing of ``s{n+1}`` depends on step n's output but the token values: a request that ends
  in step n (a stop token, the length cap, an abort) may still be in ``s{n+1}``; what the
  backend computes for it there is discarded, and it is listed in ``finished_req_ids`` of a
  later step as usual. A request preempted in ``s{n+1}`` is listed in its
  ``preempted_req_ids`` while its step-n token is still on its way; it comes back as a new
  request whose ``output_token_ids`` hold that token.
- ``sample_tokens_async`` launches sampling and returns at once; ``get_output`` blocks until
  the step's results are on the host. The grammar bitmask (``m``) may be filled only once step
  n's output was applied, so ``sample_tokens_async(m{n+1})`` comes after ``h{n}.get_output()``
  when the batch has constrained requests; a constrained request whose sampled token will be
  discarded still has its row (it allows every token).
- Each handle is waited on once, in launch order; :meth:`Backend.sample_tokens` is not called.

Backends that leave the flag False keep the synchronous contract: ``execute_model`` and
``sample_tokens`` in turn, with each step's output applied before the next is scheduled.

Speculative decoding
--------------------

A backend that can verify guessed tokens (drafts) says so with :meth:`Backend.spec_support`;
one that returns None (the default) keeps the contract above, and the engine refuses
``EngineConfig.speculative_config`` for it. With speculation on the engine schedules
synchronously (``sample_tokens``, never ``sample_tokens_async``). Each step:

- **Drafts in.** A cached request may carry drafts: ``CachedRequestData.spec_token_ids[i]``
  (a parallel column, empty when no request of the step has drafts). A request with ``s``
  drafts is a decoding request scheduled for ``1 + s`` tokens: its last known token at position
  ``num_computed_tokens``, then the drafts at the ``s`` positions after it. New requests
  (:class:`NewRequestData`) never carry drafts: a request admitted, or resumed after a
  preemption, first computes its sequence and samples one token.
- **Verification**, in :meth:`Backend.sample_tokens`: the backend samples each of the
  ``1 + s`` positions as decoding would sample it if the drafts before it were the request's
  tokens (penalties count the preceding drafts as output; ``min_tokens`` bans by the output
  count at that position; the grammar row of that position; seeded noise keyed by that
  position), and accepts the longest prefix of drafts equal to those samples. It returns, in
  ``ModelRunnerOutput.sampled_token_ids[i]``, the ``a`` accepted drafts followed by the token
  sampled at the first position that disagreed (or, all drafts accepted, at the last one): so
  ``1 <= len(tokens) <= s + 1``, ``tokens[:a] == drafts[:a]`` with ``a = len(tokens) - 1``, and
  ``tokens[a] != drafts[a]`` when ``a < s``. Anything else is a :class:`~engine_core.errors.
  BackendError`: no verifier produces it. Logprobs, when asked for, have one entry per
  returned token. The backend returns every token it accepted even past a stop token or
  ``max_tokens``: the engine applies the stop rules to each token in order and drops the rest.
- **Rollback.** The ``s - a`` rejected positions were computed but are not part of the
  sequence: after the step the request's computed tokens are ``num_computed_tokens + 1 + a``
  (the scheduler rolls its count back; :meth:`CachedRequestData.diffs` checks the backend's
  agrees at the next step). Their KV slots hold garbage that later steps overwrite; only
  verified tokens ever enter the prefix cache.
- **Drafts out.** A backend proposer (``SpeculativeConfig.method`` listed in
  ``SpecSupport.proposers``) returns drafts for the next step in
  ``ModelRunnerOutput.draft_token_ids``, continuing the sequence after the tokens it returned,
  for the requests and in the count :class:`SchedulerOutput` asks (``num_draft_tokens``,
  ``draft_req_ids``). With ``"ngram"`` the engine core proposes drafts itself and the backend
  only verifies.
- **KV.** The scheduler allocates slots for the ``1 + s`` positions plus
  ``SpecSupport.lookahead_tokens(k)`` more for a backend drafter that writes KV ahead of them
  (``k`` = ``num_draft_tokens`` of the step).
- **Structured outputs.** The grammar bitmask has one row per verified position: ``1 + s``
  consecutive rows for a constrained request with ``s`` drafts (row ``j`` constrains the token
  sampled at its ``j``-th position, after drafts ``0..j-1`` were accepted), in batch order.
  The engine truncates a constrained request's drafts to those its grammar accepts.

``engine_core.testing.check_spec_decode`` checks a backend against this contract.

LoRA adapters
-------------

A backend that serves LoRA adapters returns a :class:`~engine_core.lora.LoRASupport` from
:meth:`Backend.lora_support` (its largest rank, the modules an adapter may target); one that
returns None (the default) serves the base model only, and the engine refuses
``EngineConfig.enable_lora`` for it. With LoRA on:

- **Loading.** :meth:`Backend.add_lora` reads and checks an adapter and keeps it ready in host
  memory; :meth:`Backend.remove_lora` forgets it. The core calls both from its adapter loader
  thread, **while steps run** (``execute_model``, ``sample_tokens`` in the step thread): the
  backend must make them safe against a step in flight (e.g. build the adapter's tensors
  privately, then publish them under a lock or with one assignment). The core never calls
  two of them at once, calls ``remove_lora`` only for an adapter no request in flight uses,
  and never schedules a request whose adapter's ``add_lora`` has not returned.
- **Each step.** A new request's :class:`NewRequestData` carries ``lora_int_id`` (0: the base
  model); a resumed (preempted) request comes back with its adapter. ``SchedulerOutput.
  lora_ids`` lists the adapters the running requests use (sorted, at most
  ``EngineConfig.max_loras``; a superset of the step's): what the backend keeps in its device
  slots. A cached request keeps the adapter it came with.
- **Errors.** ``add_lora`` raises :class:`~engine_core.lora.LoRAError` naming the adapter and
  the reason (rank above the backend's, a module it cannot serve, weights for another base
  model...): the requests of that adapter fail with it, nothing else does.

``engine_core.testing.check_lora`` checks a backend against this contract (``docs/lora.md``).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

import msgspec

from engine_core._core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from engine_core._core.tokenizer import Tokenizer, load_tokenizer
from engine_core.kv_connector import KVConnectorLayout, KVConnectorReport
from engine_core.lora import LoRAError, LoRARequest, LoRASupport

if TYPE_CHECKING:
    from engine_core._core.request import Request
    from engine_core.config import EngineConfig

__all__ = [
    "AsyncModelRunnerOutput",
    "Backend",
    "BackendProvider",
    "CachedRequestData",
    "ChunkedLocalSpec",
    "FullAttentionSpec",
    "KVConnectorLayout",
    "KVConnectorReport",
    "KVCacheSpec",
    "LayerSpec",
    "LoRARequest",
    "LoRASupport",
    "ModelRunnerOutput",
    "NewRequestData",
    "PreemptionVictimPolicy",
    "SchedulerOutput",
    "SlidingWindowSpec",
    "SpecSupport",
    "StepCostModel",
    "TokenLogprobs",
    "Tokenizer",
    "load_tokenizer",
]


class KVCacheSpec(msgspec.Struct, frozen=True, kw_only=True):
    """KV geometry of the model: every layer is full attention with the same shape."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int

    def page_size_bytes(self, block_size: int) -> int:
        """Bytes of one block in one layer (K and V)."""
        return 2 * block_size * self.num_kv_heads * self.head_size * self.dtype_bytes

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of one block across all layers."""
        return self.num_layers * self.page_size_bytes(block_size)


class _LayerSpecBase(msgspec.Struct, frozen=True, kw_only=True):
    num_kv_heads: int
    """KV heads of this layer on this rank (after tensor-parallel sharding)."""
    head_size: int
    dtype_bytes: int
    """Bytes of one element of the KV cache."""

    def page_size_bytes(self, block_size: int) -> int:
        """Bytes of one block of this layer (K and V)."""
        return 2 * block_size * self.num_kv_heads * self.head_size * self.dtype_bytes


class FullAttentionSpec(_LayerSpecBase, frozen=True, kw_only=True):
    """A layer whose queries see every earlier key (Hugging Face's ``"full_attention"``)."""

    kind: ClassVar[str] = "full_attention"


class SlidingWindowSpec(_LayerSpecBase, frozen=True, kw_only=True):
    """A sliding-window layer (``"sliding_attention"``): the query at position ``p`` sees the
    keys ``p - window + 1 .. p``; the core releases the blocks behind the window."""

    kind: ClassVar[str] = "sliding_attention"
    window: int


class ChunkedLocalSpec(_LayerSpecBase, frozen=True, kw_only=True):
    """A chunked-local layer (``"chunked_attention"``, Llama 4): the query at ``p`` sees the
    keys from ``p // chunk * chunk`` to ``p``; blocks of earlier chunks are released."""

    kind: ClassVar[str] = "chunked_attention"
    chunk: int


LayerSpec = FullAttentionSpec | SlidingWindowSpec | ChunkedLocalSpec
"""One layer's KV spec; :meth:`Backend.kv_cache_spec` may return one per layer."""


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one position: the sampled (or prompt) token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    """1-based rank of each token in the distribution."""


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced, in the batch order of its :class:`SchedulerOutput`."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    """Per request: the sampled token(s); an empty list for a partial prefill chunk."""
    logprobs: list[list[TokenLogprobs] | None] | None = None
    """Per request, one entry per sampled token, for requests that asked for logprobs."""
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] | None = None
    """Per request, one entry per prompt position computed this step (None for position 0)."""
    draft_token_ids: list[list[int]] | None = None
    """Speculative decoding with a backend proposer: per request (batch order), the drafts
    for its next step, continuing after the tokens it returned in ``sampled_token_ids``; an
    empty list for a request not drafted (it sampled nothing, or ``draft_req_ids`` left it
    out). At most ``SchedulerOutput.num_draft_tokens`` each; the engine may verify fewer.
    None: no drafts (always so without a backend proposer)."""
    kv_connector_report: KVConnectorReport | None = None
    """The KV connector worker half's report of transfers that ended (``engine_core.
    kv_connector``; None: no connector, or nothing to report). Under tensor parallelism, the
    merge of every rank's (:meth:`KVConnectorReport.merge`)."""


class StepCostModel(msgspec.Struct, frozen=True, kw_only=True):
    """What a step costs a backend, in seconds: a prior for the dynamic speculation policy
    (it refines it from measured step times). A target step computing ``T`` tokens (drafts
    included) costs ``step_s + per_token_s * T``; drafting, when asked, adds
    ``draft_step_s + draft_per_token_s * B`` per draft pass for ``B`` drafting requests, once
    per draft token (``parallel_drafting`` False) or once for all of them (True)."""

    step_s: float
    per_token_s: float
    draft_step_s: float = 0.0
    draft_per_token_s: float = 0.0
    parallel_drafting: bool = False


class SpecSupport(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend can do for speculative decoding (:meth:`Backend.spec_support`; see
    "Speculative decoding" in this module's docs). Returning one means the backend verifies
    drafts as that section says, whatever proposes them."""

    proposers: list[str] = []
    """Speculative methods whose drafts the backend proposes itself, returned in
    ``ModelRunnerOutput.draft_token_ids`` (e.g. ``["draft_model"]``, ``["mock"]``). The core's
    own ``"ngram"`` needs nothing here."""
    exact_verification: bool = True
    """Whether verification samples each position as decoding would, so that seeded requests
    at temperature > 0 give the same tokens as without speculation (greedy ones always do)."""
    lookahead_per_draft: int = 0
    """KV slots the backend's drafter writes past the verified positions, per draft token
    asked for (0 for ``"ngram"``: it writes none). See :meth:`lookahead_tokens`."""
    max_num_draft_tokens: int | None = None
    """The most drafts the backend verifies per request in one step (None: no limit); the
    engine refuses a larger ``num_speculative_tokens``."""
    cost_model: StepCostModel | None = None
    """The backend's step cost, as a prior for the dynamic policy (None: the policy starts
    from a generic prior and measures)."""

    def lookahead_tokens(self, num_draft_tokens: int) -> int:
        """KV slots to reserve past a request's ``1 + s`` scheduled positions in a step that
        asks for ``num_draft_tokens`` drafts (0 when it asks for none)."""
        return self.lookahead_per_draft * num_draft_tokens


class AsyncModelRunnerOutput(abc.ABC):
    """A launched step's results, on their way to the host."""

    device_time_s: float | None = None
    """Seconds the device spent on the step, when the backend measures it (known once
    :meth:`get_output` returned). While every step reports it, ``EngineStats.device_busy_s``
    sums these instead of the time steps were in flight, which overstates the device's work
    when the host is the slower side."""

    @abc.abstractmethod
    def get_output(self) -> ModelRunnerOutput:
        """Block until the step has run and its results are on the host, and return them.
        Called once, from a worker thread when ``step_in_thread`` is set."""


class Backend(abc.ABC):
    """Runs the model. Implementations are synchronous; the core calls them from one thread at a
    time (possibly not the main thread)."""

    step_in_thread: bool = True
    """Whether the core runs :meth:`execute_model` and :meth:`sample_tokens` in a worker thread,
    so requests and aborts keep arriving while they run. Right for any backend whose step waits
    on a device or releases the GIL; a backend whose step is brief pure-Python work gains no
    concurrency from a thread (it holds the GIL) and may set this False to save the hand-off."""

    supports_async_scheduling: bool = False
    """Whether the backend implements :meth:`sample_tokens_async` and takes a step scheduled
    while the previous one is in flight (see "Async scheduling" in this module's docs)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec | Sequence[LayerSpec]:
        """The KV geometry of the loaded model: one :class:`KVCacheSpec` when every layer is
        full attention with the same shape (one KV-cache group, as before), or one
        :class:`LayerSpec` per layer, in layer order. With per-layer specs the core groups the
        layers (``docs/kv_cache_groups.md``) and calls ``initialize_kv_cache(num_blocks,
        kv_groups)``; the block ids it sends are then per group."""

    @abc.abstractmethod
    def available_kv_cache_memory(self) -> int:
        """Bytes available for the KV cache after loading weights and a profiling pass."""

    @abc.abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks of ``config.block_size`` tokens each.

        A backend whose :meth:`kv_cache_spec` returns per-layer specs is called as
        ``initialize_kv_cache(num_blocks, kv_groups)`` instead, where ``kv_groups[g]`` lists
        the layer indices of KV-cache group ``g`` (in the order of the block tables the
        scheduler sends); one block is then a page of one group: ``max(len(group))`` layers'
        K and V for ``block_size`` tokens (``docs/kv_cache_groups.md``)."""

    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids the model accepts and produces."""

    def max_model_len(self) -> int | None:
        """The model's own context limit (None: unlimited)."""
        return None

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Run the forward pass of one step. Must be followed by :meth:`sample_tokens`."""

    @abc.abstractmethod
    def sample_tokens(self, grammar_bitmask: Any | None) -> ModelRunnerOutput:
        """Sample from the last forward pass.

        ``grammar_bitmask`` is None when no request of the batch samples under a grammar.
        Otherwise it is a C-contiguous numpy ``int32`` array of shape ``(rows, words)``:

        - one row per *constrained* request (``sampling_params.structured_outputs`` set) that
          samples a token this step, in batch order (cached requests, then new ones); a request
          on a partial prefill chunk samples nothing and has no row, nor does an unconstrained
          one; with speculative decoding a constrained request with ``s`` drafts has ``1 + s``
          consecutive rows, one per verified position (row ``j`` for the token sampled after
          its first ``j`` drafts);
        - ``words >= ceil(vocab_size / 32)``; bit ``j % 32`` of word ``j // 32`` (an int32,
          so bit 31 is the sign bit) is set when token ``j`` is allowed; words past the
          vocabulary are ignored.

        Disallowed tokens must not be sampled (mask their logits to -inf before sampling,
        before or after the other masks such as ``min_tokens``). A row always allows at least
        one token; when the grammar is complete it allows EOS. The array is the backend's to
        read during this call only.
        """

    def sample_tokens_async(self, grammar_bitmask: Any | None) -> AsyncModelRunnerOutput:
        """Launch sampling of the last forward pass and return at once (async scheduling only).
        ``grammar_bitmask`` is as for :meth:`sample_tokens`, with one row per constrained
        request that samples in the step, including those whose token will be discarded."""
        raise NotImplementedError(f"{type(self).__name__} does not support async scheduling")

    def spec_support(self) -> SpecSupport | None:
        """What the backend can do for speculative decoding, or None (the default): it cannot
        verify drafts, and the engine refuses ``speculative_config`` for it. Called once, after
        the backend is constructed; see "Speculative decoding" in this module's docs."""
        return None

    def lora_support(self) -> LoRASupport | None:
        """What the backend can serve of LoRA, or None (the default): the base model only, and
        the engine refuses ``enable_lora``. Called once, after the backend is constructed; see
        "LoRA adapters" in this module's docs."""
        return None

    def add_lora(self, lora: LoRARequest) -> None:
        """Read and check the adapter at ``lora.lora_path`` and keep it ready in host memory
        under ``lora.lora_int_id``, replacing one loaded under that id. Raises
        :class:`~engine_core.lora.LoRAError` (naming the adapter and the reason) when it cannot
        be served. Called from the core's adapter loader thread while steps run: it must be
        safe against :meth:`execute_model` in flight. The default refuses every adapter."""
        raise LoRAError(lora.lora_name, f"the {type(self).__name__} backend does not serve LoRA")

    def remove_lora(self, lora_int_id: int) -> None:  # noqa: B027
        """Forget the adapter loaded under ``lora_int_id`` (an unknown id is ignored). Called
        from the adapter loader thread, only once no request in flight uses it."""

    def init_kv_connector(self, name: str, layout: KVConnectorLayout) -> None:
        """Set up the worker half of KV connector ``name`` on every tensor-parallel rank
        (called once, after :meth:`initialize_kv_cache`, when ``EngineConfig.kv_connector_name``
        is set). The backend builds it (``engine_core.kv_connector``: the plugin's
        ``KVConnectorProvider.worker``, or its own implementation of a built-in connector such
        as ``"host"``), registers its KV cache with it, and from then on, each step, calls
        ``start_step(scheduler_output.kv_connector_metadata)`` before the forward pass,
        ``after_forward()`` after it, and returns ``get_finished()`` (merged over the ranks) in
        ``ModelRunnerOutput.kv_connector_report``. The default raises
        ``NotImplementedError``: the engine then refuses the connector at startup. A
        ``ValueError`` here (e.g. more host memory asked for than can be pinned) is a startup
        error shown to the user as it is."""
        raise NotImplementedError(f"{type(self).__name__} does not support KV connectors")

    def resolved_settings(self) -> dict[str, str | int | float | bool]:
        """What the backend decided for itself that the user may not have said (its device,
        kernels, CPU threads and where their count came from), for the engine's one-line
        startup log (``EngineInfo.backend_settings``). Called once, after
        :meth:`initialize_kv_cache`; ``{}`` by default."""
        return {}

    def profile(self, action: Literal["start", "stop"]) -> None:  # noqa: B027
        """Start or stop a profiler; no-op by default."""

    def sleep(self, level: int = 1) -> None:  # noqa: B027
        """Release device memory while idle; no-op by default."""

    def wake_up(self) -> None:  # noqa: B027
        """Undo :meth:`sleep`; no-op by default."""

    def close(self) -> None:  # noqa: B027
        """Release everything; called once."""


@runtime_checkable
class BackendProvider(Protocol):
    """The cheap object an entry point names. Must not import heavy dependencies."""

    name: str
    install_hint: str
    """What to install to make this backend usable, e.g. ``pip install engine-core-cuda``.

    A provider may also define ``fallback_options``: ``backend_options`` under which the
    backend runs where :meth:`is_available` says no (the CUDA backend without a GPU:
    ``{"device": "cpu"}``). ``engine-core backends`` then lists it as installed, and errors do
    not tell the user to install it; the detail should say how to use them
    (:func:`engine_core.config.backend_options_hint` writes them as the user types them)."""

    def is_available(self, config: EngineConfig | None = None) -> tuple[bool, str]:
        """Whether the backend can run here, and why not (or a short description).

        ``config`` is given when the backend is asked for by name (it may, say, request a CPU
        device); it is None for discovery and for ``backend="auto"``."""
        ...

    def load(self) -> type[Backend]:
        """Import and return the backend class."""
        ...


class PreemptionVictimPolicy(abc.ABC):
    """Whom recompute preemption evicts when the KV cache runs out: a custom policy, named in
    ``EngineConfig.preemption_victim`` as ``"module:attribute"`` (this class's subclass, or a
    callable that returns an instance; it is called with no argument in the engine process).

    The scheduler calls :meth:`pick` whenever the running request it is serving cannot get its
    blocks; the victim's blocks are freed and it goes back to the waiting queue, keeping its
    place there (priority, arrival). A request may read of each running request its
    ``request_id``, ``priority``, ``arrival_time``, ``num_computed_tokens``, ``num_tokens``,
    ``num_prompt_tokens`` and ``num_preemptions``, and must change nothing.

    A policy that raises or returns a request that is not in ``running`` is a bug: the engine
    stops with :class:`~engine_core.errors.EngineDeadError`, that error as its cause.
    """

    @abc.abstractmethod
    def pick(self, running: Sequence[Request], requester: Request) -> Request:
        """One of ``running`` (admission order; never empty) to preempt so that ``requester``
        (one of them) gets its blocks. Returning ``requester`` itself gives up on it for this
        step: it is preempted and nothing else is."""
