"""KV-cache groups: grouping layer specs into pages of one size, per-group block tables, window
release while running, prefix hits as a fixed point over groups, sizing per group."""

from __future__ import annotations

import functools

import msgspec
import pytest
from helpers.core import make_request as _make_request

from engine_core._core.kv_cache_manager import NULL_BLOCK, GroupedKVCacheManager
from engine_core._core.kv_groups import KVLayout, plan_kv_layout
from engine_core._core.request import Request
from engine_core._core.scheduler import Scheduler, SchedulerConfig
from engine_core.abc import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    KVCacheSpec,
    ModelRunnerOutput,
    SlidingWindowSpec,
)
from engine_core.sampling_params import SamplingParams

BS = 4
make_request = functools.partial(_make_request, block_size=BS)
GEOM = {"num_kv_heads": 2, "head_size": 8, "dtype_bytes": 2}


def full() -> FullAttentionSpec:
    return FullAttentionSpec(**GEOM)


def window(w: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(window=w, **GEOM)


def chunked(c: int) -> ChunkedLocalSpec:
    return ChunkedLocalSpec(chunk=c, **GEOM)


def layer_page() -> int:
    return full().page_size_bytes(BS)


# -- grouping -----------------------------------------------------------------------------------


def test_one_kv_cache_spec_is_one_full_group() -> None:
    spec = KVCacheSpec(num_layers=12, **GEOM)
    layout = plan_kv_layout(spec, BS)
    assert layout.is_one_full_group and not layout.per_layer
    assert layout.page_size_bytes == spec.bytes_per_block(BS)


def test_gemma3_like_layout_groups_by_the_smallest_type() -> None:
    specs = [full() if (i + 1) % 6 == 0 else window(1024) for i in range(12)]
    layout = plan_kv_layout(specs, BS)
    assert [(g.kind, g.span) for g in layout.groups] == [("full_attention", None)] + [
        ("sliding_attention", 1024)
    ] * 5
    assert layout.groups[0].layers == (5, 11)
    assert sorted(i for g in layout.groups for i in g.layers) == list(range(12))
    assert {len(g.layers) for g in layout.groups} == {2}
    assert layout.page_size_bytes == 2 * layer_page()


def test_gpt_oss_like_layout_is_two_equal_groups() -> None:
    specs = [full() if i % 2 == 0 else window(128) for i in range(24)]
    layout = plan_kv_layout(specs, BS)
    assert [len(g.layers) for g in layout.groups] == [12, 12]
    assert layout.groups[1].layers == tuple(range(1, 24, 2))
    assert layout.page_size_bytes == 12 * layer_page()


def test_uneven_types_pad_the_last_group() -> None:
    specs = [full(), full(), window(8), window(8), window(8)]
    layout = plan_kv_layout(specs, BS)
    assert [g.layers for g in layout.groups] == [(0, 1), (2, 3), (4,)]
    assert layout.page_size_bytes == 2 * layer_page()


@pytest.mark.parametrize(
    ("specs", "match"),
    [
        ([], "no layers"),
        ([full(), window(0)], r"layer 1 \(sliding_attention\) has window=0"),
        ([full(), chunked(-4)], r"layer 1 \(chunked_attention\) has chunk=-4"),
        (
            [full(), FullAttentionSpec(num_kv_heads=0, head_size=8, dtype_bytes=2)],
            "layer 1 .* num_kv_heads=0",
        ),
        (
            [full(), SlidingWindowSpec(window=8, num_kv_heads=4, head_size=8, dtype_bytes=2)],
            r"layer 1 has num_kv_heads=4, head_size=8, dtype_bytes=2 .* cannot share",
        ),
        ([full(), "full"], "layer 1 is 'full'"),
    ],
)
def test_inconsistent_specs_name_the_layer_and_field(specs: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_kv_layout(specs, BS)


def test_sizing_per_group() -> None:
    hybrid = plan_kv_layout([full(), window(16)], BS)
    # 100 tokens: 25 blocks of the full group, the window group at most ceil((15 + 8) / 4) + 1.
    assert hybrid.blocks_needed(100, 8, BS) == 25 + 7
    assert hybrid.max_tokens_in(32, 8, BS) == 100
    only_window = plan_kv_layout([window(16), window(16)], BS)
    assert only_window.max_tokens_in(7, 8, BS) is None  # any length fits
    assert only_window.max_tokens_in(6, 8, BS) == 6 * BS


# -- the manager --------------------------------------------------------------------------------


def manager(layout: KVLayout, num_blocks: int = 64) -> GroupedKVCacheManager:
    return GroupedKVCacheManager(num_blocks, BS, layout, tokens_per_step=8)


def run_prompt(kv: GroupedKVCacheManager, request: Request, step: int = 8) -> None:
    """Prefill ``request`` in chunks of ``step`` tokens, as the scheduler would."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(
        request, min(step, request.num_tokens - num_hit), hits, full_sequence_must_fit=True
    )
    request.num_computed_tokens = num_hit + min(step, request.num_tokens - num_hit)
    while request.num_computed_tokens < request.num_tokens:
        num = min(step, request.num_tokens - request.num_computed_tokens)
        assert kv.allocate_slots(request, num)
        request.num_computed_tokens += num


def test_window_group_releases_blocks_behind_the_window_as_cached() -> None:
    layout = plan_kv_layout([full(), window(6)], BS)
    kv = manager(layout)
    request = make_request("r", list(range(40)))
    run_prompt(kv, request)
    assert request.group_blocks is not None
    full_table, window_table = request.group_blocks
    assert len(full_table) == len(window_table) == 10
    assert NULL_BLOCK not in full_table
    # The last step computed from 32: the window sees keys from 27 on (block 6).
    assert window_table[:6] == [NULL_BLOCK] * 6
    assert all(b is not NULL_BLOCK for b in window_table[6:])
    assert kv.blocks_in_use == [10, 4]
    assert kv.num_free_blocks == 64 - 14
    # The released blocks sit in the free queue, still cached.
    assert sum(1 for b in kv.pool.free_queue if b.key is not None) >= 5
    kv.free(request)
    assert kv.num_free_blocks == 64 and kv.blocks_in_use == [0, 0]


def test_chunked_group_releases_earlier_chunks() -> None:
    kv = manager(plan_kv_layout([full(), chunked(8)], BS))
    request = make_request("r", list(range(30)))
    run_prompt(kv, request, step=6)
    assert request.group_blocks is not None
    table = request.group_blocks[1]
    # Last step computed from 24 (chunk 24..31): blocks 0..5 are behind it.
    assert table[:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in table[6:]


def test_prefix_hit_is_the_fixed_point_over_groups() -> None:
    layout = plan_kv_layout([full(), window(6)], BS)
    kv = manager(layout)
    prompt = list(range(41))
    first = make_request("a", prompt)
    run_prompt(kv, first, step=41)  # one step: nothing released before it
    kv.free(first)
    again = make_request("b", prompt)
    hits, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 40  # the last token is recomputed
    assert len(hits) == 2 and len(hits[0]) == len(hits[1]) == 10
    # The window only needs the blocks covering [35, 40): blocks 8 and 9.
    assert hits[1][:8] == [NULL_BLOCK] * 8
    kv.free(again)

    # Evict the window group's block 9 only: the window group cannot serve a hit ending at 40,
    # but it can at 36 (keys 31..35: blocks 7 and 8), which the full group also serves.
    block9 = kv.pool.cached[again.block_keys[9] + b"/g1"]
    kv.pool.uncache(block9)
    again = make_request("c", prompt)
    hits, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 36
    assert hits[1][:7] == [NULL_BLOCK] * 7 and NULL_BLOCK not in hits[1][7:]


def test_full_group_miss_caps_the_hit() -> None:
    kv = manager(plan_kv_layout([full(), window(6)], BS))
    prompt = list(range(41))
    first = make_request("a", prompt)
    run_prompt(kv, first, step=41)
    kv.free(first)
    kv.pool.uncache(kv.pool.cached[first.block_keys[3]])  # full group, block 3
    hits, num_hit = kv.get_computed_blocks(make_request("b", prompt))
    # 12 tokens: the window sees keys 7..11, blocks 1 and 2, both cached.
    assert num_hit == 12


def test_all_hits_are_touched_before_allocating() -> None:
    layout = plan_kv_layout([full(), window(6)], BS)
    prompt = list(range(41))
    kv = manager(layout, num_blocks=24)
    first = make_request("a", prompt)
    run_prompt(kv, first, step=41)
    kv.free(first)
    again = make_request("b", prompt + [7] * 8)
    hits, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 40
    # Every free block is either a hit or cached; allocating the new blocks must not evict
    # a hit of either group.
    assert kv.allocate_slots(again, 9, hits, full_sequence_must_fit=True)
    assert request_ids_unique(again)


def request_ids_unique(request: Request) -> bool:
    assert request.group_blocks is not None
    ids = [b.block_id for table in request.group_blocks for b in table if b is not NULL_BLOCK]
    return len(ids) == len(set(ids))


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    kv = manager(plan_kv_layout([full(), window(6)], BS), num_blocks=10)
    request = make_request("r", list(range(40)))
    hits, _ = kv.get_computed_blocks(request)
    assert not kv.allocate_slots(request, 40, hits)
    assert kv.num_free_blocks == 10 and kv.blocks_in_use == [0, 0]


# -- the scheduler ------------------------------------------------------------------------------


def scheduler(layout: KVLayout | None, num_blocks: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=8, max_model_len=256, block_size=BS)
    return Scheduler(config, num_blocks, kv_layout=layout)


def step(s: Scheduler) -> tuple:
    out = s.schedule()
    s.update_from_output(
        out,
        ModelRunnerOutput(out.req_ids, [[1]] * out.num_reqs),  # every request samples 1
    )
    return out


def test_one_group_messages_stay_flat() -> None:
    for layout in (None, plan_kv_layout([full(), full()], BS)):
        s = scheduler(layout)
        s.add_request(make_request("r", list(range(10))))
        out = step(s)
        assert out.new_reqs[0].block_ids == [0, 1]
        assert type(s.kv).__name__ == "KVCacheManager"


def test_grouped_messages_carry_one_table_per_group() -> None:
    s = scheduler(plan_kv_layout([full(), window(6)], BS))
    s.add_request(make_request("r", list(range(16))))
    out = step(s)
    ids = out.new_reqs[0].block_ids
    assert len(ids) == 2 and all(len(t) == 2 for t in ids)  # type: ignore[arg-type]
    out = step(s)  # 8 more tokens: two more blocks in each group
    new = out.cached.new_block_ids[0]
    assert new is not None and len(new) == 2 and all(len(t) == 2 for t in new)  # type: ignore[arg-type]
    s.finish_requests("r")
    assert s.kv.num_free_blocks == 64


def test_one_window_group_sends_flat_tables_with_null_ids() -> None:
    s = scheduler(plan_kv_layout([window(6), window(6)], BS))
    s.add_request(make_request("r", list(range(24))))
    ids = step(s).new_reqs[0].block_ids
    assert all(isinstance(b, int) for b in ids)
    for _ in range(3):
        step(s)
    request = s.requests["r"]
    assert request.group_blocks is not None
    assert request.group_blocks[0][0] is NULL_BLOCK
    assert s.kv.group_usage()[0][:2] == ("sliding_attention", 6)


# -- the wire -------------------------------------------------------------------------------------


def test_block_tables_cross_the_typed_wire_in_both_forms() -> None:
    from engine_core._core.scheduler_output import CachedRequestData, NewRequestData
    from engine_core.abc import SchedulerOutput

    flat = NewRequestData("a", [1, 2, 3], SamplingParams(), [0, 1], 0, 3)
    nested = NewRequestData("b", [1, 2, 3], SamplingParams(), [[0, 1], [-1, 2]], 0, 3)
    cached = CachedRequestData(["c", "d"], [[5], [[6], [7]]], [4, 4], [1, 1])
    out = SchedulerOutput([flat, nested], cached, 8)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=SchedulerOutput)
    assert decoded == out
    assert decoded.new_reqs[1].block_ids == [[0, 1], [-1, 2]]
    # One group: the same bytes as a plain list of ints.
    assert msgspec.msgpack.encode(flat.block_ids) == msgspec.msgpack.encode([0, 1])


def test_data_parallel_stats_sum_blocks_per_group() -> None:
    from engine_core._core.engine_io import EngineStats, KVGroupStats
    from engine_core._engine.dp.stats import aggregate_stats

    def engine(full: int, window: int) -> EngineStats:
        groups = [
            KVGroupStats(kind="full_attention", window=None, blocks_in_use=full),
            KVGroupStats(kind="sliding_attention", window=128, blocks_in_use=window),
        ]
        return EngineStats(
            num_running=1,
            num_waiting=0,
            kv_cache_usage=0.0,
            prefix_cache_hit_rate=0.0,
            num_preemptions=0,
            num_steps=1,
            num_kv_blocks=100,
            num_free_kv_blocks=100 - full - window,
            kv_groups=groups,
        )

    total = aggregate_stats({0: engine(10, 2), 1: engine(30, 4)}, 2)
    assert [(g.kind, g.blocks_in_use) for g in total.kv_groups] == [
        ("full_attention", 40),
        ("sliding_attention", 6),
    ]


def test_the_startup_line_names_the_groups() -> None:
    from engine_core._core.engine_io import EngineInfo

    layout = plan_kv_layout([full(), window(6), window(6)], BS)
    info = EngineInfo(
        num_kv_blocks=10,
        block_size=BS,
        max_model_len=64,
        vocab_size=256,
        backend="mock",
        kv_groups=layout.describe(),
    )
    assert "10 blocks of 4 tokens (groups: full_attention x1, sliding_attention(6) x1" in (
        info.describe()
    )
    plain = EngineInfo(
        num_kv_blocks=10, block_size=BS, max_model_len=64, vocab_size=256, backend="mock"
    )
    assert "4 tokens; max_model_len" in plain.describe()
