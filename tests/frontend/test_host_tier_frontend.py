"""The host KV tier through AsyncLLM, the engine in its own process, under asyncio and trio."""

from __future__ import annotations

from typing import Any

import pytest

from engine_core import AsyncLLM, EngineDeadError, SamplingParams
from engine_core._core.engine_io import EngineStats
from engine_core.errors import InvalidRequestError
from engine_core.server._metrics import _engine_state

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _engine(link: dict[str, Any] | None = None, **kwargs: Any) -> AsyncLLM:
    return AsyncLLM(
        backend="mock",
        tokenizer="byte",
        multiprocess=True,
        num_kv_blocks=40,
        max_model_len=512,
        kv_offload_bytes="1MiB",
        backend_options={
            "num_layers": 2,
            "num_kv_heads": 1,
            "head_size": 8,
            "kv_link": {"host_memory_bytes": 1 << 40, **(link or {})},
            **kwargs.pop("options", {}),
        },
        **kwargs,
    )


def _prompt(i: int) -> list[int]:
    return [(i * 31 + j * 7) % 250 + 1 for j in range(160)]


async def _tokens(engine: AsyncLLM, i: int, request_id: str) -> list[int]:
    final = None
    async for out in engine.generate(
        {"prompt_token_ids": _prompt(i)}, PARAMS, request_id=request_id
    ):
        final = out
    assert final is not None and final.finished
    return list(final.outputs[0].token_ids)


async def test_re_sent_prompts_come_back_from_the_host_tier() -> None:
    async with _engine() as engine:
        for r in range(3):
            for i in range(6):
                tokens = await _tokens(engine, i, f"r{r}-{i}")
                assert tokens == [(_prompt(i)[-1] + 1 + j) % 258 for j in range(4)]
        stats = await engine.get_stats()
        assert stats.kv_offload_hit_tokens > 0
        assert stats.kv_offload_bytes_stored > 0
        assert stats.num_free_kv_blocks <= stats.num_kv_blocks


async def test_a_worker_half_that_raises_kills_the_engine_with_the_cause() -> None:
    async with _engine(
        link={"fault": {"kind": "raise", "probability": 1.0, "on": "both"}}
    ) as engine:
        with pytest.raises(EngineDeadError) as info:
            await _tokens(engine, 0, "a")
            await _tokens(engine, 0, "b")
        text = "".join(str(e) for e in (info.value, info.value.__cause__) if e is not None)
        assert "worker half raised" in text
        with pytest.raises(EngineDeadError):
            await engine.check_health()


async def test_the_engine_killed_mid_transfer_ends_every_request() -> None:
    # A slow link keeps loads in flight; the process exits at step 12.
    link = {"bytes_per_s": 2e5, "latency_s": 0.001}
    async with _engine(link=link, options={"fault": {"kind": "exit", "at_step": 12}}) as engine:
        ended = 0
        for r in range(3):
            for i in range(6):
                try:
                    await _tokens(engine, i, f"k{r}-{i}")
                except EngineDeadError:
                    ended += 1
        assert ended > 0
        with pytest.raises(EngineDeadError):
            await engine.check_health()


async def test_more_host_memory_than_can_be_pinned_fails_startup() -> None:
    with pytest.raises(Exception, match=r"kv_offload_bytes \(--kv-offload-bytes\)"):
        async with AsyncLLM(
            backend="mock",
            tokenizer="byte",
            multiprocess=True,
            kv_offload_bytes="4GiB",
            backend_options={"kv_link": {"host_memory_bytes": 1 << 30}},
        ):
            pass


def test_metrics_name_the_host_tier_counters() -> None:
    stats = EngineStats(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        prefix_cache_hit_rate=0.0,
        num_preemptions=0,
        num_steps=0,
        num_kv_blocks=1,
        num_free_kv_blocks=1,
        kv_offload_hit_tokens=7,
        kv_parked_requests=2,
    )
    values = {m.name: m.samples[0].value for m in _engine_state(stats)}
    assert values["engine_core_kv_offload_hit_tokens"] == 7
    assert values["engine_core_kv_parked_requests"] == 2
    for name in (
        "engine_core_kv_offload_loaded_bytes",
        "engine_core_kv_offload_stored_bytes",
        "engine_core_kv_offload_load_seconds",
        "engine_core_kv_offload_failed_blocks",
        "engine_core_kv_loads_cancelled",
        "engine_core_num_recomputed_tokens",
    ):
        assert name in values


class _Raising:
    """A connector plugin whose scheduler half raises for prompts that start with token 7."""

    name = "raising"

    def scheduler(self, config: Any, layout: Any) -> Any:
        from engine_core._core.host_tier import HostTierScheduler

        class Half(HostTierScheduler):
            def get_num_new_matched_tokens(self, request: Any, num: int) -> tuple[int, bool]:
                if request.all_token_ids[0] == 7:
                    raise RuntimeError("the index is unreachable")
                return super().get_num_new_matched_tokens(request, num)

        return Half(config, layout)

    def worker(self, config: Any, layout: Any, backend: str, rank: int) -> Any:
        from engine_core_mock._kv_link import MockHostWorker

        return MockHostWorker(config, layout, None, __import__("time").monotonic)


async def test_a_scheduler_half_that_raises_ends_only_its_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import engine_core_mock._backend as mock_backend

    import engine_core._engine.startup as startup

    monkeypatch.setattr(startup, "load_kv_connector", lambda name: _Raising())
    monkeypatch.setattr(mock_backend, "load_kv_connector", lambda name: _Raising())
    async with AsyncLLM(
        backend="mock",
        tokenizer="byte",
        multiprocess=False,
        num_kv_blocks=64,
        kv_offload_bytes="1MiB",
        kv_connector="raising",
        backend_options={"num_layers": 2, "num_kv_heads": 1, "head_size": 8},
    ) as engine:
        with pytest.raises(InvalidRequestError, match="KV connector 'raising'.*unreachable"):
            async for _ in engine.generate(
                {"prompt_token_ids": [7, 8, 9]}, PARAMS, request_id="bad"
            ):
                pass
        good = None
        async for out in engine.generate(
            {"prompt_token_ids": [1, 2, 3]}, PARAMS, request_id="good"
        ):
            good = out
        assert good is not None and good.outputs[0].token_ids == [4, 5, 6, 7]
        await engine.check_health()
