"""The stats of a data-parallel deployment: the engines' own, summed the way rates add up."""

from __future__ import annotations

from engine_core._core.protocol import EngineStats

__all__ = ["aggregate_stats"]

_SUMMED = (
    "num_running",
    "num_waiting",
    "num_preemptions",
    "num_steps",
    "num_kv_blocks",
    "num_free_kv_blocks",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_malformed_messages",
    "device_busy_s",
)


def aggregate_stats(per_engine: dict[int, EngineStats], num_engines: int) -> EngineStats:
    """One snapshot of the live engines (``rank -> stats``): counts summed, the KV usage and the
    hit rate computed from the sums (never an average of rates), each engine's own listed."""
    ranks = sorted(per_engine)
    stats = [per_engine[r] for r in ranks]
    sums = {name: sum(getattr(s, name) for s in stats) for name in _SUMMED}
    blocks, free = sums["num_kv_blocks"], sums["num_free_kv_blocks"]
    queries, hits = sums["prefix_cache_queries"], sums["prefix_cache_hits"]
    return EngineStats(
        **sums,
        kv_cache_usage=1.0 - free / blocks if blocks else 0.0,
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        num_engines=num_engines,
        num_engines_alive=len(stats),
        engines=stats,
        engine_ranks=ranks,
    )
