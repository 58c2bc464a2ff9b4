"""The stats of a data-parallel deployment: the engines' own, summed the way rates add up, and
what the router did (:class:`RouterMetrics`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_core._core.engine_io import EngineStats, KVGroupStats
from engine_core._core.router import REASONS

if TYPE_CHECKING:
    from engine_core._engine.dp.disagg import DisaggMetrics

__all__ = ["RouterMetrics", "aggregate_stats"]

_SUMMED = (
    "num_running",
    "num_waiting",
    "num_preemptions",
    "num_recomputed_tokens",
    "num_steps",
    "num_kv_blocks",
    "num_free_kv_blocks",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_malformed_messages",
    "device_busy_s",
    "spec_num_drafts",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
    "spec_shadow_drafts",
    "spec_shadow_accepted",
    "kv_offload_hit_tokens",
    "kv_offload_bytes_loaded",
    "kv_offload_bytes_stored",
    "kv_offload_load_s",
    "kv_offload_store_s",
    "kv_offload_failed_blocks",
    "kv_offload_resident_blocks",
    "kv_offload_capacity_blocks",
    "kv_offload_free_blocks",
    "kv_parked_requests",
    "kv_loads_cancelled",
)


def _sum_lists(lists: list[list[int]]) -> list[int]:
    total = [0] * max((len(values) for values in lists), default=0)
    for values in lists:
        for i, value in enumerate(values):
            total[i] += value
    return total


def _sum_kv_groups(stats: list[EngineStats]) -> list[KVGroupStats]:
    """Blocks in use per group, summed over engines of one layout (else none)."""
    layouts = {tuple((g.kind, g.window) for g in s.kv_groups) for s in stats}
    if len(layouts) != 1:
        return []
    return [
        KVGroupStats(
            kind=kind, window=window, blocks_in_use=sum(s.kv_groups[i].blocks_in_use for s in stats)
        )
        for i, (kind, window) in enumerate(layouts.pop())
    ]


def aggregate_stats(per_engine: dict[int, EngineStats], num_engines: int) -> EngineStats:
    """One snapshot of the live engines (``rank -> stats``): counts summed, the KV usage and the
    hit rate computed from the sums (never an average of rates), each engine's own listed."""
    ranks = sorted(per_engine)
    stats = [per_engine[r] for r in ranks]
    sums = {name: sum(getattr(s, name) for s in stats) for name in _SUMMED}
    blocks, free = sums["num_kv_blocks"], sums["num_free_kv_blocks"]
    queries, hits = sums["prefix_cache_queries"], sums["prefix_cache_hits"]
    steps_by_k: dict[int, int] = {}
    for s in stats:
        for k, count in s.spec_steps_by_k.items():
            steps_by_k[k] = steps_by_k.get(k, 0) + count
    return EngineStats(
        **sums,
        spec_num_speculative_tokens=max((s.spec_num_speculative_tokens for s in stats), default=0),
        spec_accepted_per_pos=_sum_lists([s.spec_accepted_per_pos for s in stats]),
        spec_drafted_per_pos=_sum_lists([s.spec_drafted_per_pos for s in stats]),
        spec_current_k=max((s.spec_current_k for s in stats), default=0),
        seconds_since_progress=max((s.seconds_since_progress for s in stats), default=0.0),
        spec_steps_by_k=steps_by_k,
        kv_cache_usage=1.0 - free / blocks if blocks else 0.0,
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        num_engines=num_engines,
        num_engines_alive=len(stats),
        engines=stats,
        engine_ranks=ranks,
        kv_groups=_sum_kv_groups(stats),
        engine_role="",
        kv_transfer=_sum_dicts([s.kv_transfer for s in stats]),
        lora_running={k: int(v) for k, v in _sum_dicts([s.lora_running for s in stats]).items()},
        lora_waiting={k: int(v) for k, v in _sum_dicts([s.lora_waiting for s in stats]).items()},
        lora_loaded=sorted({name for s in stats for name in s.lora_loaded}),
    )


def _sum_dicts(dicts: list[dict[str, float]] | list[dict[str, int]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for counters in dicts:
        for name, value in counters.items():
            total[name] = total.get(name, 0.0) + value
    return total


class RouterMetrics:
    """What the router did: requests by engine and reason, predicted and actual prefix hits."""

    def __init__(self, num_engines: int) -> None:
        self.requests: dict[tuple[int, str], int] = {
            (e, r): 0 for e in range(num_engines) for r in REASONS
        }
        self.predicted_hit_tokens = [0] * num_engines
        self.actual_hit_tokens = [0] * num_engines
        """Cached tokens the engines reported for the requests they started."""
        self.engine_restarts = [0] * num_engines
        self.disagg: DisaggMetrics | None = None
        """Prefill/decode disaggregation's counters (None: off)."""
