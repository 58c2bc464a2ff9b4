"""The mock pretends KV layouts (``layer_types``): outputs independent of the layout, every
block table checked against what each group's layers read, bad layouts refused at startup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_core_mock import MockBackend
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from engine_core import LLM, EngineConfig, SamplingParams
from engine_core._core.engine_io import EngineCoreRequest
from engine_core._engine.core import EngineCore
from engine_core.abc import (
    CachedRequestData,
    FullAttentionSpec,
    NewRequestData,
    SchedulerOutput,
    SlidingWindowSpec,
)
from engine_core.testing import check_backend

BS = 4
HYBRID = ["full_attention", "sliding_attention", "sliding_attention", "chunked_attention"]
OPTIONS = {
    "num_layers": 4,
    "num_kv_heads": 2,
    "head_size": 8,
    "dtype_bytes": 2,
    "device_memory_bytes": 1 << 19,
}


def layout_options(types: list[str], window: int = 10, chunk: int = 16) -> dict:
    return {
        **OPTIONS,
        "layer_types": types,
        "sliding_window": window,
        "attention_chunk_size": chunk,
    }


def test_per_layer_specs_from_layer_types() -> None:
    backend = MockBackend(
        EngineConfig(tokenizer="byte", backend_options=layout_options(HYBRID, window=7))
    )
    specs = backend.kv_cache_spec()
    assert isinstance(specs, list) and len(specs) == 4
    assert [s.kind for s in specs] == HYBRID
    assert isinstance(specs[1], SlidingWindowSpec) and specs[1].window == 7


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            layout_options(["full_attention"] * 3),
            r"layer_types'\] has 3 entries but the model has 4 layers \(num_hidden_layers",
        ),
        (layout_options(["full_attention"] * 3 + ["global"]), r"\[3\] is 'global'"),
        (
            {**OPTIONS, "layer_types": ["sliding_attention"] * 4},
            "sliding_window'] must be an int >= 1, got None",
        ),
        ({**layout_options(HYBRID), "sliding_window": 0}, "sliding_window'] must be an int >= 1"),
    ],
)
def test_bad_layouts_fail_at_startup(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MockBackend(EngineConfig(tokenizer="byte", backend_options=options))


def test_hf_config_layer_types_must_match_num_hidden_layers(tmp_path: Path) -> None:
    config = {
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "hidden_size": 64,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 16,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"layer_types in .* has 2 entries .* 3 layers"):
        LLM(backend="mock", model=str(tmp_path), tokenizer="byte")


def test_gemma3_config_follows_its_pattern(tmp_path: Path) -> None:
    config = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 12,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "hidden_size": 64,
        "sliding_window": 32,
        "sliding_window_pattern": 6,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    backend = MockBackend(EngineConfig(tokenizer="byte", model=str(tmp_path)))
    specs = backend.kv_cache_spec()
    assert isinstance(specs, list)
    assert [s.kind == "full_attention" for s in specs] == [(i + 1) % 6 == 0 for i in range(12)]


def run(types: list[str], prompts: list[list[int]], **config: object) -> tuple[list, object]:
    llm = LLM(
        backend="mock",
        tokenizer="byte",
        block_size=BS,
        max_num_batched_tokens=24,
        max_num_seqs=4,
        backend_options=layout_options(types),
        **config,  # type: ignore[arg-type]
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=30, ignore_eos=True),
    )
    return [o.outputs[0].token_ids for o in outs], llm.get_stats()


def test_outputs_do_not_depend_on_the_layout_and_windows_save_blocks() -> None:
    prompts = [[(7 * i + j) % 250 for j in range(40 + 9 * i)] for i in range(6)]
    prompts += prompts  # a second wave: prefix hits in every group
    expected, full_stats = run(["full_attention"] * 4, prompts)
    for types in (HYBRID, ["sliding_attention"] * 4, ["chunked_attention"] * 4):
        outputs, stats = run(types, prompts)
        assert outputs == expected, types
        assert stats.prefix_cache_hits == full_stats.prefix_cache_hits, types  # type: ignore[attr-defined]
        assert stats.num_free_kv_blocks == stats.num_kv_blocks  # type: ignore[attr-defined]


def test_kv_group_stats_count_real_blocks() -> None:
    core = EngineCore(
        EngineConfig(
            backend="mock",
            tokenizer="byte",
            block_size=BS,
            max_num_batched_tokens=16,
            max_num_seqs=4,
            backend_options=layout_options(["full_attention", "sliding_attention"] * 2),
        )
    )
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    core.add_request(EngineCoreRequest("r", list(range(64)), params))
    for _ in range(4):
        core.step()
    stats = core.get_stats()
    assert [(g.kind, g.window) for g in stats.kv_groups] == [
        ("full_attention", None),
        ("sliding_attention", 10),
    ]
    full_used, window_used = (g.blocks_in_use for g in stats.kv_groups)
    assert full_used == 16 and window_used < full_used
    used = stats.num_kv_blocks - stats.num_free_kv_blocks
    assert used == full_used + window_used
    assert stats.kv_cache_usage == pytest.approx(used / stats.num_kv_blocks)


# -- the mock as the oracle of the manager ----------------------------------------------------


def started(types: list[str], groups: list[list[int]], num_blocks: int = 32) -> MockBackend:
    options = {**layout_options(types), "num_layers": len(types)}
    backend = MockBackend(EngineConfig(tokenizer="byte", block_size=BS, backend_options=options))
    backend.initialize_kv_cache(num_blocks, groups)
    return backend


def new_request(
    req_id: str, prompt: list[int], block_ids: list, computed: int = 0
) -> NewRequestData:
    return NewRequestData(
        req_id,
        prompt,
        SamplingParams(temperature=0.0, max_tokens=50),
        block_ids,
        computed,
        len(prompt) - computed,
    )


def step(backend: MockBackend, new: list | None = None, cached: CachedRequestData | None = None):
    cached = cached or CachedRequestData()
    new = new or []
    total = sum(cached.num_scheduled_tokens) + sum(r.num_scheduled_tokens for r in new)
    backend.execute_model(SchedulerOutput(new, cached, total))
    return backend.sample_tokens(None)


def test_a_window_layer_reading_a_released_block_is_an_error() -> None:
    backend = started(["full_attention", "sliding_attention"], [[0], [1]])
    prompt = list(range(20))
    step(backend, [new_request("r", prompt, [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])])
    # A hit of 16 tokens: computing from 16, the window (10) reads keys 7.. (block 1 on), so a
    # null id at position 1 is a read of a released block (position 0 may be null).
    tables = [[0, 1, 2, 3, 12, 13], [-1, -1, 8, 9, 14, 15]]
    with pytest.raises(RuntimeError, match=r"outside the KV cache .*; group 1 .* reads position 1"):
        step(backend, new=[new_request("s", prompt, tables, computed=16)])
    backend = started(["full_attention", "sliding_attention"], [[0], [1]])
    step(backend, [new_request("r", prompt, [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])])
    tables = [[0, 1, 2, 3, 12, 13], [-1, 7, 8, 9, 14, 15]]
    step(backend, new=[new_request("s", prompt, tables, computed=16)])


def test_a_window_block_handed_out_while_still_read_is_an_error() -> None:
    backend = started(["full_attention", "sliding_attention"], [[0], [1]])
    step(backend, [new_request("r", list(range(20)), [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])])
    # Block 9 (position 3 of r's window table) is still read by r's next queries.
    with pytest.raises(RuntimeError, match="block 9 .* still held by live request"):
        step(backend, [new_request("s", list(range(4)), [[20], [9]])])


def test_blocks_behind_the_window_may_be_reused() -> None:
    backend = started(["full_attention", "sliding_attention"], [[0], [1]])
    step(backend, [new_request("r", list(range(20)), [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])])
    cached = CachedRequestData(["r"], [None], [20], [1])
    # Position 20 reads keys 11..20: blocks 0..1 of the window table are behind it.
    out = step(backend, [new_request("s", list(range(4)), [[20], [6]])], cached)
    assert out.sampled_token_ids == [[21], [4]]


def test_a_hit_on_another_groups_block_is_an_error() -> None:
    backend = started(["full_attention", "sliding_attention"], [[0], [1]])
    prompt = list(range(21))
    step(backend, [new_request("r", prompt, [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])])
    backend.execute_model(SchedulerOutput([], CachedRequestData(), 0, ["r"]))
    backend.sample_tokens(None)
    # A hit of 20 tokens whose window table names the full group's blocks.
    hit = [[0, 1, 2, 3, 4, 5], [-1, -1, 2, 3, 4, 5]]
    with pytest.raises(RuntimeError, match="different token prefix or group"):
        step(backend, [new_request("s", prompt, hit, computed=20)])


def test_a_mixed_layout_backend_passes_the_conformance_checks() -> None:
    config = EngineConfig(
        tokenizer="byte",
        max_model_len=512,
        backend_options=layout_options(HYBRID, window=20, chunk=32),
    )
    check_backend(MockBackend, config)


# -- property: nothing a request does makes a window layer read a released block -------------

PROMPT_PARTS = [[(31 * k + j) % 250 for j in range(23)] for k in range(4)]


@st.composite
def workloads(draw: st.DrawFn) -> list[tuple[list[int], int, int | None]]:
    """Requests: a prompt built from shared parts (prefix hits), max_tokens, and the step at
    which it is aborted (None: never)."""
    count = draw(st.integers(2, 7))
    out = []
    for _ in range(count):
        parts = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3))
        tail = draw(st.integers(0, 9))
        prompt = [t for p in parts for t in PROMPT_PARTS[p]] + list(range(tail))
        abort = draw(st.none() | st.integers(1, 12))
        out.append((prompt, draw(st.integers(1, 24) | st.just(24)), abort))
    return out


def workload_of(*requests: tuple[list[int], int, int, int | None]) -> list:
    """(prompt parts, tail length, max_tokens, abort step) per request."""
    return [
        ([t for p in parts for t in PROMPT_PARTS[p]] + list(range(tail)), max_tokens, abort)
        for parts, tail, max_tokens, abort in requests
    ]


# Preempts (and hits): found by a search over random workloads.
PREEMPTING = workload_of(
    ([2], 1, 24, None),
    ([3, 3], 6, 24, None),
    ([0], 7, 24, None),
    ([3], 6, 24, None),
    ([3], 4, 24, None),
    ([0], 5, 24, None),
    ([0], 0, 24, None),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(workload=PREEMPTING, types=HYBRID, window=10, num_blocks=78, preempts=True)
@example(
    workload=PREEMPTING[:3] + workload_of(([1], 3, 20, 4)),
    types=HYBRID,
    window=10,
    num_blocks=78,
    preempts=False,
)
@given(
    workload=workloads(),
    types=st.sampled_from(
        [HYBRID, ["sliding_attention", "full_attention"] * 2, ["sliding_attention"] * 4]
    ),
    window=st.integers(1, 13),
    num_blocks=st.integers(30, 80),
    preempts=st.just(False),
)
def test_no_request_makes_a_window_layer_read_a_released_block(
    workload: list[tuple[list[int], int, int | None]],
    types: list[str],
    window: int,
    num_blocks: int,
    preempts: bool,
) -> None:
    # Few blocks: preemptions; shared prompt parts: hits; aborts at random steps. The mock
    # raises on any read of a released block or of a block holding other tokens.
    config = EngineConfig(
        backend="mock",
        tokenizer="byte",
        block_size=BS,
        num_kv_blocks=num_blocks,
        max_model_len=100,
        max_num_batched_tokens=20,
        max_num_seqs=8,
        backend_options=layout_options(types, window=window, chunk=8),
    )
    try:
        core = EngineCore(config)
    except ValueError as exc:  # too few blocks for one request of max_model_len
        assert "needs" in str(exc)
        assume(False)
    params = {}
    for i, (prompt, max_tokens, _) in enumerate(workload):
        params[f"r{i}"] = (prompt, max_tokens)
        core.add_request(
            EngineCoreRequest(
                f"r{i}",
                prompt,
                SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            )
        )
    tokens: dict[str, list[int]] = {r: [] for r in params}
    aborted = set()
    steps = 0
    while core.has_unfinished_requests():
        steps += 1
        assert steps < 500
        for i, (_, _, abort) in enumerate(workload):
            if abort == steps:
                core.abort_requests([f"r{i}"])
                aborted.add(f"r{i}")
        outputs = core.step()
        for req_id, new in zip(outputs.req_ids, outputs.new_token_ids, strict=True):
            tokens[req_id].extend(new)
    for req_id, (prompt, max_tokens) in params.items():
        num = min(max_tokens, 100 - len(prompt))  # max_model_len caps it
        expected = [(prompt[-1] + 1 + k) % 258 for k in range(num)]
        if req_id in aborted:
            assert tokens[req_id] == expected[: len(tokens[req_id])]
        else:
            assert tokens[req_id] == expected, (req_id, tokens[req_id], expected)
    kv = core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert all(g.blocks_in_use == 0 for g in core.get_stats().kv_groups)
    if preempts:
        assert core.scheduler.num_preemptions > 0 and core.get_stats().prefix_cache_hits > 0
    core.close()


class _BadSpecs(MockBackend):
    specs: list = []

    def kv_cache_spec(self):  # type: ignore[no-untyped-def]
        return self.specs


@pytest.mark.parametrize(
    ("specs", "match"),
    [
        ([], "returned no layers"),
        (
            [FullAttentionSpec(num_kv_heads=2, head_size=8, dtype_bytes=2),
             SlidingWindowSpec(window=0, num_kv_heads=2, head_size=8, dtype_bytes=2)],
            r"layer 1 \(sliding_attention\) has window=0",
        ),
        (
            [FullAttentionSpec(num_kv_heads=2, head_size=8, dtype_bytes=2),
             FullAttentionSpec(num_kv_heads=2, head_size=16, dtype_bytes=2)],
            "layer 1 has num_kv_heads=2, head_size=16.* cannot share one KV-cache pool",
        ),
    ],
)  # fmt: skip
def test_inconsistent_specs_stop_the_engine_at_startup(specs: list, match: str) -> None:
    class Bad(_BadSpecs):
        pass

    Bad.specs = specs
    with pytest.raises(ValueError, match=match):
        EngineCore(EngineConfig(backend="mock", tokenizer="byte"), backend_cls=Bad)


def test_max_model_len_follows_what_each_group_needs() -> None:
    def core_of(types: list[str]) -> EngineCore:
        options = {**layout_options(types), "device_memory_bytes": 600 * 1024}
        return EngineCore(
            EngineConfig(
                backend="mock",
                tokenizer="byte",
                block_size=BS,
                max_num_batched_tokens=64,
                max_num_seqs=4,
                kv_cache_memory_fraction=1.0,
                backend_options=options,
            )
        )

    full = core_of(["full_attention"] * 4)
    # One group of 4 layers: 1024-byte pages, 600 of them, 2400 tokens for one request.
    assert full.num_kv_blocks == 600 and full.max_model_len == 600 * BS
    full.close()
    hybrid = core_of(["full_attention", "sliding_attention"] * 2)
    # Two groups of 2 layers: 1200 pages; the window group needs at most
    # ceil((10 - 1 + 64) / 4) + 1 = 20 of them, whatever the length.
    assert hybrid.num_kv_blocks == 1200 and hybrid.max_model_len == (1200 - 20) * BS
    hybrid.close()
    windows = core_of(["sliding_attention"] * 4)
    assert windows.max_model_len > 1200 * BS  # not capped by the KV cache at all
    windows.close()
    with pytest.raises(ValueError, match=r"needs .* in its KV-cache groups"):
        EngineCore(
            EngineConfig(
                backend="mock",
                tokenizer="byte",
                block_size=BS,
                max_model_len=10000,
                max_num_batched_tokens=64,
                max_num_seqs=4,
                backend_options={**layout_options(HYBRID), "device_memory_bytes": 600 * 1024},
            )
        )
