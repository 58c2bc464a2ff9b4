"""Requests and schedulers for the core's tests (``tests/core``): one ``make_request`` and one
``make_scheduler``. A suite that needs other defaults binds them once
(``functools.partial(make_request, eos_token_ids=(EOS,))``) instead of writing its own."""

from __future__ import annotations

import itertools

from engine_core._core.drafts import DraftPlanner
from engine_core._core.request import Request
from engine_core._core.scheduler import Scheduler, SchedulerConfig
from engine_core.sampling_params import SamplingParams

__all__ = ["BLOCK_SIZE", "make_request", "make_scheduler"]

BLOCK_SIZE = 16
_prompt_serial = itertools.count(1)


def make_request(
    request_id: str = "r",
    prompt: list[int] | None = None,
    *,
    num_tokens: int = 10,
    params: SamplingParams | None = None,
    block_size: int = BLOCK_SIZE,
    arrival_time: float = 0.0,
    priority: int = 0,
    eos_token_ids: tuple[int, ...] = (),
    cache_salt: str | None = None,
    request_max_tokens: int | None = None,
    hash_blocks: bool = True,
    **sampling: object,
) -> Request:
    """A request of ``prompt`` (default: ``num_tokens`` tokens that no other request's prompt
    shares, so prefix caching plays no part unless a test asks for it). Its sampling
    parameters are ``params`` or ``SamplingParams(**sampling)``; ``request_max_tokens`` is the
    engine's cap (``Request``'s own ``max_tokens``)."""
    if prompt is None:
        base = 10_000 * next(_prompt_serial)
        prompt = [base + i for i in range(num_tokens)]
    if params is None:
        params = SamplingParams(**sampling)  # type: ignore[arg-type]
    elif sampling:
        raise TypeError(f"give params or sampling keywords, not both: {sorted(sampling)}")
    return Request(
        request_id,
        prompt,
        params,
        block_size=block_size,
        arrival_time=arrival_time,
        priority=priority,
        eos_token_ids=eos_token_ids,
        cache_salt=cache_salt,
        max_tokens=request_max_tokens,
        hash_blocks=hash_blocks,
    )


def make_scheduler(
    *,
    num_blocks: int = 1000,
    draft_planner: DraftPlanner | None = None,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 8192,
    block_size: int = BLOCK_SIZE,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    enable_prefix_caching: bool = True,
    scheduling_policy: str = "fcfs",
    **knobs: object,
) -> Scheduler:
    """A scheduler of ``num_blocks`` KV blocks (with ``draft_planner``: speculative); ``knobs``
    are further ``SchedulerConfig`` fields."""
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=block_size,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        enable_prefix_caching=enable_prefix_caching,
        scheduling_policy=scheduling_policy,
        **knobs,  # type: ignore[arg-type]
    )
    return Scheduler(config, num_blocks, draft_planner)
