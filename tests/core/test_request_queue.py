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
