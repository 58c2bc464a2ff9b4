"""``StructuredOutputManager``: grammars of constrained requests, compiled off the engine's
thread and cached, and the token bitmask of each step.

Compilation: a constrained request enters the scheduler as WAITING_FOR_GRAMMAR (the waiting scan
passes over it) and its grammar is compiled in a small thread pool. Compiled grammars are cached by
:class:`~engine_core._structured.grammar.GrammarSpec` (failures too, so a bad schema sent again
fails at once); a request whose spec is cached gets a copy of the cached matcher without waiting,
and requests whose spec is being compiled share that compilation. :meth:`poll`, called by the engine
before each schedule, hands over finished compilations: the request moves to WAITING, or ends with
an error when its grammar failed to compile or did not compile within ``compile_timeout_s`` (a
compilation cannot be interrupted: when it ends later its result still fills the cache).

Bitmask: one row per constrained request that samples a token this step, in batch order (see
:meth:`engine_core.abc.Backend.sample_tokens`), filled by llguidance, which releases the GIL, so
it can run on a helper thread while the forward pass runs on another.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine_core._core.request import Request, RequestStatus
from engine_core._structured.grammar import (
    Grammar,
    GrammarError,
    GrammarSpec,
    build_tokenizer,
    compile_grammar,
    import_structured,
)

__all__ = ["DEFAULT_COMPILE_TIMEOUT_S", "StructuredOutputManager"]

logger = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT_S = 10.0
"""How long a request waits for its grammar before it ends with an error."""
DEFAULT_CACHE_SIZE = 256
"""Compiled grammars (and compile errors) kept, least recently used dropped first."""
_PARALLEL_FILL_MIN_BITS = 1 << 20
"""Rows x vocabulary from which llguidance's thread pool fills the bitmask: below it (small
batches or vocabularies) the hand-off costs more than it saves."""
_WAITING_FOR_GRAMMAR = RequestStatus.WAITING_FOR_GRAMMAR


@dataclass(slots=True)
class _Pending:
    request: Request
    spec: GrammarSpec
    future: concurrent.futures.Future[Any]
    deadline: float


def _default_compile_threads() -> int:
    return max(1, min(4, (os.cpu_count() or 2) // 2))


class StructuredOutputManager:
    """Compiles and caches the grammars of constrained requests and fills the token bitmask
    (the scheduler advances each request's grammar). Used by one thread, the engine's; only
    compilation and the bitmask fill run on threads of its own.

    ``on_compiled`` (settable) is called from a compile thread after each compilation ends, so
    an engine idle but for pending grammars can wake up; it must not block.
    """

    def __init__(
        self,
        tokenizer_name: str,
        vocab_size: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        cache_size: int = DEFAULT_CACHE_SIZE,
        compile_threads: int | None = None,
    ) -> None:
        if compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {compile_timeout_s!r}")
        self.tokenizer_name = tokenizer_name
        self.vocab_size = vocab_size
        self.clock = clock
        self.compile_timeout_s = compile_timeout_s
        self.cache_size = cache_size
        self.on_compiled: Callable[[], None] | None = None
        self.num_compiles = 0
        """Compilations started (cache misses that no running compilation covered)."""
        self.num_cache_hits = 0
        self._compile_threads = compile_threads or _default_compile_threads()
        self._pending: dict[str, _Pending] = {}
        self._inflight: dict[GrammarSpec, concurrent.futures.Future[Any]] = {}
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._tokenizer: Any = None
        self._eos_token_ids: frozenset[int] | None = None
        self._tokenizer_error: GrammarError | None = None
        self._tokenizer_lock = threading.Lock()
        self._compile_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._bitmask_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._np: Any = None
        self._parallel_fill: Any = None
        self._multicore = (os.cpu_count() or 1) > 2
        self._num_words = 0
        self._num_llg_words = 0

    # -- compilation ----------------------------------------------------------------------------

    @property
    def num_pending(self) -> int:
        """Requests waiting for their grammar."""
        return len(self._pending)

    def add(self, request: Request) -> str | None:
        """Give ``request`` its grammar: at once from the cache (``request.grammar`` is set),
        or by starting (or joining) a compilation that :meth:`poll` hands over. Returns the
        error of a spec that is cached as failed, else None."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        try:
            spec = GrammarSpec.from_params(params)
        except Exception as exc:  # the request ends with the error; never the engine
            return _error_text(_params_kind(params), exc)
        entry = self._cache.get(spec)
        if entry is not None:
            self._cache.move_to_end(spec)
            self.num_cache_hits += 1
            return entry if isinstance(entry, str) else self._attach(request, spec, entry)
        future = self._inflight.get(spec)
        if future is None:
            if self._compile_pool is None:
                self._compile_pool = concurrent.futures.ThreadPoolExecutor(
                    self._compile_threads, thread_name_prefix="engine-core-grammar"
                )
            future = self._compile_pool.submit(self._compile, spec)
            future.add_done_callback(self._compiled)
            self._inflight[spec] = future
            self.num_compiles += 1
        self._pending[request.request_id] = _Pending(
            request, spec, future, self.clock() + self.compile_timeout_s
        )
        return None

    def _compile(self, spec: GrammarSpec) -> Any:
        """Runs on a compile thread: the matcher of ``spec``, or the error message."""
        try:
            return compile_grammar(self._llg_tokenizer(), spec)
        except GrammarError as exc:
            return str(exc)
        except Exception as exc:
            logger.exception("compiling structured_outputs.%s failed", spec.kind)
            return _error_text(spec.kind, exc)

    def _grammar(self, template: Any) -> Grammar:
        if self._eos_token_ids is None:
            # A matcher exists, so the tokenizer is built.
            self._eos_token_ids = frozenset(self._tokenizer.eos_tokens)
        return Grammar(template.deep_copy(), self._eos_token_ids)

    def _attach(self, request: Request, spec: GrammarSpec, template: Any) -> str | None:
        """Give ``request`` a copy of the compiled ``template``; the error, if that fails."""
        try:
            request.grammar = self._grammar(template)
        except Exception as exc:
            logger.exception("copying the structured_outputs.%s grammar failed", spec.kind)
            return _error_text(spec.kind, exc)
        return None

    def _compiled(self, future: concurrent.futures.Future[Any]) -> None:
        # A done callback: the result is visible to poll() by now.
        callback = self.on_compiled
        if callback is not None:
            callback()

    def _llg_tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._tokenizer is None and self._tokenizer_error is None:
                try:
                    self._tokenizer = build_tokenizer(self.tokenizer_name, self.vocab_size)
                except GrammarError as exc:
                    self._tokenizer_error = exc
            if self._tokenizer_error is not None:
                raise self._tokenizer_error
            return self._tokenizer

    def poll(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Hand over finished compilations: (requests whose grammar is now set, (request,
        error) for those whose grammar failed or timed out). Forgets requests that ended
        meanwhile."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        now = self.clock()
        for request_id, pending in list(self._pending.items()):
            request = pending.request
            if request.status != _WAITING_FOR_GRAMMAR:
                del self._pending[request_id]  # aborted while it waited
            elif pending.future.done():
                del self._pending[request_id]
                entry = self._collect(pending.spec, pending.future)
                if not isinstance(entry, str):
                    entry = self._attach(request, pending.spec, entry)
                if entry is None:
                    ready.append(request)
                else:
                    failed.append((request, entry))
            elif now >= pending.deadline:
                del self._pending[request_id]
                failed.append(
                    (
                        request,
                        f"the structured_outputs.{pending.spec.kind} grammar did not compile "
                        f"within {self.compile_timeout_s:g} s",
                    )
                )
        if len(self._inflight) > len(self._pending):
            # Compilations nobody waits for any more (timed out, aborted) still fill the cache.
            for spec, future in list(self._inflight.items()):
                if future.done():
                    self._collect(spec, future)
        return ready, failed

    def _collect(self, spec: GrammarSpec, future: concurrent.futures.Future[Any]) -> Any:
        """The result of a finished compilation, moved into the cache."""
        if future.cancelled():
            entry: Any = f"structured_outputs.{spec.kind}: its compilation was cancelled"
        elif (exc := future.exception()) is not None:
            # _compile returns every error; a panic in llguidance is a BaseException.
            entry = _error_text(spec.kind, exc)
        else:
            entry = future.result()
        if self._inflight.get(spec) is future:
            del self._inflight[spec]
            self._cache[spec] = entry
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return entry

    def wait(self, timeout: float | None) -> None:
        """Block until a pending compilation ends or ``timeout`` seconds pass."""
        self._forget_ended()
        futures = [p.future for p in self._pending.values()]
        if futures:
            concurrent.futures.wait(
                futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def seconds_to_deadline(self) -> float | None:
        """Seconds until the first pending request times out (0 when one has); None when none
        is pending."""
        self._forget_ended()
        if not self._pending:
            return None
        deadline = min(p.deadline for p in self._pending.values())
        return max(0.0, deadline - self.clock())

    def _forget_ended(self) -> None:
        ended = [k for k, p in self._pending.items() if p.request.status != _WAITING_FOR_GRAMMAR]
        for request_id in ended:
            del self._pending[request_id]

    # -- the bitmask ----------------------------------------------------------------------------

    @staticmethod
    def bitmask_matchers(scheduled: Sequence[Request]) -> list[Any]:
        """The matchers that get a bitmask row: constrained requests of the batch that sample
        a token this step (a partial prefill chunk samples nothing), in batch order."""
        return [
            r.grammar.matcher  # type: ignore[attr-defined]  # the engine attaches only Grammar
            for r in scheduled
            if r.grammar is not None and r.num_computed_tokens == len(r.all_token_ids)
        ]

    @staticmethod
    def bitmask_matchers_with_drafts(
        scheduled: Sequence[Request],
    ) -> tuple[list[Any], list[list[int]]]:
        """:meth:`bitmask_matchers` with speculative decoding: also each one's drafts verified
        this step (one row per verified position: ``1 + len(drafts)`` rows)."""
        matchers: list[Any] = []
        drafts: list[list[int]] = []
        for r in scheduled:
            if r.grammar is None:
                continue
            scheduled_drafts = r.drafting.scheduled if r.drafting is not None else []
            if r.num_computed_tokens - len(scheduled_drafts) == len(r.all_token_ids):
                matchers.append(r.grammar.matcher)  # type: ignore[attr-defined]
                drafts.append(scheduled_drafts)
        return matchers, drafts

    def fill_bitmask_rows(self, requests: Sequence[Request]) -> Any:
        """The bitmask of one row per request, in order: its grammar's, or every token allowed
        for a request that ended since it was scheduled (async scheduling: what it samples is
        discarded)."""
        live = [i for i, r in enumerate(requests) if r.grammar is not None]
        matchers = [requests[i].grammar.matcher for i in live]  # type: ignore[union-attr]
        if len(live) == len(requests):
            return self.fill_bitmask(matchers)
        np = self._np
        if np is None:
            self._init_bitmask()
            np = self._np
        bitmask = np.full((len(requests), self._num_words), -1, dtype=np.int32)
        if live:
            bitmask[live] = self.fill_bitmask(matchers)
        return bitmask

    def fill_bitmask(
        self, matchers: Sequence[Any], drafts: Sequence[list[int]] | None = None
    ) -> Any:
        """The int32 bitmask of ``matchers``: shape (rows, ceil(vocab / 32)), bit ``j % 32`` of
        word ``j // 32`` set when token ``j`` is allowed. With ``drafts`` (speculative
        decoding, one list per matcher), ``1 + len(drafts[i])`` rows for matcher ``i``: its
        state, then after each of its drafts in turn (which it is rolled back from)."""
        if self._np is None:
            self._init_bitmask()
        np = self._np
        num_rows = len(matchers)
        if drafts is not None:
            num_rows += sum(len(d) for d in drafts)
        num_words, num_llg_words = self._num_words, self._num_llg_words
        if num_llg_words == num_words:
            bitmask = np.empty((num_rows, num_words), dtype=np.int32)
            self._fill(matchers, bitmask, drafts)
            return bitmask
        # The model has ids the tokenizer lacks: they stay disallowed.
        llg_bitmask = np.empty((num_rows, num_llg_words), dtype=np.int32)
        self._fill(matchers, llg_bitmask, drafts)
        bitmask = np.zeros((num_rows, num_words), dtype=np.int32)
        bitmask[:, :num_llg_words] = llg_bitmask
        return bitmask

    def _init_bitmask(self) -> None:
        # A matcher exists, so its compilation imported numpy and built the tokenizer.
        _, self._np = import_structured()
        self._num_llg_words = -(-self._tokenizer.vocab_size // 32)
        self._num_words = max(self._num_llg_words, -(-self.vocab_size // 32))

    def _fill(
        self, matchers: Sequence[Any], bitmask: Any, drafts: Sequence[list[int]] | None = None
    ) -> None:
        num_rows, num_words = bitmask.shape
        row_bytes = num_words * 4
        base = bitmask.ctypes.data
        if drafts is not None:
            row = 0
            for matcher, request_drafts in zip(matchers, drafts, strict=True):
                matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
                row += 1
                for draft in request_drafts:
                    # The drafts were truncated to those the grammar accepts.
                    matcher.consume_token(draft)
                    matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
                    row += 1
                if request_drafts:
                    matcher.rollback(len(request_drafts))
            return
        if self._multicore and num_rows * num_words * 32 >= _PARALLEL_FILL_MIN_BITS:
            if self._parallel_fill is None:
                llguidance, _ = import_structured()
                self._parallel_fill = llguidance.LLExecutor()
            self._parallel_fill.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(matchers)], base, row_bytes, num_rows
            )
            return
        for i, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)

    def submit_bitmask(
        self, matchers: Sequence[Any], drafts: Sequence[list[int]] | None = None
    ) -> concurrent.futures.Future[Any]:
        """:meth:`fill_bitmask` on the helper thread (to overlap the forward pass)."""
        if self._bitmask_pool is None:
            self._bitmask_pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="engine-core-bitmask"
            )
        if drafts is None:
            return self._bitmask_pool.submit(self.fill_bitmask, matchers)
        return self._bitmask_pool.submit(self.fill_bitmask, matchers, drafts)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the threads; compilations already running end on their own."""
        self._pending.clear()
        for pool in (self._compile_pool, self._bitmask_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._compile_pool = self._bitmask_pool = None


def _params_kind(params: Any) -> str:
    """The field of a ``StructuredOutputsParams`` that is set."""
    for name in ("json", "json_object", "regex", "choice", "grammar"):
        if getattr(params, name, None) is not None:
            return name
    return "?"


def _error_text(kind: str, exc: BaseException) -> str:
    if isinstance(exc, GrammarError):
        return str(exc)
    return f"structured_outputs.{kind} failed to compile: {type(exc).__name__}: {exc}"
