"""Multi-LoRA serving end to end on the mock: adapters told apart in one batch, prefix caching
per adapter, the adapter cache (LRU, pins), the control calls over LLM and AsyncLLM (in process
and in their own process), every bad input, removal with requests in flight, and
``engine_core.testing.check_lora`` on the mock and on broken backends."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from engine_core_mock import MockBackend
from helpers.lora_adapters import make_adapter

from engine_core import (
    LLM,
    AsyncLLM,
    EngineConfig,
    LoRAError,
    LoRARequest,
    RequestOutputKind,
    SamplingParams,
)
from engine_core.testing import check_lora

pytestmark = pytest.mark.timeout(60)

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [10, 11, 12]


def expected(offset: int, n: int = 4, last: int = PROMPT[-1]) -> list[int]:
    out = []
    for _ in range(n):
        last = last + 1 + offset
        out.append(last)
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    made = {f"a{i}": make_adapter(root, f"a{i}", i, offset=i) for i in range(1, 7)}
    made["zero"] = make_adapter(root, "zero", 20)  # no mock.json: the base model's tokens
    made["big-rank"] = make_adapter(root, "big-rank", 30, rank=64)
    made["mlp-only"] = make_adapter(root, "mlp-only", 31, target_modules=["gate_proj"])
    made["other-arch"] = make_adapter(
        root, "other-arch", 32, auto_mapping={"base_model_class": "GPT2LMHeadModel"}
    )
    made["missing"] = LoRARequest("missing", 33, str(root / "nope"))
    return made


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(
        backend="mock",
        tokenizer="byte",
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=3,
        backend_options={"lora": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}},
    ) as engine:
        yield engine


def tokens(outs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def reset(llm: LLM) -> None:
    for lora_id in llm.list_loras():
        llm.remove_lora(lora_id)


def test_mock_offsets_tell_adapters_apart_in_one_mixed_batch(
    llm: LLM, adapters: dict[str, LoRARequest]
) -> None:
    reset(llm)
    a1, a2 = adapters["a1"], adapters["a2"]
    llm.add_lora(a1)
    llm.add_lora(a2)  # both loaded: the five requests run in one batch
    outs = llm.generate(
        [{"prompt_token_ids": PROMPT}] * 5,
        GREEDY,
        lora_request=[None, a1, a2, a1, None],
        use_tqdm=False,
    )
    assert tokens(outs) == [expected(0), expected(1), expected(2), expected(1), expected(0)]
    assert llm.list_loras() == {1, 2}
    core = llm._client.engine_core  # type: ignore[attr-defined]
    assert core.backend.max_loras_in_step == 2


def test_prefix_cache_is_per_adapter_and_cache_salt_still_applies(
    llm: LLM, adapters: dict[str, LoRARequest]
) -> None:
    reset(llm)
    llm.reset_prefix_cache()
    prompt = {"prompt_token_ids": list(range(1, 70))}  # four full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def cached(lora: LoRARequest | None) -> int:
        return llm.generate(prompt, params, lora_request=lora, use_tqdm=False)[0].num_cached_tokens

    assert cached(adapters["zero"]) == 0
    assert cached(None) == 0  # same tokens as the adapter "zero", never its blocks
    assert cached(adapters["a1"]) == 0
    assert cached(adapters["zero"]) == 64
    assert cached(None) == 64
    core = llm._client.engine_core  # type: ignore[attr-defined]
    from engine_core._core.engine_io import EngineCoreRequest

    salted = EngineCoreRequest(
        "salted", prompt["prompt_token_ids"], params, cache_salt="s", lora_request=adapters["a1"]
    )
    core.add_request(salted)
    out = core.step()
    while not out.finished:
        out = core.step()
    assert out.num_cached_tokens.get("salted", 0) == 0


def test_the_cap_holds_in_the_engine_and_no_request_is_dropped(
    llm: LLM, adapters: dict[str, LoRARequest]
) -> None:
    reset(llm)
    loras = [adapters[f"a{i}"] for i in (1, 2, 3)]
    n = 12
    outs = llm.generate(
        [{"prompt_token_ids": PROMPT}] * n,
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        lora_request=[loras[i % 3] for i in range(n)],
        use_tqdm=False,
    )
    assert tokens(outs) == [expected(loras[i % 3].lora_int_id, 6) for i in range(n)]
    core = llm._client.engine_core  # type: ignore[attr-defined]
    assert core.backend.max_loras_in_step <= 2  # three adapters wanted, never more than two


def test_lru_of_max_cpu_loras_and_pin_lora(llm: LLM, adapters: dict[str, LoRARequest]) -> None:
    reset(llm)
    a1, a2, a3, a4 = (adapters[f"a{i}"] for i in (1, 2, 3, 4))
    for a in (a1, a2, a3):
        assert llm.add_lora(a)
    assert llm.list_loras() == {1, 2, 3}
    llm.generate({"prompt_token_ids": PROMPT}, GREEDY, lora_request=a1, use_tqdm=False)  # a1 used
    assert llm.pin_lora(2)
    outs = llm.generate({"prompt_token_ids": PROMPT}, GREEDY, lora_request=a4, use_tqdm=False)
    assert tokens(outs) == [expected(4)]
    assert llm.list_loras() == {1, 2, 4}  # a3, least recently used and not pinned, went
    llm.add_lora(a3)  # evicts a1 (a2 is pinned, a4 is more recent)
    assert llm.list_loras() == {2, 3, 4}
    core = llm._client.engine_core  # type: ignore[attr-defined]
    core.lora._executor.submit(lambda: None).result()  # the loader thread's removals ran
    assert core.backend.loras.offsets.keys() == {2, 3, 4}
    with pytest.raises(ValueError, match="lora_int_id 9"):
        llm.pin_lora(9)
    assert llm.remove_lora(2) and not llm.remove_lora(2)
    assert llm.list_loras() == {3, 4}


def test_every_pinned_slot_refuses_a_new_adapter_clearly(
    llm: LLM, adapters: dict[str, LoRARequest]
) -> None:
    reset(llm)
    for i in (1, 2, 3):
        llm.add_lora(adapters[f"a{i}"])
        llm.pin_lora(i)
    with pytest.raises(LoRAError, match="pinned") as info:
        llm.add_lora(adapters["a4"])
    assert info.value.lora_name == "a4"
    out = llm.generate(
        {"prompt_token_ids": PROMPT}, GREEDY, lora_request=adapters["a4"], use_tqdm=False
    )[0]
    assert out.outputs[0].finish_reason == "error" and "pinned" in (out.error or "")
    reset(llm)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("missing", "does not exist"),
        ("big-rank", "rank 64 is above max_lora_rank (16)"),
        ("mlp-only", "target modules ['gate_proj'] are not served"),
        ("other-arch", "base architecture GPT2LMHeadModel"),
    ],
)
def test_bad_adapters_fail_alone_naming_the_adapter(
    llm: LLM, adapters: dict[str, LoRARequest], name: str, reason: str
) -> None:
    reset(llm)
    bad = adapters[name]
    with pytest.raises(LoRAError, match=re.escape(reason)) as info:
        llm.add_lora(bad)
    assert info.value.lora_name == name and name in str(info.value)
    outs = llm.generate(
        [{"prompt_token_ids": PROMPT}] * 3,
        GREEDY,
        lora_request=[adapters["a1"], bad, None],
        use_tqdm=False,
    )
    assert outs[1].outputs[0].finish_reason == "error"
    assert name in (outs[1].error or "") and reason in (outs[1].error or "")
    assert tokens([outs[0], outs[2]]) == [expected(1), expected(0)]
    assert bad.lora_int_id not in llm.list_loras()


def test_one_id_for_two_adapters_is_refused(llm: LLM, adapters: dict[str, LoRARequest]) -> None:
    reset(llm)
    llm.add_lora(adapters["a1"])
    impostor = LoRARequest("impostor", 1, adapters["a2"].lora_path)
    with pytest.raises(LoRAError, match="lora_int_id 1 is in use by adapter 'a1'"):
        llm.add_lora(impostor)
    out = llm.generate({"prompt_token_ids": PROMPT}, GREEDY, lora_request=impostor, use_tqdm=False)
    assert "impostor" in (out[0].error or "")


def test_lora_request_validation() -> None:
    with LLM(backend="mock", tokenizer="byte") as plain:
        with pytest.raises(LoRAError, match="LoRA is off") as info:
            plain.generate("x", GREEDY, lora_request=LoRARequest("a", 1, "/x"), use_tqdm=False)
        assert info.value.lora_name == "a"
        with pytest.raises(LoRAError, match="LoRA is off"):
            plain.add_lora(LoRARequest("a", 1, "/x"))
        with pytest.raises(TypeError, match="lora_request"):
            plain.generate("x", GREEDY, lora_request="a", use_tqdm=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/x")
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineConfig(max_lora_rank=0)
    # Positional in vLLM's order, and over the wire.
    lora = LoRARequest("n", 3, "/p")
    assert (lora.lora_name, lora.lora_int_id, lora.lora_path) == ("n", 3, "/p")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(lora), type=LoRARequest) == lora


def test_a_backend_without_lora_support_refuses_enable_lora() -> None:
    class NoLoRA(MockBackend):
        def lora_support(self) -> None:
            return None

    from engine_core._engine.core import EngineCore

    with pytest.raises(ValueError, match="enable_lora=True but the mock backend"):
        EngineCore(
            EngineConfig(backend="mock", tokenizer="byte", enable_lora=True), backend_cls=NoLoRA
        )


def test_multiprocess_llm_control_calls_and_errors(adapters: dict[str, LoRARequest]) -> None:
    with LLM(
        backend="mock",
        tokenizer="byte",
        enable_lora=True,
        max_loras=2,
        multiprocess=True,
        backend_options={"lora": {"load_s": 0.05}},
    ) as engine:
        assert engine.add_lora(adapters["a1"])
        assert engine.list_loras() == {1}
        with pytest.raises(LoRAError, match="does not exist") as info:
            engine.add_lora(adapters["missing"])
        assert info.value.lora_name == "missing"
        outs = engine.generate(
            [{"prompt_token_ids": PROMPT}] * 3,
            GREEDY,
            lora_request=[adapters["a1"], adapters["a2"], None],
            use_tqdm=False,
        )
        assert tokens(outs) == [expected(1), expected(2), expected(0)]
        assert engine.pin_lora(2)
        assert engine.remove_lora(1)
        assert engine.list_loras() == {2}


@pytest.mark.anyio
@pytest.mark.parametrize("multiprocess", [False, True])
async def test_async_llm_adapters_and_control_calls(
    adapters: dict[str, LoRARequest], multiprocess: bool
) -> None:
    async with AsyncLLM(
        backend="mock", tokenizer="byte", enable_lora=True, max_loras=2, multiprocess=multiprocess
    ) as engine:
        assert await engine.add_lora(adapters["a1"])
        assert await engine.list_loras() == {1}
        results: dict[str, list[int]] = {}

        async def run(name: str, lora: LoRARequest | None) -> None:
            async for out in engine.generate(
                {"prompt_token_ids": PROMPT}, GREEDY, request_id=name, lora_request=lora
            ):
                results[name] = list(out.outputs[0].token_ids)

        async with anyio.create_task_group() as tg:
            for name, lora in [("a1", adapters["a1"]), ("a3", adapters["a3"]), ("base", None)]:
                tg.start_soon(run, name, lora)
        assert results == {"a1": expected(1), "a3": expected(3), "base": expected(0)}
        with pytest.raises(LoRAError, match="rank 64") as info:
            await engine.add_lora(adapters["big-rank"])
        assert info.value.lora_name == "big-rank"
        assert await engine.pin_lora(3)
        assert await engine.remove_lora(1)
        assert await engine.list_loras() == {3}


@pytest.mark.anyio
async def test_removing_an_adapter_with_requests_in_flight_lets_them_finish(
    adapters: dict[str, LoRARequest],
) -> None:
    async with AsyncLLM(
        backend="mock",
        tokenizer="byte",
        enable_lora=True,
        max_loras=2,
        multiprocess=False,
        backend_options={"latency": {"step_s": 0.002}},
    ) as engine:
        a2 = adapters["a2"]
        params = SamplingParams(
            temperature=0.0, max_tokens=30, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        got: list[int] = []
        removed = False
        async for out in engine.generate(
            {"prompt_token_ids": [1]}, params, request_id="r", lora_request=a2
        ):
            got += out.outputs[0].token_ids
            if not removed:
                assert await engine.remove_lora(2)
                removed = True
                assert await engine.list_loras() == set()
        assert got == expected(2, 30, last=1)
        backend = engine._client.engine_core.backend  # type: ignore[union-attr]
        for _ in range(50):
            if 2 not in backend.loras.offsets:
                break
            await anyio.sleep(0.01)
        assert 2 not in backend.loras.offsets  # removed from the backend once it ended


def test_check_lora_passes_on_the_mock(adapters: dict[str, LoRARequest]) -> None:
    check_lora(MockBackend, [adapters["a1"], adapters["a2"]])


class _IgnoresAdapters(MockBackend):
    """Loads adapters and never applies them."""

    def add_lora(self, lora: LoRARequest) -> None:
        super().add_lora(lora)
        self.loras.offsets[lora.lora_int_id] = 0


class _RemovesAll(MockBackend):
    """remove_lora forgets every adapter."""

    def remove_lora(self, lora_int_id: int) -> None:
        for i in list(self.loras.offsets):
            self.loras.offsets[i] = 0


class _AcceptsAnything(MockBackend):
    def add_lora(self, lora: LoRARequest) -> None:
        try:
            super().add_lora(lora)
        except LoRAError:
            self.loras.offsets[lora.lora_int_id] = 0


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (_IgnoresAdapters, "the adapter is not applied"),
        (_RemovesAll, "after 'a1' was removed"),
        (_AcceptsAnything, "add_lora accepted 'missing-adapter'"),
    ],
)
def test_check_lora_catches_a_broken_backend(
    adapters: dict[str, LoRARequest], broken: type[MockBackend], message: str
) -> None:
    with pytest.raises(AssertionError, match=message):
        check_lora(broken, [adapters["a1"], adapters["a2"]])


def test_mock_reads_mock_json_and_rejects_a_bad_one(tmp_path: Path) -> None:
    lora = make_adapter(tmp_path, "bad-json", 1)
    (Path(lora.lora_path) / "mock.json").write_text(json.dumps({"offset": "x"}))
    backend = MockBackend(EngineConfig(tokenizer="byte", enable_lora=True))
    with pytest.raises(LoRAError, match="offset must be an int"):
        backend.add_lora(lora)
    backend.close()


def test_the_mock_refuses_a_step_naming_an_adapter_removed_since_the_step_before(
    tmp_path: Path,
) -> None:
    from engine_core.abc import CachedRequestData, NewRequestData, SchedulerOutput
    from engine_core.sampling_params import SamplingParams

    backend = MockBackend(EngineConfig(tokenizer="byte", enable_lora=True, block_size=4))
    backend.initialize_kv_cache(16)
    backend.add_lora(make_adapter(tmp_path, "a", 1))
    params = SamplingParams(temperature=0.0)
    new = NewRequestData("r", [5, 6, 7], params, [0, 1], 0, 3, lora_int_id=1)

    def run(new_reqs: list[NewRequestData], cached: CachedRequestData, total: int) -> None:
        backend.execute_model(SchedulerOutput(new_reqs, cached, total, lora_ids=(1,)))
        backend.sample_tokens(None)

    run([new], CachedRequestData([], [], [], []), 3)
    run([], CachedRequestData(["r"], [None], [3], [1]), 1)  # the same adapters: passed
    backend.remove_lora(1)
    with pytest.raises(RuntimeError, match="adapter 1, which is not loaded"):
        run([], CachedRequestData(["r"], [None], [4], [1]), 1)
    backend.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the data-parallel path; one runtime
async def test_data_parallel_engines_serve_adapters(adapters: dict[str, LoRARequest]) -> None:
    async with AsyncLLM(
        backend="mock", tokenizer="byte", enable_lora=True, max_loras=2, data_parallel_size=2
    ) as engine:
        assert await engine.add_lora(adapters["a1"])
        assert await engine.list_loras() == {1}
        results = {}
        for name, lora in [("a1", adapters["a1"]), ("a2", adapters["a2"]), ("base", None)]:
            async for out in engine.generate(
                {"prompt_token_ids": PROMPT}, GREEDY, request_id=name, lora_request=lora
            ):
                results[name] = list(out.outputs[0].token_ids)
        assert results == {"a1": expected(1), "a2": expected(2), "base": expected(0)}
        assert await engine.pin_lora(1)
        assert await engine.remove_lora(1)
        stats = await engine.get_stats()
        assert "a1" not in stats.lora_loaded
