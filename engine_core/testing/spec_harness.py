"""The driver behind ``engine_core.testing.check_spec_decode``: a backend verifying scripted
drafts, stepped by the real scheduler with speculative decoding on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine_core._core.drafts import DraftPlanner, check_verified
from engine_core._core.scheduler import Scheduler, SchedulerConfig
from engine_core.abc import Backend, ModelRunnerOutput, SchedulerOutput, SpecSupport
from engine_core.config import EngineConfig, SpeculativeConfig
from engine_core.errors import BackendError
from engine_core.ngram import NgramIndex
from engine_core.testing.harness import Harness

NUM_DRAFTS = 4


class ScriptedProposer:
    """Drafts from known continuations: draft ``i`` at position ``p`` is the reference token
    there when ``right(p, i)``, else another token."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.sequences: list[list[int]] = []
        self.right: Any = lambda position, i: True

    def propose(
        self, token_ids: Sequence[int], k: int, index: NgramIndex | None = None
    ) -> list[int]:
        num = len(token_ids)
        for sequence in self.sequences:
            if len(sequence) > num and sequence[:num] == list(token_ids):
                drafts = sequence[num : num + k]
                return [
                    t if self.right(num + i, i) else (t + 1) % self.vocab_size
                    for i, t in enumerate(drafts)
                ]
        return []


class SpecHarness(Harness):
    """A :class:`Harness` whose scheduler speculates with :class:`ScriptedProposer` drafts
    (up to ``NUM_DRAFTS`` a step) and checks every verification."""

    def __init__(
        self, backend: Backend, config: EngineConfig, num_blocks: int, support: SpecSupport
    ) -> None:
        super().__init__(backend, config, num_blocks)
        self.proposer = ScriptedProposer(self.vocab_size)
        spec = DraftPlanner(
            SpeculativeConfig(num_speculative_tokens=NUM_DRAFTS, dynamic=False),
            support,
        )
        spec.proposer = self.proposer
        old = self.scheduler
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=old.config.max_num_seqs,
                max_num_batched_tokens=old.config.max_num_batched_tokens,
                max_model_len=old.config.max_model_len,
                block_size=self.block_size,
            ),
            num_blocks,
            spec,
            self.kv_layout,
        )
        self.num_verified = 0
        self.num_rejected = 0

    def step(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        scheduler_output = self.scheduler.schedule()
        assert scheduler_output.total_num_scheduled_tokens > 0, "nothing was scheduled"
        requests = self.scheduler.requests
        drafts = {
            req_id: scheduler_output.cached.drafts_of(i)
            for i, req_id in enumerate(scheduler_output.cached.req_ids)
        }
        completes = [
            requests[r].num_computed_tokens - len(drafts.get(r, ())) == requests[r].num_tokens
            for r in scheduler_output.req_ids
        ]
        self.backend.execute_model(scheduler_output)
        runner_output = self.backend.sample_tokens(None)
        self._drafts = drafts
        self._apply(scheduler_output, runner_output, completes)
        return scheduler_output, runner_output

    def _check_output(
        self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput, completes: list[bool]
    ) -> None:
        single = [bool(not self._drafts.get(r)) for r in scheduler_output.req_ids]
        if all(single):
            super()._check_output(scheduler_output, output, completes)
            return
        assert output.req_ids == scheduler_output.req_ids, (
            f"sample_tokens returned req_ids {output.req_ids}; the batch order is "
            f"{scheduler_output.req_ids}"
        )
        for req_id, tokens in zip(output.req_ids, output.sampled_token_ids, strict=True):
            drafts = self._drafts.get(req_id)
            if not drafts:
                assert len(tokens) <= 1, f"request {req_id!r} got {tokens} without drafts"
                continue
            try:
                accepted = check_verified(req_id, drafts, tokens)
            except BackendError as exc:
                raise AssertionError(str(exc)) from None
            self.num_verified += len(drafts)
            self.num_rejected += len(drafts) - accepted
            if output.logprobs is not None and output.logprobs[output.req_ids.index(req_id)]:
                entries = output.logprobs[output.req_ids.index(req_id)] or []
                assert len(entries) == len(tokens), (
                    f"request {req_id!r}: {len(entries)} logprobs entries for {len(tokens)} tokens"
                )
