"""Whom recompute preemption evicts: the victim policies of ``EngineConfig.preemption_victim``.

A victim loses its KV blocks and recomputes what it had computed when it is admitted again
(``Scheduler.num_recomputed_tokens`` counts those tokens), so the choice is the price:
``"last_admitted"`` (vLLM's) evicts the latest admitted request whatever it has computed,
``"least_progress"`` the one with the fewest computed tokens. A custom policy is a
:class:`~engine_core.abc.PreemptionVictimPolicy` named ``"module:attribute"``; it is checked
on every call (:class:`CheckedPolicy`), since a wrong answer would corrupt the batch.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from engine_core._core.request import Request, RequestStatus
from engine_core.abc import PreemptionVictimPolicy

__all__ = [
    "CheckedPolicy",
    "LastAdmitted",
    "LeastProgress",
    "VictimPolicyError",
    "make_victim_policy",
]

_RUNNING = RequestStatus.RUNNING


class VictimPolicyError(RuntimeError):
    """A custom victim policy raised or chose a request that is not running (a plugin's bug:
    the engine stops with this error as its cause)."""


class LastAdmitted(PreemptionVictimPolicy):
    """The latest admitted; under ``priority`` the worst priority, then the latest arrival, then
    the latest admitted (vLLM's choice)."""

    def __init__(self, priority: bool = False) -> None:
        self.priority = priority

    def pick(self, running: Sequence[Request], requester: Request) -> Request:
        if self.priority:
            return max(reversed(running), key=lambda r: (r.priority, r.arrival_time))
        return running[-1]


class LeastProgress(PreemptionVictimPolicy):
    """The fewest computed tokens (the least to recompute), then the latest admitted; under
    ``priority`` the worst priority first."""

    def __init__(self, priority: bool = False) -> None:
        self.priority = priority

    def pick(self, running: Sequence[Request], requester: Request) -> Request:
        if self.priority:
            return max(reversed(running), key=lambda r: (r.priority, -r.num_computed_tokens))
        return min(reversed(running), key=lambda r: r.num_computed_tokens)


class CheckedPolicy(PreemptionVictimPolicy):
    """A custom policy, its every answer checked: one that raises or returns a request that is
    not running raises :class:`VictimPolicyError` (from the policy's own error)."""

    def __init__(self, policy: PreemptionVictimPolicy, name: str) -> None:
        self.policy = policy
        self.name = name

    def pick(self, running: Sequence[Request], requester: Request) -> Request:
        try:
            victim = self.policy.pick(running, requester)
        except Exception as exc:
            raise VictimPolicyError(
                f"the preemption victim policy {self.name!r} raised {type(exc).__name__}: {exc}"
            ) from exc
        if (
            not isinstance(victim, Request)
            or victim.status is not _RUNNING
            or not any(r is victim for r in running)
        ):
            what = victim.request_id if isinstance(victim, Request) else repr(victim)
            raise VictimPolicyError(
                f"the preemption victim policy {self.name!r} chose {what}, which is not a "
                "running request"
            )
        return victim


def make_victim_policy(name: str, *, priority: bool = False) -> PreemptionVictimPolicy:
    """The policy ``EngineConfig.preemption_victim`` names. ``ValueError`` naming the field
    when a ``"module:attribute"`` path cannot be imported or is not a policy."""
    if name == "last_admitted":
        return LastAdmitted(priority)
    if name == "least_progress":
        return LeastProgress(priority)
    module_name, _, attribute = name.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"preemption_victim {name!r} cannot be loaded: {exc}") from exc
    policy = target() if callable(target) else target
    if not isinstance(policy, PreemptionVictimPolicy):
        raise ValueError(
            f"preemption_victim {name!r} is not a PreemptionVictimPolicy "
            f"(got {type(policy).__name__})"
        )
    return CheckedPolicy(policy, name)
