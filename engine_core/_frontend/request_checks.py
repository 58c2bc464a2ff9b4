"""What ``generate()`` checks before it does any work for a request or sends anything.

The engine's limits on one request (``EngineConfig.max_n``, ``max_stop_strings``,
``max_stop_string_len``) and the arguments that travel beside the sampling parameters
(``priority``, ``cache_salt``) are checked here, and the parameters are validated again (a
caller may have assigned to their fields since they were built) with the same checks their
decoding runs in the engine. Each failure is a ``ValueError`` or ``TypeError`` naming the
parameter: a limit a request can never meet is a client error (HTTP 400), never a retry.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine_core._core.checks import check_int64, check_text, show
from engine_core.config import EngineConfig
from engine_core.lora import LoRAError, LoRARequest
from engine_core.sampling_params import SamplingParams

__all__ = ["check_params", "check_params_list", "check_request"]


def check_params(config: EngineConfig, params: object) -> SamplingParams:
    """``params``, validated and within ``config``'s limits on one request."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    params.validate()
    if params.n > config.max_n:
        raise ValueError(f"n must be at most {config.max_n} (max_n), got {params.n}")
    stop = params.stop_strings
    if stop:
        if len(stop) > config.max_stop_strings:
            raise ValueError(
                f"stop must hold at most {config.max_stop_strings} strings (max_stop_strings), "
                f"got {len(stop)}"
            )
        longest = max(map(len, stop))
        if longest > config.max_stop_string_len:
            raise ValueError(
                f"stop strings must be at most {config.max_stop_string_len} characters long "
                f"(max_stop_string_len), got one of {longest}"
            )
    return params


def check_params_list(config: EngineConfig, params_list: Iterable[object]) -> None:
    """:func:`check_params` once for each distinct object of ``params_list``."""
    seen: set[int] = set()
    for params in params_list:
        if id(params) not in seen:
            seen.add(id(params))
            check_params(config, params)


def check_request(
    config: EngineConfig, params: object, *, priority: object = 0, cache_salt: object = None
) -> SamplingParams:
    """Check one request's arguments (see the module docstring); returns its parameters."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be an int, got {show(priority)}")
    check_int64("priority", priority)
    if cache_salt is not None:
        if not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {show(cache_salt)}")
        check_text("cache_salt", cache_salt)
    params = check_params(config, params)
    queued = config.max_queued_requests
    if queued is not None and params.n > config.max_num_seqs + queued:
        # The queue's admission would refuse it as retryable every time.
        raise ValueError(
            f"n must be at most {config.max_num_seqs + queued} (max_num_seqs + "
            f"max_queued_requests), got {params.n}"
        )
    return params


def check_lora_request(config: EngineConfig, lora: object, *, required: bool = False) -> None:
    """``TypeError`` unless ``lora`` is a :class:`LoRARequest` (or None when not
    ``required``); :class:`LoRAError` naming it when LoRA is off."""
    if lora is None and not required:
        return
    if not isinstance(lora, LoRARequest):
        raise TypeError(f"lora_request must be a LoRARequest, got {show(lora)}")
    if not config.enable_lora:
        raise LoRAError(
            lora.lora_name, "LoRA is off (start the engine with enable_lora=True, or --enable-lora)"
        )


def check_lora_id(lora_int_id: object) -> int:
    """``lora_int_id`` checked: an int >= 1."""
    if not isinstance(lora_int_id, int) or isinstance(lora_int_id, bool) or lora_int_id < 1:
        raise ValueError(f"lora_int_id must be an int >= 1, got {lora_int_id!r}")
    return lora_int_id
