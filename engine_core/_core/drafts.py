"""Speculative decoding on the scheduler's side: where drafts come from, how many each request
verifies, the check of what a backend returns, and the counters.

:class:`DraftPlanner` plans and checks drafts (it decodes nothing: the backend verifies them).
The scheduler calls it at these points of a step, and reads nothing else of it:

1. scheduling: :meth:`~DraftPlanner.plan` before it serves the running requests (the policy's
   draft count for the step); :meth:`~DraftPlanner.tokens_for` for each decoding request (the
   tokens and KV slots it takes: its drafts, within the cap the scheduler computes, and the
   slots a backend's drafter writes ahead); :meth:`~DraftPlanner.sampling` for each request
   that samples a token in the step; :meth:`~DraftPlanner.unscheduled` for one preempted;
   :meth:`~DraftPlanner.finish_plan` once the batch is known (what goes into the step's output:
   :class:`StepDrafts`);
2. applying the results: :meth:`~DraftPlanner.verify_step` for each request that got tokens
   (the output check; returns how many positions to roll back) and
   :meth:`~DraftPlanner.after_tokens` once they are appended (scoring, and a backend proposer's
   drafts for the next step).

Drafts never enter ``Request.all_token_ids`` nor its block keys: only verified tokens do, so
only verified tokens are ever prefix-cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

from engine_core._core.spec_policy import Acceptance, CostModel, SpecPolicy
from engine_core.errors import BackendError
from engine_core.ngram import NgramIndex, NgramProposer

if TYPE_CHECKING:
    from engine_core._core.request import Request
    from engine_core.abc import SpecSupport
    from engine_core.config import SpeculativeConfig

__all__ = ["DraftPlanner", "DraftState", "Proposer", "SpecStats", "StepDrafts", "check_verified"]

PROBE_PERIOD = 32
"""A request left undrafted is probed (its proposal scored against the tokens that follow)
once every this many steps (staggered: a 32nd of them per step)."""

DEFAULT_STEP_S, DEFAULT_PER_TOKEN_S = 5e-3, 5e-5
"""The step cost assumed for a backend that gives none (a small model on a GPU), until the
measured steps refine it."""

NGRAM_PROPOSE_S = 5e-6
"""Host time of one n-gram proposal, for the policy."""


class Proposer(Protocol):
    """What proposes drafts in the core (:class:`~engine_core.ngram.NgramProposer`; the
    conformance checks script theirs)."""

    def propose(
        self, token_ids: Sequence[int], k: int, index: NgramIndex | None = None
    ) -> list[int]: ...


class DraftState:
    """One request's speculative state (``Request.drafting``)."""

    __slots__ = (
        "drafts",
        "drafts_at",
        "scheduled",
        "extra",
        "index",
        "acceptance",
        "alpha",
        "probe_in",
        "probing",
        "shadow",
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
    )

    def __init__(self, acceptance: Acceptance, probe_in: int) -> None:
        self.drafts: list[int] = []
        """Drafts a backend proposer returned for the request's next step."""
        self.drafts_at = -1
        """The sequence length ``drafts`` continue (they are stale at any other)."""
        self.scheduled: list[int] = []
        """The drafts it verifies in the step scheduled (empty: none)."""
        self.extra: int | None = None
        """The draft past the scheduled ones, scored against the token sampled after them."""
        self.index: NgramIndex | None = None
        self.acceptance = acceptance
        self.alpha: float | None = None
        """The acceptance estimate of the step scheduled (None: the overall one)."""
        self.probe_in = probe_in
        """Steps until its next probe while undrafted (staggered over requests)."""
        self.probing = False
        """A backend proposer drafts for it this step, for shadow scoring only."""
        self.shadow: list[int] = []
        """A proposal not verified, scored against the tokens that follow."""
        self.num_drafts = 0
        """Steps in which it verified drafts."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0


class SpecStats:
    """Counters since the engine started (vLLM's names where they exist)."""

    __slots__ = (
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "accepted_per_pos",
        "drafted_per_pos",
        "steps_by_k",
        "shadow_drafts",
        "shadow_accepted",
    )

    def __init__(self, k_max: int) -> None:
        self.num_drafts = 0
        """Verifications: (request, step) pairs with at least one draft."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k_max
        """Drafts accepted at each position (0-based)."""
        self.drafted_per_pos = [0] * k_max
        """Drafts verified at each position."""
        self.steps_by_k: dict[int, int] = {}
        """Steps by the draft count the policy chose (0: not speculating)."""
        self.shadow_drafts = 0
        """Drafts scored without being verified (the extra draft, probes)."""
        self.shadow_accepted = 0


def check_verified(request_id: str, drafts: list[int], tokens: list[int]) -> int:
    """How many of ``drafts`` a backend accepted, returning ``tokens`` for them; raises
    :class:`BackendError` when no verifier could return ``tokens``: more than one token past
    the drafts, a token that differs from its draft before the last one, or a last token equal
    to the draft it replaces (it would have been accepted)."""
    num_accepted = len(tokens) - 1
    if not 0 <= num_accepted <= len(drafts):
        raise BackendError(
            f"request {request_id!r}: the backend returned {len(tokens)} tokens for "
            f"{len(drafts)} drafts (a verifier returns 1 to {len(drafts) + 1})"
        )
    if tokens[:num_accepted] != drafts[:num_accepted] or (
        num_accepted < len(drafts) and tokens[num_accepted] == drafts[num_accepted]
    ):
        raise BackendError(
            f"request {request_id!r}: the backend returned {tokens} for drafts {drafts}; a "
            "verifier returns the accepted drafts, then one token that differs from the next "
            "draft"
        )
    return num_accepted


class StepDrafts(NamedTuple):
    """What a step's output carries of drafts (``SchedulerOutput``'s fields)."""

    spec_token_ids: list[list[int]] | None
    """The drafts each running request of the batch verifies (None: none does)."""
    num_draft_tokens: int
    """Backend proposers: the drafts to ask for after the step."""
    draft_req_ids: list[str]
    """Backend proposers: the requests to draft for after the step."""


class DraftPlanner:
    """The scheduler's speculative decoding: drafts, the policy and the counters."""

    def __init__(self, config: SpeculativeConfig, support: SpecSupport) -> None:
        self.config = config
        self.support = support
        self.k_max = config.num_speculative_tokens
        self.in_core = config.proposed_in_core
        self.proposer: Proposer | None = (
            NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
            if self.in_core
            else None
        )
        prior = support.cost_model
        cost = (
            CostModel(
                prior.step_s,
                prior.per_token_s,
                draft_step_s=prior.draft_step_s,
                draft_per_token_s=prior.draft_per_token_s,
                parallel_drafting=prior.parallel_drafting,
                propose_s=NGRAM_PROPOSE_S if self.in_core else 0.0,
            )
            if prior is not None and prior.step_s > 0
            else CostModel(
                DEFAULT_STEP_S,
                DEFAULT_PER_TOKEN_S,
                propose_s=NGRAM_PROPOSE_S if self.in_core else 0.0,
            )
        )
        self.policy = SpecPolicy(config.k_choices, cost, dynamic=config.dynamic)
        self.measures_cost = prior is None or prior.step_s <= 0
        """The backend gave no step cost: it is fitted to the measured steps."""
        self.stats = SpecStats(self.k_max)
        self.k = 0
        """The step's draft count (0: nothing is verified)."""
        self.threshold = 1.0
        """The step's lowest acceptance estimate that gets drafts."""
        self.num_draft_tokens = 0
        """Backend proposers: the drafts to ask for after the step."""
        self.draft_req_ids: list[str] = []
        """Backend proposers: the requests to draft for after the step."""
        self.num_drafted = 0
        """Requests of the step being scheduled that verify drafts."""
        self._pending: list[Request] | None = None
        """Requests that sample in a step that has no decoding request yet to decide from."""
        self._num_states = 0

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step computed ``num_tokens`` tokens in ``seconds`` (refines a measured cost)."""
        if self.measures_cost and num_tokens > 0 and seconds > 0:
            self.policy.cost.observe(num_tokens, seconds)

    def state(self, request: Request) -> DraftState:
        spec = request.drafting
        if spec is None:
            self._num_states += 1
            probe_in = 1 + self._num_states % PROBE_PERIOD
            spec = request.drafting = DraftState(self.policy.new_acceptance(), probe_in)
        return spec

    def _drafted(self, spec: DraftState) -> bool:
        """Whether a request gets drafts in the step planned."""
        if self.k == 0:
            return False
        alpha = spec.alpha if spec.alpha is not None else self.policy.overall_estimate()
        return alpha >= self.threshold

    # -- scheduling -----------------------------------------------------------------------------

    def plan(self, running: list[Request], budget: int) -> None:
        """Choose the step's draft count from the decoding requests among ``running`` and
        their acceptance estimates."""
        policy = self.policy
        decoding = [
            request
            for request in running
            if request.num_computed_tokens + 1 == len(request.all_token_ids)
        ]
        states = [self.state(request) for request in decoding]
        estimates = policy.shrunk([spec.acceptance for spec in states])
        for spec, alpha in zip(states, estimates, strict=True):
            spec.alpha = alpha
        self.num_draft_tokens = 0
        self.draft_req_ids = []
        self.num_drafted = 0
        self._pending = None
        if not estimates:
            # Nobody decodes: decide once the step's admissions are known (finish_plan),
            # from the requests that sample.
            self.k, self.threshold = 0, 1.0
            self._pending = []
            return
        self.k, self.threshold = policy.decide(estimates, budget // len(estimates) - 1)
        # Requests left undrafted are probed now and then (the scheduler asks drafts_for
        # only while the step verifies drafts).
        for request, spec in zip(decoding, states, strict=True):
            if self._drafted(spec):
                continue
            spec.probe_in -= 1
            if spec.probe_in <= 0 and not spec.shadow:
                spec.probe_in = PROBE_PERIOD
                self._probe(request, spec)

    def finish_plan(self, scheduled: list[Request], running: list[Request]) -> StepDrafts:
        """The step is scheduled (``scheduled``: its batch, ``running`` first): count it by its
        draft count, and return what its output carries of drafts. A step in which nobody
        decoded decides now, from the requests that sample a token in it, whose drafts a
        backend proposer makes for the next step."""
        pending, self._pending = self._pending, None
        if pending:
            policy = self.policy
            self.k, self.threshold = policy.decide(
                [policy.overall_estimate()] * len(pending), self.k_max
            )
            for request in pending:
                self.sampling(request)
        if self.draft_req_ids:
            # Probes of requests the budget then left out of the step are not asked for.
            in_batch = {r.request_id for r in scheduled}
            self.draft_req_ids = [i for i in self.draft_req_ids if i in in_batch]
        steps = self.stats.steps_by_k
        steps[self.k] = steps.get(self.k, 0) + 1
        spec_token_ids = (
            [r.drafting.scheduled if r.drafting is not None else [] for r in running]
            if self.num_drafted
            else None
        )
        return StepDrafts(spec_token_ids, self.num_draft_tokens, self.draft_req_ids)

    def tokens_for(self, request: Request, cap: int) -> tuple[int, int]:
        """A decoding request's tokens and KV slots this step: its next token and the drafts it
        verifies (at most the step's draft count, and ``cap`` tokens in all), plus the slots a
        backend proposer's drafter writes ahead when it drafts for the request (drafted or
        probed)."""
        drafts = self.drafts_for(request, cap - 1) if self.k else []
        if drafts:
            self.num_drafted += 1
            return 1 + len(drafts), 1 + len(drafts) + self.lookahead()
        return 1, 1 + self.lookahead() if self.asks_drafts(request) else 1

    def drafts_for(self, request: Request, cap: int) -> list[int]:
        """The drafts ``request`` verifies this step (at most ``cap``; it decodes), set as its
        scheduled drafts; an empty list when it gets none (it may be probed instead)."""
        spec = self.state(request)
        k = self.k if cap > self.k else cap
        if k <= 0 or not self._drafted(spec):
            spec.scheduled = []
            return []
        if self.in_core:
            proposal = self._propose(request, spec, k + 1)
        else:
            proposal = spec.drafts if spec.drafts_at == len(request.all_token_ids) else []
            spec.drafts = []
        drafts = proposal[:k]
        grammar = request.grammar
        if drafts and grammar is not None:
            drafts = drafts[: grammar.validate_tokens(drafts)]
        spec.extra = proposal[k] if len(proposal) > k and len(drafts) == k else None
        spec.scheduled = drafts
        if not drafts and self.in_core:
            # Nothing to propose: count it against the request, so that requests whose
            # proposals keep coming up empty stop costing proposals.
            self.policy.observe(spec.acceptance, 0, True)
        return drafts

    def _propose(self, request: Request, spec: DraftState, k: int) -> list[int]:
        assert self.proposer is not None
        if spec.index is None:
            spec.index = NgramIndex()
        return self.proposer.propose(request.all_token_ids, k, spec.index)

    def _probe(self, request: Request, spec: DraftState) -> None:
        if self.in_core:
            spec.shadow = self._propose(request, spec, self.k_max)
        else:
            spec.probing = True
            # As many as the drafted requests are asked for, if any (one count per step).
            self._ask_drafts(request, self.k + 1 if self.k else self.k_max)

    def sampling(self, request: Request) -> None:
        """``request`` samples a token this step: a backend proposer drafts for its next step
        when it would get drafts."""
        if self._pending is not None:
            self._pending.append(request)
            return
        if self.in_core or self.k == 0:
            return
        spec = self.state(request)
        if not spec.probing and self._drafted(spec):
            self._ask_drafts(request, self.k + 1)

    def _ask_drafts(self, request: Request, num: int) -> None:
        if num > self.num_draft_tokens:
            self.num_draft_tokens = num
        self.draft_req_ids.append(request.request_id)

    def asks_drafts(self, request: Request) -> bool:
        """Whether a backend proposer drafts for ``request`` after this step (drafted or
        probed)."""
        spec = request.drafting
        if self.in_core or spec is None:
            return False
        return spec.probing or (self.k > 0 and self._drafted(spec))

    def lookahead(self) -> int:
        """KV slots to reserve past the scheduled positions of a request a backend proposer
        drafts for this step (drafted or probed): for the drafts asked of it."""
        if self.in_core:
            return 0
        return self.support.lookahead_tokens(self.k + 1 if self.k else self.k_max)

    def unscheduled(self, request: Request) -> None:
        """``request`` left the step or was preempted: its drafts are dropped."""
        spec = request.drafting
        if spec is not None:
            if spec.scheduled:
                self.num_drafted -= 1
            ids = self.draft_req_ids
            if ids and request.request_id in ids:
                ids.remove(request.request_id)
            spec.scheduled = []
            spec.drafts = []
            spec.extra = None
            spec.shadow = []
            spec.probing = False

    # -- applying a step's results --------------------------------------------------------------

    def verify_step(self, request: Request, tokens: list[int]) -> int:
        """The positions to roll back after ``request`` got ``tokens`` from a step: its rejected
        drafts (:meth:`verified`), 0 when it verified none; ``BackendError`` for several tokens
        without drafts."""
        spec = request.drafting
        if spec is not None and spec.scheduled:
            return self.verified(request, tokens)
        if len(tokens) != 1:
            raise BackendError(
                f"request {request.request_id!r}: the backend returned {len(tokens)} "
                "tokens for a step without drafts"
            )
        return 0

    def verified(self, request: Request, tokens: list[int]) -> int:
        """Check ``tokens`` against ``request``'s scheduled drafts and count them; returns the
        drafts rejected (the positions to roll back)."""
        spec = request.drafting
        assert spec is not None
        drafts = spec.scheduled
        num_accepted = check_verified(request.request_id, drafts, tokens)
        num_drafts = len(drafts)
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        drafted = stats.drafted_per_pos
        accepted = stats.accepted_per_pos
        for pos in range(num_drafts):
            drafted[pos] += 1
            if pos < num_accepted:
                accepted[pos] += 1
        spec.num_drafts += 1
        spec.num_draft_tokens += num_drafts
        spec.num_accepted_tokens += num_accepted
        all_accepted = num_accepted == num_drafts
        if all_accepted and spec.extra is not None:
            # The bonus token scores the draft past the verified ones, at no cost.
            right = tokens[-1] == spec.extra
            stats.shadow_drafts += 1
            stats.shadow_accepted += right
            self.policy.observe(spec.acceptance, num_accepted + right, not right)
        else:
            self.policy.observe(spec.acceptance, num_accepted, not all_accepted)
        spec.scheduled = []
        spec.extra = None
        return num_drafts - num_accepted

    def after_tokens(self, request: Request, tokens: list[int], drafts: list[int] | None) -> None:
        """``request`` appended ``tokens`` (it goes on); ``drafts``: a backend proposer's for its
        next step."""
        spec = request.drafting
        if spec is None or not (drafts or spec.shadow or spec.probing):
            return
        if spec.shadow:
            self._score_shadow(spec, tokens)
        if spec.probing:
            spec.probing = False
            spec.shadow = list(drafts or ())
        elif drafts:
            spec.drafts = list(drafts)
            spec.drafts_at = len(request.all_token_ids)

    def _score_shadow(self, spec: DraftState, tokens: list[int]) -> None:
        shadow = spec.shadow
        matched = 0
        for token, draft in zip(tokens, shadow, strict=False):
            if token != draft:
                break
            matched += 1
        stats = self.stats
        if matched == len(tokens) and matched < len(shadow):
            spec.shadow = shadow[matched:]  # right so far: score the rest with the next tokens
            stats.shadow_drafts += matched
            stats.shadow_accepted += matched
            self.policy.observe(spec.acceptance, matched, False)
            return
        rejected = matched < len(shadow)
        stats.shadow_drafts += matched + rejected
        stats.shadow_accepted += matched
        self.policy.observe(spec.acceptance, matched, rejected)
        spec.shadow = []
