"""How many drafts to verify: the dynamic speculation policy.

Each step it picks one draft count ``k`` for the step from the allowed ones, and a threshold of
acceptance below which a request gets no drafts, to maximise the expected tokens per second::

    rate = (B + sum over drafted requests r of G_r(k)) / (a + b * (B + k * |drafted|) + drafting)
    G_r(k) = alpha_r + alpha_r**2 + ... + alpha_r**k    (expected extra tokens, geometric)

where ``B`` is the number of decoding requests, ``a`` and ``b`` the step cost's fixed and
per-token parts (the backend's :class:`~engine_core.abc.StepCostModel`) and ``alpha_r`` a
request's estimated conditional acceptance. With one acceptance for all, ``k = 1`` pays while
``B < (a / b) * alpha / (1 - alpha)``: speculation switches itself off as the batch grows and
back on as it shrinks, with no batch-size table. A request is drafted when its own gain per
second of verification beats the step's rate (``G_r(k) / cost(k) > rate``), solved by a few
rounds of Dinkelbach's iteration over requests grouped by acceptance.

Acceptance is estimated from decayed counts of verified drafts, per request and overall (each
request drawn towards the overall estimate by as much as its own count is noise), and
also while nothing is verified: the extra draft past the verified ones is scored against the
token sampled after them, and requests left undrafted are probed (their proposal scored
against the tokens that actually follow, "shadow scoring").

Pure arithmetic: no engine state.
"""

from __future__ import annotations

__all__ = ["Acceptance", "CostModel", "SpecPolicy"]

_BUCKETS = 16
"""Acceptance is grouped into this many equal ranges for the choice (a request's own estimate
still decides whether it is drafted)."""

_HYSTERESIS = 1.02
"""The step's draft count changes only for a predicted gain of 2 % or more."""


class Acceptance:
    """A decayed estimate of conditional acceptance (the chance a draft is right given that the
    drafts before it were): ``accepted / (accepted + rejected)`` over the recent drafts, drawn
    towards a prior while few were seen."""

    __slots__ = ("accepted", "rejected", "decay")

    def __init__(self, decay: float) -> None:
        self.accepted = 0.0
        self.rejected = 0.0
        self.decay = decay

    def observe(self, num_accepted: int, rejected: bool) -> None:
        """One run of drafts: ``num_accepted`` right in a row, then one wrong (``rejected``) or
        none (all right)."""
        decay = self.decay
        self.accepted = self.accepted * decay + num_accepted
        self.rejected = self.rejected * decay + rejected

    def estimate(self, prior: float, strength: float) -> float:
        accepted, rejected = self.accepted, self.rejected
        return (accepted + prior * strength) / (accepted + rejected + strength)


class CostModel:
    """Seconds per step: ``step_s + per_token_s * tokens`` for the target model, and per draft
    pass ``draft_step_s + draft_per_token_s * drafted requests`` (one pass per draft, or one
    for all with ``parallel_drafting``), plus ``propose_s`` of host time per drafted request."""

    __slots__ = (
        "step_s",
        "per_token_s",
        "draft_step_s",
        "draft_per_token_s",
        "parallel_drafting",
        "propose_s",
        "_sums",
    )

    def __init__(
        self,
        step_s: float,
        per_token_s: float,
        *,
        draft_step_s: float = 0.0,
        draft_per_token_s: float = 0.0,
        parallel_drafting: bool = False,
        propose_s: float = 0.0,
    ) -> None:
        if not (step_s > 0 and per_token_s >= 0):
            raise ValueError(f"need step_s > 0 and per_token_s >= 0, got {step_s}, {per_token_s}")
        self.step_s = step_s
        self.per_token_s = per_token_s
        self.draft_step_s = draft_step_s
        self.draft_per_token_s = draft_per_token_s
        self.parallel_drafting = parallel_drafting
        self.propose_s = propose_s
        self._sums: list[float] | None = None

    def observe(self, num_tokens: int, seconds: float, decay: float = 0.99) -> None:
        """Refine ``step_s`` and ``per_token_s`` from a measured step: a least-squares line
        through the recent steps' (tokens, seconds), decayed, starting from the prior as two
        pseudo-steps (1 and 256 tokens). The fit is kept only while it is a cost (a fixed part
        > 0, a per-token part >= 0)."""
        sums = self._sums
        if sums is None:
            sums = self._sums = [0.0] * 5
            for x in (1.0, 256.0):
                self._add(sums, x, self.step_s + self.per_token_s * x, 1.0)
        for i in range(5):
            sums[i] *= decay
        self._add(sums, float(num_tokens), seconds, 1.0)
        weight, sum_x, sum_xx, sum_y, sum_xy = sums
        det = weight * sum_xx - sum_x * sum_x
        if det <= 1e-12 * weight * sum_xx:
            return
        per_token_s = (weight * sum_xy - sum_x * sum_y) / det
        step_s = (sum_y - per_token_s * sum_x) / weight
        if step_s > 0 and per_token_s >= 0:
            self.step_s, self.per_token_s = step_s, per_token_s

    @staticmethod
    def _add(sums: list[float], x: float, y: float, w: float) -> None:
        sums[0] += w
        sums[1] += w * x
        sums[2] += w * x * x
        sums[3] += w * y
        sums[4] += w * x * y

    def passes(self, k: int) -> int:
        return 1 if self.parallel_drafting else k

    def fixed_s(self, k: int) -> float:
        """The cost of drafting at all in a step (its draft passes' fixed part)."""
        return self.passes(k) * self.draft_step_s if k else 0.0

    def per_request_s(self, k: int) -> float:
        """What drafting ``k`` tokens for one more request adds to a step."""
        return k * self.per_token_s + self.passes(k) * self.draft_per_token_s + self.propose_s


class SpecPolicy:
    """Chooses each step's draft count and which requests get drafts."""

    def __init__(
        self,
        k_choices: list[int],
        cost: CostModel,
        *,
        dynamic: bool = True,
        prior: float = 0.6,
        strength: float = 4.0,
        request_decay: float = 0.9,
        global_decay: float = 0.98,
    ) -> None:
        self.k_choices = sorted(set(k_choices) | {0})
        self.k_max = self.k_choices[-1]
        self.cost = cost
        self.dynamic = dynamic
        self.prior = prior
        self.strength = strength
        self.request_decay = request_decay
        self.overall = Acceptance(global_decay)
        """Acceptance over all requests: the prior of each request's own estimate."""
        self.k = self.k_max if not dynamic else 0
        """The draft count of the last step decided."""
        self.threshold = 0.0
        """The lowest acceptance estimate drafted in the last step decided."""
        self.predicted_speedup = 1.0
        """The last decision's predicted rate over not speculating."""
        # gains[k][j]: expected extra tokens of k drafts at the acceptance of bucket j's middle.
        self._gains = [
            [sum(((j + 0.5) / _BUCKETS) ** i for i in range(1, k + 1)) for j in range(_BUCKETS)]
            for k in range(self.k_max + 1)
        ]

    def new_acceptance(self) -> Acceptance:
        """A request's own estimate."""
        return Acceptance(self.request_decay)

    def estimate(self, acceptance: Acceptance) -> float:
        """A request's acceptance, drawn towards the overall one while it has few drafts."""
        return acceptance.estimate(self.overall_estimate(), self.strength)

    def shrunk(self, acceptances: list[Acceptance]) -> list[float]:
        """The requests' acceptance estimates, each drawn towards the overall one by as much
        as its own count is noise (empirical Bayes): the spread of the requests' measured
        rates beyond what sampling alone explains is real, the rest is luck. Requests that all
        draft alike then share one estimate, and a run of bad luck leaves none undrafted;
        requests that differ (prompt lookup on copying and on free text) keep theirs."""
        overall = self.overall_estimate()
        noise = overall * (1.0 - overall)
        rates: list[tuple[float, float]] = []
        spread = 0.0
        sampling = 0.0
        for acceptance in acceptances:
            num = acceptance.accepted + acceptance.rejected
            if num > 0:
                rate = acceptance.accepted / num
                rates.append((rate, num))
                spread += (rate - overall) ** 2
                sampling += noise / num
        if not rates:
            return [overall] * len(acceptances)
        # Twice the sampling noise: the normal approximation understates how far short runs
        # of geometric trials spread.
        between = max(0.0, (spread - 2.0 * sampling) / len(rates))
        estimates = []
        for acceptance in acceptances:
            num = acceptance.accepted + acceptance.rejected
            if num <= 0 or between == 0.0:
                estimates.append(overall)
                continue
            rate = acceptance.accepted / num
            variance = noise / num
            estimates.append(overall + (rate - overall) * between / (between + variance))
        return estimates

    def overall_estimate(self) -> float:
        return self.overall.estimate(self.prior, self.strength)

    def observe(self, acceptance: Acceptance, num_accepted: int, rejected: bool) -> None:
        """A run of drafts of one request: its estimate and the overall one."""
        acceptance.observe(num_accepted, rejected)
        self.overall.observe(num_accepted, rejected)

    def decide(self, estimates: list[float], max_k: int) -> tuple[int, float]:
        """The draft count for a step whose decoding requests have these acceptance estimates
        (``max_k``: the most the token budget allows), and the lowest estimate to draft. With
        ``dynamic`` off: the largest allowed count, and every request drafted."""
        choices = [k for k in self.k_choices if k <= max_k] or [0]
        if not self.dynamic:
            self.k, self.threshold = choices[-1], 0.0
            return self.k, 0.0
        num = len(estimates)
        if num == 0:
            return self.k, self.threshold
        counts = [0] * _BUCKETS
        for alpha in estimates:
            j = int(alpha * _BUCKETS)
            counts[j if j < _BUCKETS else _BUCKETS - 1] += 1
        cost = self.cost
        base_s = cost.step_s + cost.per_token_s * num
        base_rate = num / base_s
        rates: dict[int, tuple[float, int]] = {0: (base_rate, _BUCKETS)}
        for k in choices:
            if k:
                rate, first_bucket = self._best(counts, k, num, base_s, base_rate)
                if first_bucket < _BUCKETS:  # else nobody is drafted: that is k = 0
                    rates[k] = (rate, first_bucket)
        best = max(rates, key=lambda k: rates[k][0])
        if self.k in rates and rates[self.k][0] * _HYSTERESIS >= rates[best][0]:
            best = self.k  # not worth a change
        rate, first_bucket = rates[best]
        self.k = best
        self.threshold = first_bucket / _BUCKETS if best else 1.0
        self.predicted_speedup = rate / base_rate
        return self.k, self.threshold

    def _best(
        self, counts: list[int], k: int, num: int, base_s: float, base_rate: float
    ) -> tuple[float, int]:
        """The rate with ``k`` drafts for the requests of the best buckets, and the first
        drafted bucket (``_BUCKETS``: none)."""
        gains = self._gains[k]
        per_request_s = self.cost.per_request_s(k)
        fixed_s = self.cost.fixed_s(k)
        rate, first = base_rate, _BUCKETS
        for _ in range(4):
            # Dinkelbach: draft the buckets whose gain per second beats the current rate.
            cut = _BUCKETS
            while cut > 0 and gains[cut - 1] > rate * per_request_s:
                cut -= 1
            drafted = sum(counts[cut:])
            if not drafted:
                break
            tokens = num + sum(c * g for c, g in zip(counts[cut:], gains[cut:], strict=True))
            new_rate = tokens / (base_s + fixed_s + drafted * per_request_s)
            if new_rate <= rate:
                break
            rate, first = new_rate, cut
        return rate, first
