"""A small scripted backend that verifies drafts, for the core's speculative decoding tests.

Its model is a rule: the token after a sequence is a hash of the request's seed, the position
and the last token, mapped into ``[0, 256)`` ("greedy" requests use seed 0), or with
``copy=True`` in its options the prompt read again from the start (outputs that copy the prompt,
where n-gram drafts are right). It verifies drafts exactly: each position is sampled by the same
rule as without drafts, so outputs with and without speculation are identical.

As a proposer (method ``"scripted"``) it drafts the true continuation, each draft right with
probability ``acceptance`` (a stable hash of request, position and draft index), else off by one.

It checks the contract as it goes: ``CachedRequestData.diffs`` (its computed tokens agree with
the scheduler's after every rollback), the drafts' positions and the grammar rows.
"""

from __future__ import annotations

import hashlib
from typing import Any

from engine_core.abc import (
    Backend,
    KVCacheSpec,
    ModelRunnerOutput,
    SchedulerOutput,
    SpecSupport,
    StepCostModel,
    TokenLogprobs,
)
from engine_core.config import EngineConfig

VOCAB = 512


def _hash(*parts: object) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class _State:
    __slots__ = (
        "req_id",
        "tokens",
        "num_prompt",
        "num_computed_tokens",
        "seed",
        "logprobs",
        "constrained",
    )

    def __init__(self, req_id: str, tokens: list[int], seed: int, logprobs: bool) -> None:
        self.constrained = False
        self.req_id = req_id
        self.tokens = tokens
        self.num_prompt = 0
        self.num_computed_tokens = 0
        self.seed = seed
        self.logprobs = logprobs


class ScriptedSpecBackend(Backend):
    """See the module's docs. ``backend_options``: ``spec`` (False: no ``spec_support``),
    ``acceptance`` (of its own drafts), ``copy``, ``cost`` (``[step_s, per_token_s]``),
    ``lookahead_per_draft``."""

    step_in_thread = False

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        options = config.backend_options
        self.options = options
        self.acceptance = float(options.get("acceptance", 0.7))
        self.copy = bool(options.get("copy", False))
        self.states: dict[str, _State] = {}
        self.last: SchedulerOutput | None = None
        self.steps: list[SchedulerOutput] = []
        self.bitmask_rows: list[int] = []
        """Rows of each step's grammar bitmask (0: none)."""
        self.num_drafts_verified = 0

    # -- the contract's plumbing ----------------------------------------------------------------

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(num_layers=1, num_kv_heads=1, head_size=8, dtype_bytes=2)

    def available_kv_cache_memory(self) -> int:
        return 1 << 24

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def vocab_size(self) -> int:
        return VOCAB

    def spec_support(self) -> SpecSupport | None:
        if not self.options.get("spec", True):
            return None
        cost = self.options.get("cost", [5e-3, 5e-5])
        return SpecSupport(
            proposers=["scripted"],
            lookahead_per_draft=int(self.options.get("lookahead_per_draft", 0)),
            cost_model=StepCostModel(step_s=cost[0], per_token_s=cost[1]),
        )

    # -- the model ------------------------------------------------------------------------------

    def next_token(self, state: _State, sequence: list[int]) -> int:
        position = len(sequence)
        if self.copy:
            return sequence[(position - state.num_prompt) % state.num_prompt]
        return _hash(state.seed, position, sequence[-1]) % 256

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.last = scheduler_output
        self.steps.append(scheduler_output)
        for req_id in scheduler_output.finished_req_ids + scheduler_output.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in scheduler_output.new_reqs:
            params = new.sampling_params
            seed = 0 if params.temperature == 0 else (params.seed or 0) + 1
            state = _State(
                new.req_id,
                list(new.prompt_token_ids) + list(new.output_token_ids),
                seed,
                params.logprobs is not None,
            )
            state.num_prompt = len(new.prompt_token_ids)
            state.constrained = params.structured_outputs is not None
            state.num_computed_tokens = new.num_computed_tokens
            self.states[new.req_id] = state
        cached = scheduler_output.cached
        for index, (_, _, computed, num) in enumerate(cached.diffs(self.states)):
            drafts = cached.drafts_of(index)
            if drafts:
                assert num == 1 + len(drafts), "a request with drafts computes 1 + s tokens"
                state = self.states[cached.req_ids[index]]
                assert computed == len(state.tokens) - 1, "drafts follow the last known token"

    def sample_tokens(self, grammar_bitmask: Any | None) -> ModelRunnerOutput:
        out = self.last
        assert out is not None
        self.bitmask_rows.append(0 if grammar_bitmask is None else len(grammar_bitmask))
        row = 0
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        logprobs: list[list[TokenLogprobs] | None] = []
        draft_lists: list[list[int]] = []
        cached = out.cached
        batch = [
            (req_id, cached.num_computed_tokens[i], cached.num_scheduled_tokens[i], i)
            for i, req_id in enumerate(cached.req_ids)
        ] + [(n.req_id, n.num_computed_tokens, n.num_scheduled_tokens, -1) for n in out.new_reqs]
        wanted = set(out.draft_req_ids) if out.draft_req_ids is not None else None
        for req_id, computed, num, index in batch:
            state = self.states[req_id]
            drafts = cached.drafts_of(index) if index >= 0 else []
            end = computed + num - len(drafts)
            req_ids.append(req_id)
            if end < len(state.tokens):  # a partial prefill chunk
                state.num_computed_tokens = end
                sampled.append([])
                logprobs.append(None)
                draft_lists.append([])
                continue
            params_constrained = grammar_bitmask is not None and state.constrained
            tokens: list[int] = []
            sequence = state.tokens
            for j in range(len(drafts) + 1):
                token = self.next_token(state, sequence + tokens)
                if params_constrained:
                    token = _allowed(grammar_bitmask[row], token)
                    row += 1
                tokens.append(token)
                if j == len(drafts) or token != drafts[j]:
                    break
            if params_constrained:
                row += len(drafts) + 1 - len(tokens)
            self.num_drafts_verified += len(drafts)
            state.tokens = sequence + tokens
            state.num_computed_tokens = len(state.tokens) - 1
            sampled.append(tokens)
            logprobs.append(
                [TokenLogprobs([t], [-0.5], [1]) for t in tokens] if state.logprobs else None
            )
            if out.num_draft_tokens and (wanted is None or req_id in wanted):
                draft_lists.append(self._draft(state, out.num_draft_tokens))
            else:
                draft_lists.append([])
        if grammar_bitmask is not None:
            assert row == len(grammar_bitmask), "one bitmask row per verified position"
        return ModelRunnerOutput(
            req_ids,
            sampled,
            logprobs if any(lp is not None for lp in logprobs) else None,
            None,
            draft_lists if out.num_draft_tokens else None,
        )

    def _draft(self, state: _State, num: int) -> list[int]:
        drafts: list[int] = []
        sequence = list(state.tokens)
        for i in range(num):
            token = self.next_token(state, sequence)
            if _hash("draft", state.req_id, len(sequence), i) % 10_000 >= self.acceptance * 10_000:
                token = (token + 1) % 256
            drafts.append(token)
            sequence.append(token)
        return drafts


def _allowed(row: Any, token: int) -> int:
    """``token`` if the bitmask row allows it, else the first allowed token after it."""
    words = [int(w) & 0xFFFFFFFF for w in row]
    for offset in range(VOCAB):
        t = (token + offset) % VOCAB
        if t // 32 < len(words) and words[t // 32] >> (t % 32) & 1:
            return t
    raise AssertionError("a bitmask row allows no token")
