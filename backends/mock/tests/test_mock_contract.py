"""The mock as a strict backend: contract checks, lifecycle, faults and the latency model."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from engine_core_mock import FAULT_EXIT_CODE, MockBackend
from mock_driver import Driver, FakeTime

from engine_core.abc import CachedRequestData, SchedulerOutput
from engine_core.config import EngineConfig

# -- contract violations -------------------------------------------------------------------------


def test_unknown_cached_request_raises() -> None:
    d = Driver()
    with pytest.raises(RuntimeError, match="cached request 'ghost' is unknown to the backend"):
        d.step(cached=[("ghost", 3, 1, None)])


def test_num_computed_mismatch_raises() -> None:
    d = Driver()
    d.step(new=[d.new("r", [1, 2, 3])])
    with pytest.raises(
        RuntimeError,
        match="request 'r': the scheduler says 2 tokens are computed, the backend computed 3",
    ):
        d.step(cached=[("r", 2, 1, None)])


def test_scheduling_tokens_the_backend_does_not_know_raises() -> None:
    d = Driver()
    d.step(new=[d.new("r", [1, 2, 3])])
    with pytest.raises(RuntimeError, match="cannot schedule 2 tokens after 3 computed ones"):
        d.step(cached=[("r", 3, 2, None)])


def test_block_table_too_short_raises() -> None:
    d = Driver(block_size=4)
    with pytest.raises(RuntimeError, match="a block table of 1 blocks cannot hold 5 tokens"):
        d.step(new=[d.new("new", [1, 2, 3, 4, 5], blocks=[0])])
    d = Driver(block_size=4)
    d.step(new=[d.new("r", [1, 2, 3, 4], blocks=[0])])
    with pytest.raises(RuntimeError, match="a block table of 1 blocks cannot hold 5 tokens"):
        d.step(cached=[("r", 4, 1, None)])


def test_growing_block_table_is_accepted() -> None:
    d = Driver(block_size=4)
    d.step(new=[d.new("r", [1, 2, 3, 4], blocks=[0])])
    assert d.step(cached=[("r", 4, 1, [7])]).sampled_token_ids == [[6]]


def test_block_id_outside_the_cache_raises() -> None:
    d = Driver(num_blocks=8)
    with pytest.raises(RuntimeError, match="block id 8 is outside the KV cache"):
        d.step(new=[d.new("r", [1], blocks=[8])])


def test_block_held_by_a_live_request_raises() -> None:
    d = Driver(block_size=4)
    d.step(new=[d.new("a", [1, 2], blocks=[3])])
    with pytest.raises(
        RuntimeError, match=r"block 3 \(position 0\) is still held by live request\(s\) \['a'\]"
    ):
        d.step(new=[d.new("b", [5, 6], blocks=[3])], cached=[("a", 2, 1, None)])


def test_prefix_cache_hit_on_a_different_prefix_raises() -> None:
    d = Driver(block_size=4)
    d.step(new=[d.new("a", [1, 2, 3, 4, 5], blocks=[0, 1])])
    with pytest.raises(RuntimeError, match="holds the KV of a different token prefix"):
        d.step(new=[d.new("b", [1, 2, 3, 9, 5], computed=4, blocks=[0, 2])])


def test_prefix_cache_hit_on_an_unwritten_block_raises() -> None:
    d = Driver(block_size=4)
    d.step(new=[d.new("a", [1, 2, 3, 4, 5], scheduled=2, blocks=[0, 1])])
    with pytest.raises(RuntimeError, match="no request has finished writing it"):
        d.step(new=[d.new("b", [1, 2, 3, 4, 6], computed=4, blocks=[0, 2])])


def test_shared_prefix_blocks_are_accepted_while_both_requests_live() -> None:
    d = Driver(block_size=4)
    d.step(new=[d.new("a", [1, 2, 3, 4, 5], blocks=[0, 1])])
    output = d.step(
        new=[d.new("b", [1, 2, 3, 4, 9], computed=4, blocks=[0, 2])], cached=[("a", 5, 1, None)]
    )
    assert output.sampled_token_ids == [[7], [10]]


def test_finished_blocks_keep_their_kv_for_later_hits() -> None:
    d = Driver(block_size=4)
    d.step(new=[d.new("a", [1, 2, 3, 4, 5], blocks=[0, 1])])
    output = d.step(new=[d.new("b", [1, 2, 3, 4, 8], computed=4, blocks=[0, 1])], finished=["a"])
    assert output.sampled_token_ids == [[9]]
    assert d.backend.live_request_ids == ["b"]


def test_hit_after_sleep_raises() -> None:
    d = Driver(block_size=4)
    d.step(new=[d.new("a", [1, 2, 3, 4, 5], blocks=[0, 1])])
    d.backend.sleep()
    d.backend.wake_up()
    with pytest.raises(RuntimeError, match=r"its KV was discarded by sleep\(\)"):
        d.step(new=[d.new("b", [1, 2, 3, 4, 8], computed=4, blocks=[0, 2])], finished=["a"])


def test_live_request_id_sent_as_new_raises() -> None:
    d = Driver()
    d.step(new=[d.new("r", [1])])
    with pytest.raises(RuntimeError, match="new request 'r' is already live in the backend"):
        d.step(new=[d.new("r", [2])])


def test_finished_and_preempted_requests_are_dropped() -> None:
    d = Driver()
    d.step(new=[d.new("a", [1]), d.new("b", [2]), d.new("c", [3])])
    output = d.step(
        new=[d.new("a", [40]), d.new("b", [2], outputs=[3, 9])],
        cached=[("c", 1, 1, None)],
        finished=["a", "never-seen"],
        preempted=["b"],
    )
    assert output.sampled_token_ids == [[5], [41], [10]]
    assert d.backend.live_request_ids == ["c", "a", "b"]


def test_wrong_total_raises() -> None:
    d = Driver()
    with pytest.raises(RuntimeError, match="total_num_scheduled_tokens is 5 but the batch"):
        d.step(new=[d.new("r", [1, 2])], total=5)


def test_out_of_vocabulary_prompt_raises() -> None:
    d = Driver()
    with pytest.raises(RuntimeError, match=r"token ids outside the vocabulary \(size 258\)"):
        d.step(new=[d.new("r", [1, 258])])


# -- lifecycle -----------------------------------------------------------------------------------


def test_sample_tokens_needs_execute_model() -> None:
    d = Driver()
    with pytest.raises(RuntimeError, match="without a preceding execute_model"):
        d.backend.sample_tokens(None)
    d.step(new=[d.new("r", [1])])
    with pytest.raises(RuntimeError, match="without a preceding execute_model"):
        d.backend.sample_tokens(None)


def test_execute_model_twice_raises() -> None:
    d = Driver()
    d.backend.execute_model(SchedulerOutput([d.new("r", [1])], CachedRequestData(), 1))
    with pytest.raises(RuntimeError, match="execute_model called twice"):
        d.backend.execute_model(SchedulerOutput([], CachedRequestData(["r"], [None], [1], [1]), 1))


def test_execute_model_before_initialize_kv_cache_raises() -> None:
    backend = MockBackend(EngineConfig())
    with pytest.raises(RuntimeError, match=r"before initialize_kv_cache\(\)"):
        backend.execute_model(SchedulerOutput([], CachedRequestData(), 0))


def test_sleeping_backend_refuses_to_execute_until_woken() -> None:
    d = Driver()
    d.backend.sleep(level=2)
    assert d.backend.is_sleeping
    with pytest.raises(RuntimeError, match="while the backend sleeps"):
        d.step(new=[d.new("r", [1])])
    d.backend.wake_up()
    assert d.step(new=[d.new("s", [1])]).sampled_token_ids == [[2]]


def test_sleep_level_is_validated() -> None:
    with pytest.raises(ValueError, match="level must be 1 or 2, got 3"):
        Driver().backend.sleep(3)


def test_profile_flips_a_flag() -> None:
    backend = Driver().backend
    backend.profile("start")
    assert backend.is_profiling
    backend.profile("stop")
    assert not backend.is_profiling
    with pytest.raises(ValueError, match="action must be 'start' or 'stop', got 'pause'"):
        backend.profile("pause")


def test_closed_backend_refuses_to_execute() -> None:
    d = Driver()
    d.step(new=[d.new("r", [1])])
    d.backend.close()
    assert d.backend.live_request_ids == []
    with pytest.raises(RuntimeError, match=r"after close\(\)"):
        d.step(new=[d.new("s", [1])])


def test_initialize_kv_cache_validates_the_block_count() -> None:
    backend = MockBackend(EngineConfig())
    with pytest.raises(ValueError, match="num_blocks must be an int > 0, got 0"):
        backend.initialize_kv_cache(0)
    backend.initialize_kv_cache(5)
    assert backend.num_kv_blocks == 5


# -- faults --------------------------------------------------------------------------------------


def test_raise_fault_fires_at_its_step() -> None:
    d = Driver(fault={"kind": "raise", "at_step": 2})
    assert d.step(new=[d.new("r", [1])]).sampled_token_ids == [[2]]
    with pytest.raises(RuntimeError, match="mock fault injected: raise at step 2"):
        d.decode(["r"])


def test_exit_fault_ends_the_process_with_status_13() -> None:
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from mock_driver import Driver; "
        "d = Driver(fault={'kind': 'exit', 'at_step': 2}); d.step(new=[d.new('r', [1])]); "
        "print('first step ran', flush=True); d.decode(['r']); print('not reached')"
    )
    here = __file__.rsplit("/", 1)[0]
    result = subprocess.run(
        [sys.executable, "-c", script, here], capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stdout) == (FAULT_EXIT_CODE, "first step ran\n")
    assert FAULT_EXIT_CODE == 13


def test_hang_fault_blocks_execute_model() -> None:
    d = Driver(fault={"kind": "hang", "at_step": 1})
    thread = threading.Thread(target=d.step, kwargs={"new": [d.new("r", [1])]}, daemon=True)
    thread.start()
    thread.join(timeout=0.2)
    assert thread.is_alive()


def test_freeze_fault_blocks_the_whole_process() -> None:
    # Once the step thread freezes, the main thread never runs Python again: it cannot go on
    # to print and exit (0.3 s later, if it could).
    script = (
        "import sys, threading, time; sys.path.insert(0, sys.argv[1]); "
        "from mock_driver import Driver; d = Driver(fault={'kind': 'freeze', 'at_step': 1}); "
        "t = threading.Thread(target=d.step, kwargs={'new': [d.new('r', [1])]}, daemon=True); "
        "print('freezing', flush=True); t.start(); time.sleep(0.01); t.join(0.3); "
        "print('not reached', flush=True)"
    )
    here = __file__.rsplit("/", 1)[0]
    process = subprocess.Popen(
        [sys.executable, "-c", script, here], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "freezing\n"
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=1.5)
    finally:
        process.kill()
        process.wait()


# -- latency -------------------------------------------------------------------------------------


def test_latency_model_sleeps_per_step_token_and_context_token() -> None:
    fake = FakeTime()
    slept = fake.slept
    latency = {"step_s": 0.5, "per_token_s": 0.25, "per_context_token_s": 0.125}
    d = Driver(latency=latency, sleep=fake.sleep, clock=fake.clock)
    d.step(new=[d.new("a", [1, 2, 3]), d.new("b", list(range(10)), scheduled=6)])
    d.step(cached=[("a", 3, 1, None), ("b", 6, 4, None)])
    # Step 1: 9 tokens scheduled, context 3 + 6. Step 2: 5 scheduled, context 4 + 10.
    assert slept == [0.5 + 0.25 * 9 + 0.125 * 9, 0.5 + 0.25 * 5 + 0.125 * 14]


def test_latency_model_takes_real_time() -> None:
    d = Driver(latency={"step_s": 0.05})
    start = time.perf_counter()
    d.step(new=[d.new("r", [1])])
    assert time.perf_counter() - start >= 0.05


def test_load_s_sleeps_at_construction() -> None:
    slept: list[float] = []
    d = Driver(load_s=0.25, sleep=slept.append)
    assert (d.backend.latency, d.backend.step_in_thread, slept) == (None, False, [0.25])


def test_no_latency_option_means_no_sleep() -> None:
    slept: list[float] = []
    d = Driver(latency={}, sleep=slept.append)
    d.step(new=[d.new("r", [1])])
    assert (d.backend.latency, slept) == (None, [])
