"""The admission rules of the scheduler under KV pressure (pure functions of a request and the
cache; ``Scheduler._schedule_waiting`` applies them):

- **never fits**: a request whose tokens need more blocks than one request can ever hold (the
  pool less its reserved blocks, per KV-cache group) is refused with an error naming both
  figures, at arrival and whenever it cannot be allocated (the cache may have shrunk), never
  queued forever;
- **bypass**: when the request at the head of the queue cannot get its blocks, requests behind
  it that fit are admitted, for at most ``max_bypass_steps`` steps; then nothing overtakes it
  until its blocks are free. A request with no fewer tokens to compute than one whose blocks
  were not free is set aside without trying (it cannot fit either; it is not counted as
  overtaken), so a queue front of long prompts does not hide the short ones behind it;
- **partial prefills**: at most ``max_num_partial_prefills`` requests prefill in a step, at most
  ``max_long_partial_prefills`` of them with more than ``long_prefill_token_threshold`` tokens
  left to prefill; a long request past that waits and shorter ones behind it are admitted.
  The short prefill slots hold in blocks too (:func:`short_reserve_tokens`): while other
  requests run, a long prompt is admitted only with blocks for them left free, until it was
  overtaken in ``max_bypass_steps`` steps.
"""

from __future__ import annotations

from engine_core._core.kv_cache_manager import KVCacheManager
from engine_core._core.request import Request
from engine_core.sampling_params import SamplingParams

__all__ = [
    "MAX_BLOCKED_PER_STEP",
    "MAX_SET_ASIDE_PER_STEP",
    "must_generate",
    "never_fits",
    "refusal",
    "short_reserve_tokens",
]

MAX_BLOCKED_PER_STEP = 8
"""Allocations that fail in one step before it stops looking further down the queue (a full
cache must not cost a scan of the whole queue every step). Only a request with fewer tokens to
compute than every one that failed before it is tried, so these are failures of ever smaller
requests."""

MAX_SET_ASIDE_PER_STEP = 128
"""Requests one step sets aside (for any reason) past which it stops setting aside more
untried ones: the bound on a step's scan of a queue that does not fit."""


def short_reserve_tokens(
    max_num_partial_prefills: int, max_long_partial_prefills: int, threshold: int
) -> int:
    """Tokens of free blocks a long prompt (more than ``threshold`` left to prefill) must leave
    for short ones when it is admitted: ``long_prefill_token_threshold`` for each short
    prefill slot the limits keep (``max_num_partial_prefills - max_long_partial_prefills``,
    one when the total is not limited). 0 without the long limit: nothing is reserved.

    The slots exist so that a few long prompts cannot take every prefill from short ones; when
    the cache is what runs out, the short ones would wait for blocks instead, so the slots
    are kept in blocks as well."""
    if not max_long_partial_prefills or threshold <= 0:
        return 0
    if max_num_partial_prefills:
        return max(0, max_num_partial_prefills - max_long_partial_prefills) * threshold
    return threshold


def must_generate(params: SamplingParams, max_tokens: int) -> int:
    """The fewest tokens a request must generate before it can end: ``min_tokens`` (at least
    one), or all ``max_tokens`` when nothing but the length cap can stop it."""
    if (
        params.ignore_eos
        and not params.stop_token_ids
        and not params.stop
        and params.structured_outputs is None
    ):
        return max(1, max_tokens)
    return max(1, params.min_tokens)


def refusal(
    kv: KVCacheManager, num_tokens: int, num_to_generate: int, max_model_len: int
) -> str | None:
    """Why a request of ``num_tokens`` tokens (its prompt, and any output so far) that must
    generate ``num_to_generate`` more can never fit in the cache (both figures named), or None.
    Its KV holds every position but that of the last token it generates."""
    num_positions = min(num_tokens + num_to_generate - 1, max_model_len)
    need = kv.blocks_for_tokens(num_positions)
    usable = kv.num_usable_blocks
    if need <= usable:
        return None
    per_group = kv.describe_need(num_positions)
    reserved = kv.num_reserved_blocks
    return (
        f"the request needs {need} KV-cache blocks of {kv.block_size} tokens"
        + (f" ({per_group})" if per_group else "")
        + f" for its {num_tokens} tokens and the {num_to_generate} it must generate, but one "
        f"request can hold at most {usable} blocks (the cache has {kv.num_blocks}"
        + (f", {reserved} of them pinned or parked" if reserved else "")
        + ")"
    )


def never_fits(kv: KVCacheManager, request: Request, max_model_len: int) -> str | None:
    """:func:`refusal` for a queued or running request: its tokens so far, and those it must
    still generate (at least one)."""
    generated = request.num_output_tokens
    owed = must_generate(request.sampling_params, request.max_tokens) - generated
    num_tokens = len(request.all_token_ids) + request.num_output_placeholders
    return refusal(kv, num_tokens, max(owed, 1), max_model_len)
