"""Hand-built scheduler outputs for driving a :class:`MockBackend` step by step in tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from engine_core_mock import MockBackend

from engine_core.abc import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams

CachedStep = tuple[str, int, int, list[int] | None]
"""(req_id, num_computed_tokens, num_scheduled_tokens, new_block_ids) of a running request."""


class Driver:
    """A started mock backend and a trivial block allocator (fresh ids, never reused)."""

    def __init__(
        self,
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        tokenizer: str = "byte",
        seed: int = 0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        **options: Any,
    ) -> None:
        self.backend = MockBackend(
            EngineConfig(
                tokenizer=tokenizer, block_size=block_size, seed=seed, backend_options=options
            ),
            sleep=sleep,
            clock=clock,
        )
        self.backend.initialize_kv_cache(num_blocks)
        self.block_size = block_size
        self._next_block = 0

    def blocks(self, num_tokens: int) -> list[int]:
        """Fresh block ids for ``num_tokens`` tokens."""
        count = -(-num_tokens // self.block_size)
        first = self._next_block
        self._next_block += count
        return list(range(first, first + count))

    def new(
        self,
        req_id: str,
        prompt: Sequence[int],
        *,
        computed: int = 0,
        scheduled: int | None = None,
        outputs: Sequence[int] = (),
        eos: Sequence[int] = (),
        blocks: list[int] | None = None,
        **params: Any,
    ) -> NewRequestData:
        """A new request (greedy unless ``params`` say otherwise) whose block table has room
        for 32 more tokens; by default all its tokens are scheduled."""
        num_tokens = len(prompt) + len(outputs)
        return NewRequestData(
            req_id,
            list(prompt),
            SamplingParams(**{"temperature": 0.0, **params}),
            self.blocks(num_tokens + 32) if blocks is None else blocks,
            computed,
            num_tokens - computed if scheduled is None else scheduled,
            list(outputs),
            list(eos),
        )

    def step(
        self,
        new: Sequence[NewRequestData] = (),
        cached: Sequence[CachedStep] = (),
        *,
        finished: Sequence[str] = (),
        preempted: Sequence[str] = (),
        bitmask: Any = None,
        total: int | None = None,
        drafts: Sequence[list[int]] = (),
        num_draft_tokens: int = 0,
        draft_req_ids: list[str] | None = None,
    ) -> ModelRunnerOutput:
        """execute_model + sample_tokens of one hand-built step; ``drafts``: the cached
        requests' drafts (speculative decoding), parallel to ``cached``."""
        columns = CachedRequestData(
            [c[0] for c in cached],
            [c[3] for c in cached],
            [c[1] for c in cached],
            [c[2] for c in cached],
            [list(d) for d in drafts],
        )
        if total is None:
            total = sum(r.num_scheduled_tokens for r in new) + sum(c[2] for c in cached)
        self.backend.execute_model(
            SchedulerOutput(
                list(new),
                columns,
                total,
                list(finished),
                list(preempted),
                num_draft_tokens,
                draft_req_ids,
            )
        )
        return self.backend.sample_tokens(bitmask)

    def decode(self, req_ids: Sequence[str]) -> ModelRunnerOutput:
        """One decode step (one token each) of running requests."""
        return self.step(
            cached=[(r, self.backend.num_computed_tokens(r), 1, None) for r in req_ids]
        )

    def verify(self, req_id: str, drafts: list[int], **step: Any) -> ModelRunnerOutput:
        """One decode step of ``req_id`` verifying ``drafts``."""
        computed = self.backend.num_computed_tokens(req_id)
        return self.step(
            cached=[(req_id, computed, 1 + len(drafts), None)], drafts=[drafts], **step
        )

    def run(self, requests: Sequence[NewRequestData], num_tokens: int) -> dict[str, list[int]]:
        """Prefill ``requests`` whole in one step, then decode until each has ``num_tokens``."""
        output = self.step(new=requests)
        tokens = {r: list(t) for r, t in zip(output.req_ids, output.sampled_token_ids, strict=True)}
        for _ in range(num_tokens - 1):
            output = self.decode(list(tokens))
            for req_id, sampled in zip(output.req_ids, output.sampled_token_ids, strict=True):
                tokens[req_id] += sampled
        return tokens


class FakeTime:
    """A clock that only its sleep advances; records each sleep."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
