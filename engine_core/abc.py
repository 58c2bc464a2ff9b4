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
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import msgspec

from engine_core._core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from engine_core._core.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from engine_core.config import EngineConfig

__all__ = [
    "AsyncModelRunnerOutput",
    "Backend",
    "BackendProvider",
    "CachedRequestData",
    "KVCacheSpec",
    "ModelRunnerOutput",
    "NewRequestData",
    "SchedulerOutput",
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
    def kv_cache_spec(self) -> KVCacheSpec:
        """The KV geometry of the loaded model."""

    @abc.abstractmethod
    def available_kv_cache_memory(self) -> int:
        """Bytes available for the KV cache after loading weights and a profiling pass."""

    @abc.abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks of ``config.block_size`` tokens each."""

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
          one;
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
