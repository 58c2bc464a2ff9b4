"""Waiting queues: FCFS and priority order, re-queueing at the front, lazy removal."""

from __future__ import annotations

import pytest
from helpers.core import make_request

from engine_core._core.request import Request, RequestStatus
from engine_core._core.request_queue import FCFSQueue, PriorityQueue, RequestQueue, make_queue


def abort(queue: RequestQueue, request: Request) -> None:
    request.set_status(RequestStatus.FINISHED_ABORTED)
    queue.discard(request)


def drain(queue: RequestQueue) -> list[str]:
    out = []
    while queue.peek() is not None:
        out.append(queue.pop().request_id)
    return out


def test_make_queue() -> None:
    assert isinstance(make_queue("fcfs"), FCFSQueue)
    assert isinstance(make_queue("priority"), PriorityQueue)
    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority'"):
        make_queue("lifo")


def test_fcfs_order_and_front() -> None:
    queue = FCFSQueue()
    a, b, c, d = (make_request(x) for x in "abcd")
    for r in (a, b, c):
        queue.add(r)
    assert len(queue) == 3
    assert queue.peek() is a
    assert queue.pop() is a
    queue.add_front(d)
    queue.add_front(a)
    assert [r.request_id for r in queue] == ["a", "d", "b", "c"]
    assert drain(queue) == ["a", "d", "b", "c"]
    assert len(queue) == 0
    assert queue.peek() is None
    with pytest.raises(IndexError):
        queue.pop()


def test_fcfs_lazy_removal() -> None:
    queue = FCFSQueue()
    a, b, c, d = (make_request(x) for x in "abcd")
    for r in (a, b, c, d):
        queue.add(r)
    abort(queue, b)
    abort(queue, a)
    assert len(queue) == 2
    assert [r.request_id for r in queue] == ["c", "d"]
    assert queue.peek() is c
    assert len(queue) == 2
    abort(queue, d)
    assert len(queue) == 1
    assert drain(queue) == ["c"]
    assert len(queue) == 0
    # The dead tail entry is dropped on the next peek.
    assert queue.peek() is None
    assert len(queue) == 0
    assert len(queue._queue) == 0


def test_fcfs_preempted_requests_stay_live() -> None:
    queue = FCFSQueue()
    request = make_request("a")
    request.status = RequestStatus.PREEMPTED
    queue.add_front(request)
    assert len(queue) == 1
    assert queue.pop() is request


def test_priority_order() -> None:
    """vLLM S17 orders, at queue level."""
    cases = [
        ([2, 0, 1], [1, 2, 3], ["1", "2", "0"]),
        ([0, 0, 0], [3, 1, 2], ["1", "2", "0"]),
        ([2, 1, 1, 0], [1, 3, 2, 4], ["3", "2", "1", "0"]),
    ]
    for priorities, arrivals, expected in cases:
        queue = PriorityQueue()
        for i, (p, t) in enumerate(zip(priorities, arrivals, strict=True)):
            queue.add(make_request(str(i), priority=p, arrival_time=float(t)))
        assert [r.request_id for r in queue] == expected
        assert drain(queue) == expected


def test_priority_ties_keep_insertion_order() -> None:
    queue = PriorityQueue()
    for x in "cab":
        queue.add(make_request(x, priority=1, arrival_time=5.0))
    assert drain(queue) == ["c", "a", "b"]


def test_priority_add_front_keeps_priority_order() -> None:
    queue = PriorityQueue()
    queue.add(make_request("hi", priority=0, arrival_time=2.0))
    preempted = make_request("lo", priority=5, arrival_time=1.0)
    preempted.status = RequestStatus.PREEMPTED
    queue.add_front(preempted)
    queue.add(make_request("mid", priority=3, arrival_time=3.0))
    assert drain(queue) == ["hi", "mid", "lo"]


def test_priority_lazy_removal() -> None:
    queue = PriorityQueue()
    reqs = [make_request(str(i), priority=i, arrival_time=float(i)) for i in range(4)]
    for r in reversed(reqs):
        queue.add(r)
    abort(queue, reqs[0])
    abort(queue, reqs[2])
    assert len(queue) == 2
    assert [r.request_id for r in queue] == ["1", "3"]
    assert queue.peek() is reqs[1]
    assert drain(queue) == ["1", "3"]
    assert len(queue) == 0
    assert queue._heap == []


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_live_requests_are_counted_per_adapter(policy: str) -> None:
    queue = make_queue(policy)
    requests = [make_request(f"r{i}", arrival_time=float(i)) for i in range(6)]
    for i, r in enumerate(requests):
        r.lora_int_id = i % 3  # the adapter's id; 0 is the base model
        queue.add(r)
    assert queue.lora_counts == {1: 2, 2: 2}
    assert queue.count_outside({1}) == 2 and queue.count_outside(()) == 4
    assert queue.count_outside({1, 2}) == 0 and queue.count_outside({7, 2}) == 2
    abort(queue, requests[1])  # adapter 1
    assert queue.lora_counts == {1: 1, 2: 2} and queue.num_lora == 3
    assert queue.count_outside({2}) == 1
    assert queue.pop() is requests[0]  # base: no count
    first = queue.pop()  # the aborted one is skipped, not counted twice
    assert first is requests[2] and queue.lora_counts == {1: 1, 2: 1}
    queue.requeue(first)
    queue.add_front(queue.pop())
    assert queue.lora_counts == {1: 1, 2: 2}
    drain(queue)
    assert queue.lora_counts == {} and queue.num_lora == 0 and queue.count_outside(()) == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_take_capped_takes_the_front_run_that_waits_for_an_adapter_slot(policy: str) -> None:
    """The run at the front whose adapters are loaded, not running and not overtaken too often;
    it stops at the base model, a running or loading adapter, a grammar, tokens in flight or a
    request at the bypass limit, skips finished ones, takes preempted ones, and puts back in
    order with the counts."""
    queue = make_queue(policy)
    # (adapter, what stops the run there, if anything)
    layout = [(3, ""), (4, "preempted"), (3, "aborted"), (4, ""), (1, "running"), (3, "")]
    requests = []
    for i, (adapter, _) in enumerate(layout):
        r = make_request(f"r{i}", arrival_time=float(i))
        r.lora_int_id = adapter
        requests.append(r)
        queue.add(r)
    abort(queue, requests[2])
    requests[1].status = RequestStatus.PREEMPTED
    running, ready = {1, 2}, {1, 2, 3, 4}
    run = queue.take_capped(running, ready, 5)
    assert [r.request_id for r in run] == ["r0", "r1", "r3"]
    assert queue.lora_counts == {1: 1, 3: 1} and queue.num_lora == 2 and len(queue) == 2
    assert queue.take_capped(running, ready, 5) == []  # r4's adapter runs
    queue.add_front_all(run)
    assert queue.lora_counts == {1: 1, 3: 2, 4: 2} and len(queue) == 5
    assert [r.request_id for r in queue] == ["r0", "r1", "r3", "r4", "r5"]

    stoppers = {
        "base model": lambda r: setattr(r, "lora_int_id", 0),
        "adapter loading": lambda r: setattr(r, "lora_int_id", 9),
        "grammar": lambda r: setattr(r, "status", RequestStatus.WAITING_FOR_GRAMMAR),
        "tokens in flight": lambda r: setattr(r, "num_output_placeholders", 1),
        "bypass limit": lambda r: setattr(r, "num_bypassed_steps", 5),
    }
    for why, stop in stoppers.items():
        queue = make_queue(policy)
        three = [make_request(f"s{i}", arrival_time=float(i)) for i in range(3)]
        for r in three:
            r.lora_int_id = 3
        stop(three[1])
        for r in three:
            queue.add(r)
        counts = dict(queue.lora_counts)
        run = queue.take_capped(running, ready, 5)
        assert [r.request_id for r in run] == ["s0"], why
        queue.add_front_all(run)
        assert [r.request_id for r in queue] == ["s0", "s1", "s2"], why
        assert queue.lora_counts == counts, why
