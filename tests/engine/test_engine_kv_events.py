"""EngineCore under data parallelism: KV events and load reports with each step's outputs, the
snapshot of cached digests, and requests resumed from another engine's tokens."""

from __future__ import annotations

import msgspec

from engine_core._core.block_hash import block_digests
from engine_core._core.engine_io import DPEngineCoreOutputs, EngineCoreOutputs, EngineCoreRequest
from engine_core._core.kv_events import block_digest
from engine_core._core.router import Router
from engine_core._engine.core import EngineCore
from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _core(dp: int, **kwargs: object) -> EngineCore:
    return EngineCore(
        EngineConfig(
            backend="mock",
            tokenizer="byte",
            max_model_len=128,
            num_kv_blocks=12,
            data_parallel_size=dp,
            **kwargs,  # type: ignore[arg-type]
        )
    )


def _run(core: EngineCore, router: Router | None = None) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        out = core.step()
        if router is not None:
            assert isinstance(out, DPEngineCoreOutputs)
            if out.kv_events is not None:
                router.apply_events(0, out.kv_events)
        for rid, new in zip(out.req_ids, out.new_token_ids, strict=True):
            tokens.setdefault(rid, []).extend(new)
    return tokens


def test_events_and_load_travel_with_the_outputs_and_match_the_cache() -> None:
    core = _core(2)
    router = Router(2, block_size=16)
    seen_load = []
    for i in range(6):  # more blocks than the pool holds: evictions
        core.add_request(EngineCoreRequest(f"r{i}", [i % 3 + 1] * 40 + [i] * 20, GREEDY))
        while core.has_unfinished_requests():
            out = core.step()
            assert isinstance(out, DPEngineCoreOutputs) and out.load is not None
            seen_load.append(out.load)
            if out.kv_events is not None:
                router.apply_events(0, out.kv_events)
    assert router.engine_digests(0) == {block_digest(k) for k in core.scheduler.kv.pool.cached}
    assert set(core.kv_cache_snapshot()) == router.engine_digests(0)
    assert seen_load[-1].num_blocks == 12
    assert seen_load[-1].num_running == 0
    assert seen_load[-1].num_free_blocks == 12
    # what the router predicts for a cached prompt is what the engine finds
    prompt = [3] * 40 + [5] * 20
    digests = block_digests(prompt, 16, (len(prompt) - 1) // 16)
    depth = router.depths(digests, [0])[0]
    core.add_request(EngineCoreRequest("again", prompt, GREEDY))
    out = core.step()
    assert out.num_cached_tokens["again"] == depth * 16 > 0


def test_a_single_engine_reports_no_events_or_load() -> None:
    core = _core(1)
    core.add_request(EngineCoreRequest("a", [1] * 40, GREEDY))
    encoder = msgspec.msgpack.Encoder()
    while core.has_unfinished_requests():
        out = core.step()
        # Not a byte of either on the wire: the plain outputs, whose last field is the time.
        assert type(out) is EngineCoreOutputs
        assert encoder.encode(out).endswith(encoder.encode(out.timestamp))
    assert core.scheduler.kv.pool.events is None


def test_a_resumed_request_continues_as_if_uninterrupted() -> None:
    core = _core(1)
    prompt = list(range(1, 30))
    core.add_request(EngineCoreRequest("whole", prompt, GREEDY))
    whole = _run(core)["whole"]
    other = _core(1)
    other.add_request(EngineCoreRequest("rest", prompt, GREEDY, resume_output_token_ids=whole[:2]))
    tokens: list[int] = []
    finish = None
    while other.has_unfinished_requests():
        out = other.step()
        for new in out.new_token_ids:
            tokens.extend(new)
        for f in out.finished:
            finish = f.finish_reason
    assert whole[:2] + tokens == whole  # max_tokens counts the resumed tokens
    assert finish == "length"
