"""Startup resolution: what the engine core settles once, from the config and the loaded
backend, before its first step.

- :func:`resolve_spec_support`: the backend's speculative-decoding capability, checked against
  what ``speculative_config`` asks;
- :func:`resolve_async_scheduling`: whether one step stays in flight while the next is scheduled;
- :func:`kv_layout_of`: the KV-cache groups of the backend's layers (``docs/kv_cache_groups.md``);
- :func:`size_kv_cache`: how many KV blocks fit (or the ``num_kv_blocks`` override), and the
  ``max_model_len`` they hold, per group.

Pure functions of the config and the backend's reports: no event loop, no sockets.
"""

from __future__ import annotations

import logging

import msgspec

from engine_core._core.kv_groups import KVLayout, plan_kv_layout
from engine_core.abc import Backend, SpecSupport
from engine_core.config import EngineConfig
from engine_core.errors import BackendError
from engine_core.kv_connector import KVConnectorLayout, KVConnectorScheduler, load_kv_connector

__all__ = ["kv_layout_of", "resolve_async_scheduling", "resolve_spec_support", "size_kv_cache"]

logger = logging.getLogger(__name__)


def resolve_async_scheduling(config: EngineConfig, backend: Backend) -> bool:
    """Whether the engine schedules asynchronously: ``config.async_scheduling``, or when None
    whether the backend supports it and its step waits on a device (``step_in_thread``: a step
    that holds the GIL throughout leaves nothing to overlap, and a step in flight would only
    delay its outputs); ``ValueError`` when asked of a backend that does not support it."""
    if config.speculative_config is not None:
        return False  # speculative decoding schedules synchronously (True fails in EngineConfig)
    supported = bool(getattr(backend, "supports_async_scheduling", False))
    if config.async_scheduling is None:
        return supported and backend.step_in_thread
    if config.async_scheduling and not supported:
        raise ValueError(
            f"async_scheduling=True but the {type(backend).__name__} backend does not support "
            "it (leave it None to use it where supported)"
        )
    return config.async_scheduling


def resolve_spec_support(config: EngineConfig, backend: Backend) -> SpecSupport | None:
    """The backend's speculative-decoding capability when ``config`` asks for speculation (else
    None); ``ValueError`` naming the backend when it cannot verify drafts, does not propose
    drafts of the asked method, or verifies fewer drafts than asked."""
    spec = config.speculative_config
    if spec is None:
        return None
    name = f"the {config.backend!r} backend ({type(backend).__name__})"
    support = backend.spec_support()
    if support is None:
        raise ValueError(
            f"speculative_config is set but {name} cannot verify drafts "
            "(Backend.spec_support() is None); remove speculative_config or use a backend "
            "that supports speculative decoding"
        )
    if not spec.proposed_in_core and spec.method not in support.proposers:
        offered = ", ".join(["ngram", *support.proposers])
        raise ValueError(
            f"speculative method {spec.method!r} is not offered by {name}; it offers: {offered}"
        )
    if (
        support.max_num_draft_tokens is not None
        and spec.num_speculative_tokens > support.max_num_draft_tokens
    ):
        raise ValueError(
            f"num_speculative_tokens ({spec.num_speculative_tokens}) exceeds what {name} "
            f"verifies in one step ({support.max_num_draft_tokens})"
        )
    return support


def _blocks_in_kv_memory(backend: Backend, page_size_bytes: int) -> int:
    """The blocks that fit the KV memory the backend has left after the model."""
    memory = backend.available_kv_cache_memory()
    if memory <= 0:
        raise BackendError(
            f"no memory is left for the KV cache ({memory} bytes available after the model)"
        )
    num_blocks = memory // page_size_bytes
    if num_blocks <= 0:
        raise BackendError(f"the KV cache memory ({memory} bytes) does not hold one block")
    return num_blocks


def kv_layout_of(config: EngineConfig, backend: Backend) -> KVLayout:
    """The KV-cache groups of the backend's layers (``ValueError`` naming the layer and the
    field for inconsistent specs)."""
    return plan_kv_layout(backend.kv_cache_spec(), config.block_size)


def size_kv_cache(
    config: EngineConfig, backend: Backend, layout: KVLayout | None = None
) -> tuple[int, EngineConfig]:
    """The number of KV blocks (``num_kv_blocks`` when set, else what fits the backend's KV
    memory) and the resolved config. A ``max_model_len`` left unset is lowered to what the KV
    cache holds; one set explicitly must fit (``ValueError`` otherwise). With KV-cache groups a
    request needs, per window group, only the blocks its window sees."""
    if layout is None:
        layout = kv_layout_of(config, backend)
    resolved = config.resolved(model_max_len=backend.max_model_len())
    num_blocks = resolved.num_kv_blocks
    if num_blocks is None:
        num_blocks = _blocks_in_kv_memory(backend, layout.page_size_bytes)
    block_size = resolved.block_size
    max_model_len = resolved.max_model_len
    assert max_model_len is not None and resolved.max_num_batched_tokens is not None
    step = resolved.max_num_batched_tokens
    if layout.is_one_full_group:
        capacity: int | None = num_blocks * block_size
    else:
        capacity = layout.max_tokens_in(num_blocks, step, block_size)
    if config.max_model_len is None and capacity is not None and capacity < max_model_len:
        logger.info("max_model_len lowered to %d: the KV cache holds no more", capacity)
        max_model_len = capacity
        resolved = msgspec.structs.replace(resolved, max_model_len=max_model_len)
    needed = layout.blocks_needed(max_model_len, step, block_size)
    if num_blocks < needed:
        groups = (
            "" if layout.is_one_full_group else f" in its KV-cache groups ({layout.describe()})"
        )
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks ({capacity} tokens) but one request of "
            f"max_model_len={max_model_len} needs {needed}{groups}; lower max_model_len to "
            f"{capacity} or below, or give the KV cache more blocks"
        )
    return num_blocks, resolved


def setup_kv_connector(
    config: EngineConfig, backend: Backend, kv_layout: KVLayout, num_blocks: int
) -> KVConnectorScheduler | None:
    """The KV connector's scheduler half, once the backend set up its worker half (None: no
    connector). ``ValueError`` naming the setting for a connector that cannot run here."""
    name = config.kv_connector_name
    if name is None:
        return None
    if not config.enable_prefix_caching:
        raise ValueError(
            f"KV connector {name!r} (kv_connector, kv_offload_bytes) needs "
            "enable_prefix_caching: its index is keyed by the prefix cache's block keys"
        )
    layout = KVConnectorLayout(
        num_blocks=num_blocks,
        block_size=config.block_size,
        kv_groups=kv_layout.kv_groups,
        group_kinds=[g.kind for g in kv_layout.groups],
        group_spans=[g.span for g in kv_layout.groups],
        page_size_bytes=kv_layout.page_size_bytes,
    )
    provider = load_kv_connector(name)
    try:
        backend.init_kv_connector(name, layout)
    except NotImplementedError as exc:
        raise ValueError(
            f"backend {config.backend!r} does not support KV connectors, so kv_connector "
            f"{name!r} cannot run on it ({exc})"
        ) from None
    scheduler = provider.scheduler(config, layout)
    logger.info("KV connector %r: %s", name, scheduler.stats() or "ready")
    return scheduler
