"""The scheduler with LoRA: the adapter in every block key, the max_loras cap (running adapters
first, others wait and are not dropped, a bounded bypass), adapters that are not loaded."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from helpers.core import make_scheduler

from engine_core._core.block_hash import block_digests
from engine_core._core.request import Request
from engine_core._core.scheduler import Scheduler
from engine_core.abc import ModelRunnerOutput, SchedulerOutput
from engine_core.lora import LoRARequest
from engine_core.sampling_params import SamplingParams

BS = 16
_serial = itertools.count(1)


def lora(i: int) -> LoRARequest:
    return LoRARequest(f"adapter-{i}", i, f"/adapters/{i}")


def request(
    req_id: str,
    adapter: int = 0,
    *,
    prompt: list[int] | None = None,
    max_tokens: int = 4,
    cache_salt: str | None = None,
) -> Request:
    if prompt is None:
        base = 1000 * next(_serial)
        prompt = [base + i for i in range(10)]
    return Request(
        req_id,
        prompt,
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        block_size=BS,
        cache_salt=cache_salt,
        lora_request=lora(adapter) if adapter else None,
    )


def lora_scheduler(max_loras: int, ready: set[int] | None = None, **knobs: object) -> Scheduler:
    scheduler = make_scheduler(enable_lora=True, max_loras=max_loras, **knobs)
    scheduler.lora_ready = ready if ready is not None else set(range(1, 100))
    return scheduler


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule and apply a step whose every completing request samples token 7."""
    out = scheduler.schedule()
    apply_step(scheduler, out)
    return out


def apply_step(scheduler: Scheduler, out: SchedulerOutput) -> None:
    sampled = [
        [7] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else []
        for r in out.req_ids
    ]
    scheduler.update_from_output(out, ModelRunnerOutput(out.req_ids, sampled))


def adapters_of(scheduler: Scheduler, out: SchedulerOutput) -> set[int]:
    ids = set(out.cached.req_ids) | {r.req_id for r in out.new_reqs}
    return {scheduler.requests[r].lora_int_id for r in ids if r in scheduler.requests} - {0}


def test_block_keys_differ_per_adapter_and_from_base_and_keep_the_salt() -> None:
    prompt = list(range(3 * BS))
    keys = {
        name: request(name, adapter, prompt=prompt, cache_salt=salt).block_keys[0]
        for name, adapter, salt in [
            ("base", 0, None),
            ("a", 1, None),
            ("b", 2, None),
            ("a-salted", 1, "s"),
            ("base-salted", 0, "s"),
        ]
    }
    assert len(set(keys.values())) == len(keys)
    # Every block of the chain differs, not only the first.
    a, b = request("a2", 1, prompt=prompt), request("b2", 2, prompt=prompt)
    assert not set(a.block_keys) & set(b.block_keys)
    assert len(a.block_keys) == 3
    # The same adapter, the same keys (a prefix is shared within an adapter).
    assert request("a3", 1, prompt=prompt).block_keys == a.block_keys
    # The router's digests agree with the engine's keys.
    digests = block_digests(prompt, BS, 3, None, lora(1).key_bytes())
    assert digests != block_digests(prompt, BS, 3)


def test_key_bytes_are_built_once_per_adapter_and_tell_every_field_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine_core import lora as lora_module

    a = LoRARequest("a", 1, "/p")
    assert a.key_bytes() is LoRARequest("a", 1, "/p").key_bytes()  # an equal copy (the wire)
    others = [LoRARequest("b", 1, "/p"), LoRARequest("a", 2, "/p"), LoRARequest("a", 1, "/q")]
    assert len({a.key_bytes(), *(o.key_bytes() for o in others)}) == 4
    monkeypatch.setattr(lora_module, "_MAX_KEYS_KEPT", 2)
    lora_module._KEY_BYTES.clear()
    for i in range(1, 6):
        assert LoRARequest("x", i, "/x").key_bytes() == b"\x00lora\x00%d\x00x\x00/x" % i
        assert len(lora_module._KEY_BYTES) <= 2  # bounded


def test_prefix_blocks_are_never_shared_across_adapters() -> None:
    scheduler = lora_scheduler(4)
    prompt = list(range(100, 100 + 3 * BS + 2))
    for name, adapter in [("first", 1), ("other", 2), ("base", 0), ("again", 1)]:
        scheduler.add_request(request(name, adapter, prompt=prompt, max_tokens=1))
        while scheduler.has_unfinished_requests():
            run_step(scheduler)
    assert scheduler.kv.stats.hits == 3 * BS  # only "again" hit: three full blocks of "first"


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_cap_is_never_exceeded_and_others_wait(policy: str) -> None:
    scheduler = lora_scheduler(2, scheduling_policy=policy)
    for i in range(12):
        scheduler.add_request(request(f"r{i}", 1 + i % 4, max_tokens=3 + i % 3))
    seen: set[int] = set()
    steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        used = adapters_of(scheduler, out)
        assert len(out.lora_ids) <= 2 and used <= set(out.lora_ids)
        assert len(scheduler.lora_running) <= 2
        # Exactly the step's adapters (every running request is scheduled here), sorted, as
        # the set changes from step to step.
        assert list(out.lora_ids) == sorted(used)
        apply_step(scheduler, out)
        seen |= used
        steps += 1
        assert steps < 200
    assert seen == {1, 2, 3, 4}  # every adapter ran: those waiting were not dropped
    assert not scheduler.lora_users and not scheduler.lora_running


def test_running_adapters_count_first() -> None:
    scheduler = lora_scheduler(1)
    scheduler.add_request(request("a-first", 1, max_tokens=50))
    run_step(scheduler)
    scheduler.add_request(request("b-waits", 2))
    scheduler.add_request(request("a-joins", 1))
    out = run_step(scheduler)
    assert [r.req_id for r in out.new_reqs] == ["a-joins"]
    assert out.lora_ids == (1,)
    assert scheduler.requests["b-waits"] in list(scheduler.waiting)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_queue_is_not_walked_past_its_last_request_of_a_running_adapter(policy: str) -> None:
    """With the cap bound, the requests of capped adapters are looked at only up to the last
    one that could run: behind it every request waits for a slot, and the scan stops (a queue
    of thousands of capped requests costs a step nothing). Those that could run are admitted
    wherever they are in the queue."""
    scheduler = lora_scheduler(2, max_num_seqs=64, scheduling_policy=policy)
    scheduler.add_request(request("a0", 1, max_tokens=100))
    scheduler.add_request(request("b0", 2, max_tokens=100))
    run_step(scheduler)
    for i in range(40):  # capped adapters 3 and 4, with two of adapter 1 and base among them
        scheduler.add_request(request(f"c{i}", 3 + i % 2))
        if i in (5, 20):
            scheduler.add_request(request(f"a-join{i}", 1))
        if i == 12:
            scheduler.add_request(request("base", 0))
    popped: list[Request] = []  # every request taken off the queue, in order
    waiting = scheduler.waiting
    pop, take_capped = waiting.pop, waiting.take_capped

    def counting_pop() -> Request:
        popped.append(pop())
        return popped[-1]

    def counting_take_capped(*args: Any) -> list[Request]:
        run = take_capped(*args)
        popped.extend(run)
        return run

    waiting.pop = counting_pop  # type: ignore[method-assign]
    waiting.take_capped = counting_take_capped  # type: ignore[method-assign]
    out = run_step(scheduler)
    assert sorted(r.req_id for r in out.new_reqs) == ["a-join20", "a-join5", "base"]
    # (The priority queue's take_capped pops through pop(): each counted once.)
    looked_at = list(dict.fromkeys(r.request_id for r in popped))
    assert looked_at[-1] == "a-join20"  # nothing behind the last one that could run
    assert len(looked_at) == 24
    assert len(scheduler.waiting) == 40 and scheduler.waiting.lora_counts == {3: 20, 4: 20}
    left = [r.request_id for r in scheduler.waiting]
    if policy == "priority":  # equal arrival times here: ties go by when they were re-queued
        left.sort(key=lambda name: int(name[1:]))
    assert left == [f"c{i}" for i in range(40)]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_blocked_adapter_is_overtaken_for_at_most_max_bypass_steps(policy: str) -> None:
    scheduler = lora_scheduler(1, max_bypass_steps=3, scheduling_policy=policy)
    scheduler.add_request(request("a0", 1, max_tokens=1000))
    run_step(scheduler)
    scheduler.add_request(request("b", 2))
    admitted_a = 0
    for i in range(10):
        scheduler.add_request(request(f"a{i + 1}", 1, max_tokens=1000))
        out = run_step(scheduler)
        admitted_a += sum(1 for r in out.new_reqs if r.req_id.startswith("a"))
    assert admitted_a == 3  # then nothing overtakes "b": adapter 1 drains for it
    scheduler.finish_requests([r.request_id for r in scheduler.running])
    out = run_step(scheduler)
    assert [r.req_id for r in out.new_reqs] == ["b"]
    assert out.lora_ids == (2,)


def test_a_request_waits_for_its_adapter_to_load() -> None:
    ready: set[int] = set()
    scheduler = lora_scheduler(2, ready)
    scheduler.add_request(request("lora", 1))
    scheduler.add_request(request("base"))
    out = run_step(scheduler)
    assert [r.req_id for r in out.new_reqs] == ["base"]
    ready.add(1)
    out = run_step(scheduler)
    assert [(r.req_id, r.lora_int_id) for r in out.new_reqs] == [("lora", 1)]
    assert out.lora_ids == (1,)


def test_a_preempted_request_keeps_its_adapter() -> None:
    scheduler = lora_scheduler(2, num_blocks=8)
    scheduler.add_request(request("a", 1, prompt=list(range(3 * BS)), max_tokens=60))
    scheduler.add_request(request("b", 2, prompt=list(range(500, 500 + 3 * BS)), max_tokens=60))
    resumed = []
    for _ in range(100):
        out = run_step(scheduler)
        assert len(scheduler.lora_running) <= 2
        resumed += [(r.req_id, r.lora_int_id) for r in out.new_reqs if r.output_token_ids]
        if resumed:
            break
    assert resumed and resumed[0][1] == {"a": 1, "b": 2}[resumed[0][0]]
    assert scheduler.num_preemptions >= 1


def test_lora_off_refuses_a_lora_request() -> None:
    scheduler = make_scheduler()
    try:
        scheduler.add_request(request("x", 1))
    except ValueError as e:
        assert "LoRA is off" in str(e)
    else:
        raise AssertionError("accepted")


def test_lora_ids_drop_an_adapter_whose_last_request_ended() -> None:
    scheduler = lora_scheduler(4)
    scheduler.add_request(request("short", 1, max_tokens=1))
    scheduler.add_request(request("long", 2, max_tokens=4))
    out = scheduler.schedule()
    assert out.lora_ids == (1, 2)
    apply_step(scheduler, out)  # "short" ends: adapter 1 runs no more, and nothing replaces it
    assert scheduler.schedule().lora_ids == (2,)
