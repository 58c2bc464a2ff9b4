"""The driver behind ``engine_core.testing``: a backend stepped by the real scheduler."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from engine_core._core.kv_groups import plan_kv_layout
from engine_core._core.request import Request
from engine_core._core.scheduler import Scheduler, SchedulerConfig
from engine_core.abc import (
    AsyncModelRunnerOutput,
    Backend,
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from engine_core.config import EngineConfig
from engine_core.lora import LoRARequest
from engine_core.sampling_params import SamplingParams

BackendFactory = Callable[[EngineConfig], Backend]
"""Builds a backend from an engine config (a :class:`~engine_core.abc.Backend` subclass is one)."""

MAX_BLOCKS = 128
MIN_BLOCKS = 24
MAX_STEPS = 1000


def default_config() -> EngineConfig:
    return EngineConfig(tokenizer="byte", max_model_len=512)


def make_prompt(seed: int, length: int) -> list[int]:
    """A prompt of small token ids (valid in any vocabulary of 256 or more)."""
    return [(seed * 37 + i * 11) % 256 for i in range(length)]


def num_blocks_for(backend: Backend, config: EngineConfig) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    page_size = plan_kv_layout(backend.kv_cache_spec(), config.block_size).page_size_bytes
    return min(backend.available_kv_cache_memory() // page_size, MAX_BLOCKS)


def initialize_kv(backend: Backend, config: EngineConfig, num_blocks: int) -> None:
    """``initialize_kv_cache`` as the engine calls it: with the KV-cache groups when the
    backend gave per-layer specs."""
    layout = plan_kv_layout(backend.kv_cache_spec(), config.block_size)
    if layout.per_layer:
        backend.initialize_kv_cache(num_blocks, layout.kv_groups)  # type: ignore[call-arg]
    else:
        backend.initialize_kv_cache(num_blocks)


@contextmanager
def opened(
    make_backend: BackendFactory, config: EngineConfig, *, async_scheduling: bool = False
) -> Iterator[Harness]:
    """A started backend (KV cache allocated) in a harness (one that keeps a step in flight
    with ``async_scheduling``); closed on exit."""
    backend = make_backend(config)
    try:
        num_blocks = num_blocks_for(backend, config)
        assert num_blocks >= MIN_BLOCKS, (
            f"the checks need {MIN_BLOCKS} KV blocks; the backend offers {num_blocks}"
        )
        initialize_kv(backend, config, num_blocks)
        cls = AsyncHarness if async_scheduling else Harness
        yield cls(backend, config, num_blocks)
    finally:
        backend.close()


class Harness:
    """Drives one backend like ``EngineCore`` does, checking every output's shape."""

    async_scheduling = False

    def __init__(self, backend: Backend, config: EngineConfig, num_blocks: int) -> None:
        self.backend = backend
        self.vocab_size = backend.vocab_size()
        self.block_size = config.block_size
        max_model_len = config.max_model_len or backend.max_model_len() or 8192
        assert max_model_len >= 8 * self.block_size, (
            f"the checks need max_model_len >= {8 * self.block_size}, got {max_model_len}"
        )
        self.kv_layout = plan_kv_layout(backend.kv_cache_spec(), self.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=4096,
                max_model_len=max_model_len,
                block_size=self.block_size,
                async_scheduling=self.async_scheduling,
                enable_lora=config.enable_lora,
                max_loras=config.max_loras,
            ),
            num_blocks,
            kv_layout=self.kv_layout,
        )
        self.outputs: dict[str, list[int]] = {}
        self.logprobs: dict[str, list[TokenLogprobs]] = {}
        self.prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}

    def set_token_budget(self, num_tokens: int) -> None:
        """Tokens per step; a prompt longer than this is prefilled in chunks."""
        self.scheduler.config.max_num_batched_tokens = num_tokens

    def add(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int,
        *,
        cold: bool = True,
        lora_request: LoRARequest | None = None,
        **params: Any,
    ) -> None:
        """Queue a greedy request; ``cold`` ones never hit the prefix cache; ``lora_request``
        runs it with an adapter (loaded with ``add_lora`` and in :attr:`lora_ready`)."""
        self.add_sampled(
            req_id,
            prompt,
            max_tokens,
            cold=cold,
            lora_request=lora_request,
            temperature=0.0,
            **params,
        )

    def add_sampled(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int,
        *,
        cold: bool = True,
        lora_request: LoRARequest | None = None,
        **params: Any,
    ) -> None:
        """Queue a request with its own sampling parameters; ``cold`` as for :meth:`add`."""
        request = Request(
            req_id,
            prompt,
            SamplingParams(max_tokens=max_tokens, **params),
            block_size=self.block_size,
            cache_salt=req_id if cold else None,
            lora_request=lora_request,
        )
        self.scheduler.add_request(request)
        self.outputs[req_id] = []

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests([req_id])

    def step(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """One engine step; returns what the backend was given and what it answered."""
        scheduler_output = self.scheduler.schedule()
        assert scheduler_output.total_num_scheduled_tokens > 0, "nothing was scheduled"
        requests = self.scheduler.requests
        # After schedule(), a request whose computed tokens reach its length samples this step.
        completes = [
            requests[r].num_computed_tokens == requests[r].num_tokens
            for r in scheduler_output.req_ids
        ]
        self.backend.execute_model(scheduler_output)
        runner_output = self.backend.sample_tokens(None)
        self._apply(scheduler_output, runner_output, completes)
        return scheduler_output, runner_output

    def _apply(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        completes: list[bool],
        discarded: list[bool] | None = None,
    ) -> None:
        self._check_output(scheduler_output, runner_output, completes)
        for index, req_id in enumerate(runner_output.req_ids):
            if discarded is not None and discarded[index]:
                continue
            self.outputs[req_id] += runner_output.sampled_token_ids[index]
            if runner_output.logprobs is not None and runner_output.logprobs[index]:
                self.logprobs.setdefault(req_id, []).extend(runner_output.logprobs[index] or [])
        for req_id, entries in (runner_output.prompt_logprobs or {}).items():
            self.prompt_logprobs.setdefault(req_id, []).extend(entries)
        self.scheduler.update_from_output(scheduler_output, runner_output)

    def _check_output(
        self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput, completes: list[bool]
    ) -> None:
        assert isinstance(output, ModelRunnerOutput), (
            f"sample_tokens returned {type(output).__name__}, not a ModelRunnerOutput"
        )
        batch = scheduler_output.req_ids
        assert output.req_ids == batch, (
            f"sample_tokens returned req_ids {output.req_ids}; the batch order is {batch}"
        )
        assert len(output.sampled_token_ids) == len(batch), (
            f"sample_tokens returned {len(output.sampled_token_ids)} results for {len(batch)} "
            "requests"
        )
        for req_id, tokens, complete in zip(
            batch, output.sampled_token_ids, completes, strict=True
        ):
            if not complete:
                assert tokens == [], (
                    f"request {req_id!r} ran a partial prefill chunk but got tokens {tokens}"
                )
                continue
            assert len(tokens) == 1, f"request {req_id!r} should get one token, got {tokens}"
            token = tokens[0]
            assert isinstance(token, int) and 0 <= token < self.vocab_size, (
                f"request {req_id!r} got token {token!r}, outside the vocabulary "
                f"(size {self.vocab_size})"
            )
        if output.logprobs is not None:
            assert len(output.logprobs) == len(batch), (
                f"logprobs has {len(output.logprobs)} entries for {len(batch)} requests"
            )

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def run(self) -> dict[str, list[int]]:
        """Step until every request has finished; the tokens of every request added so far."""
        for _ in range(MAX_STEPS):
            if not self.has_work():
                return self.outputs
            self.step()
        raise AssertionError(f"requests did not finish within {MAX_STEPS} steps")

    def generate(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int,
        lora_request: LoRARequest | None = None,
    ) -> list[int]:
        """Run one cold request alone to completion (a reference result)."""
        self.add(req_id, prompt, max_tokens, lora_request=lora_request)
        return self.run()[req_id]


def assert_same(label: str, got: list[int], expected: list[int]) -> None:
    assert got == expected, f"{label}: got tokens {got}, expected {expected} (as when run alone)"


class AsyncHarness(Harness):
    """Drives a backend with async scheduling, as ``EngineCore`` does: each step is scheduled
    and launched (``execute_model``, ``sample_tokens_async``) before the results of the step
    before it are waited for and applied. ``outputs`` hold the tokens applied so far."""

    async_scheduling = True

    def __init__(self, backend: Backend, config: EngineConfig, num_blocks: int) -> None:
        super().__init__(backend, config, num_blocks)
        self._in_flight: deque[
            tuple[SchedulerOutput, list[bool], list[Request], AsyncModelRunnerOutput]
        ] = deque()

    def has_work(self) -> bool:
        return bool(self._in_flight) or self.scheduler.has_unfinished_requests()

    def step(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """Launch the next step (if anything can be scheduled), then wait for and apply the
        oldest one in flight when another is in flight after it, or nothing more was launched.
        Returns the newest step's batch and the results applied (an empty output when none)."""
        scheduler_output = self.scheduler.schedule()
        launched = scheduler_output.total_num_scheduled_tokens > 0
        if launched:
            completes = [r.samples_in_flight for r in self.scheduler.scheduled]
            self.backend.execute_model(scheduler_output)
            handle = self.backend.sample_tokens_async(None)
            assert isinstance(handle, AsyncModelRunnerOutput), (
                f"sample_tokens_async returned {type(handle).__name__}, not an "
                "AsyncModelRunnerOutput"
            )
            batch = list(self.scheduler.scheduled)
            self._in_flight.append((scheduler_output, completes, batch, handle))
        else:
            assert self._in_flight, "nothing was scheduled"
        runner_output = ModelRunnerOutput([], [])
        if len(self._in_flight) > 1 or not launched:
            older, completes, batch, handle = self._in_flight.popleft()
            runner_output = handle.get_output()
            # Requests that ended since the step was launched: their tokens are discarded.
            discarded = [r.is_finished for r in batch]
            self._apply(older, runner_output, completes, discarded)
        return scheduler_output, runner_output
