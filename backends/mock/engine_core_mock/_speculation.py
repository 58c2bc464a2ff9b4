"""The mock's side of speculative decoding: exact verification, its drafter, their costs.

Verification samples each of a request's ``1 + s`` positions with the mock's own rule (the
token it would decode there, hash-random sampling included) and accepts the longest prefix of
drafts equal to those samples, so outputs are the tokens decoding gives. The drafter
(``engine_core_mock._drafter``) guesses the rule's tokens, right with the configured rates.
"""

from __future__ import annotations

from engine_core.abc import SpecSupport, StepCostModel, TokenLogprobs
from engine_core_mock._blocks import BlockLedger
from engine_core_mock._drafter import Drafter, SpecOptions, request_key
from engine_core_mock._options import Latency
from engine_core_mock._rule import TokenRule
from engine_core_mock._sampling import synthetic_logprobs
from engine_core_mock._state import RequestState

__all__ = ["MockSpeculation"]


class MockSpeculation:
    """Verification and drafting for one mock backend."""

    __slots__ = ("options", "rule", "drafter")

    def __init__(self, options: SpecOptions | None, rule: TokenRule) -> None:
        self.options = options if options is not None else SpecOptions()
        self.rule = rule
        self.drafter = Drafter(self.options, rule.vocab_size)

    def support(self, latency: Latency | None) -> SpecSupport:
        """What the mock offers: exact verification of any drafts and its own ``"mock"``
        proposer, whose drafts need no KV of their own."""
        return SpecSupport(
            proposers=["mock"], exact_verification=True, cost_model=self.cost_model(latency)
        )

    def cost_model(self, latency: Latency | None) -> StepCostModel | None:
        """The latency model's numbers (None without one). ``per_context_token_s`` has no
        place in the model: it is a prior, and the policy measures the rest."""
        if latency is None:
            return None
        draft = self.options.draft_latency
        return StepCostModel(
            step_s=latency.step_s,
            per_token_s=latency.per_token_s,
            draft_step_s=draft.step_s,
            draft_per_token_s=draft.per_token_s,
            parallel_drafting=self.options.parallel_drafting,
        )

    def verify(
        self, state: RequestState, rows: list[list[int]] | None, blocks: BlockLedger
    ) -> tuple[list[int], list[TokenLogprobs] | None]:
        """Verify ``state.drafts`` (``rows``: one grammar row per position): the tokens to
        return, one logprob entry each when asked. The request's computed tokens roll back to
        the accepted ones, and only their blocks are recorded as holding its prefix."""
        start = state.step_start
        tokens, centres = self.rule.verify(state, state.drafts, rows)
        state.drafts = []
        end = start + len(tokens)
        state.num_computed_tokens = end
        block_size = blocks.block_size
        if end // block_size != start // block_size:
            blocks.record_written(state, start, end)
        num_top = state.num_logprobs
        if num_top is None:
            return tokens, None
        vocab_size = self.rule.vocab_size
        return tokens, [
            synthetic_logprobs(t, c, num_top, vocab_size)
            for t, c in zip(tokens, centres, strict=True)
        ]

    def draft_cost(
        self, num_draft_tokens: int, batch: list[RequestState], wanted: set[str] | None
    ) -> float:
        """Seconds drafting adds to a step that asks ``num_draft_tokens`` of the requests of
        ``batch`` that sample (and are ``wanted``)."""
        options = self.options
        latency = options.draft_latency
        if not (latency.step_s or latency.per_token_s):
            return 0.0
        if options.num_tokens is not None:
            num_draft_tokens = min(num_draft_tokens, options.num_tokens)
        num_requests = sum(
            1
            for r in batch
            if (r.drafts or r.num_computed_tokens == len(r.tokens))
            and (wanted is None or r.req_id in wanted)
        )
        return latency.duration(num_draft_tokens, num_requests, options.parallel_drafting)

    def propose(
        self,
        batch: list[RequestState],
        sampled: list[list[int]],
        num_draft_tokens: int,
        wanted: set[str] | None,
    ) -> list[list[int]]:
        """Drafts for the next step, in batch order: for each request that sampled tokens
        (and is ``wanted``), guesses of the tokens after them; else an empty list."""
        drafter = self.drafter
        rule = self.rule
        out: list[list[int]] = []
        for state, new in zip(batch, sampled, strict=True):
            if not new or (wanted is not None and state.req_id not in wanted):
                out.append([])
                continue
            key = state.draft_key
            if key is None:
                key = state.draft_key = request_key(state.req_id)
            out.append(drafter.propose(key, len(state.tokens), num_draft_tokens, rule.after(state)))
        return out
