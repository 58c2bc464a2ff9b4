"""Waiting queues for the two scheduling policies.

Removal (abort of a waiting request) is lazy: the request is marked finished and skipped when it
reaches the front, so every operation stays O(1) (fcfs) or O(log n) (priority).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Container, Iterable, Iterator

from engine_core._core.request import Request, RequestStatus

__all__ = ["FCFSQueue", "PriorityQueue", "RequestQueue", "count_in", "count_out", "make_queue"]

_PREEMPTED = RequestStatus.PREEMPTED
_WAITING_FOR_GRAMMAR = RequestStatus.WAITING_FOR_GRAMMAR


def count_in(counts: dict[int, int], key: int) -> None:
    """One more of ``key`` in a tally that holds only keys with a count."""
    counts[key] = counts.get(key, 0) + 1


def count_out(counts: dict[int, int], key: int) -> None:
    """One fewer of ``key``; a key whose count reaches 0 leaves the tally."""
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]


class RequestQueue:
    """Interface of a waiting queue. ``len()`` counts live (unfinished) requests;
    ``lora_counts`` counts them per LoRA adapter (``lora_int_id`` > 0 only), so the scheduler
    can tell when every request left waits for an adapter slot without looking at each."""

    lora_counts: dict[int, int]
    num_lora: int
    """Live requests with an adapter (the sum of ``lora_counts``)."""

    def _counted_in(self, request: Request) -> None:
        if request.lora_int_id:
            count_in(self.lora_counts, request.lora_int_id)
            self.num_lora += 1

    def _counted_out(self, request: Request) -> None:
        if request.lora_int_id:
            count_out(self.lora_counts, request.lora_int_id)
            self.num_lora -= 1

    def count_outside(self, lora_ids: Iterable[int]) -> int:
        """Live requests of an adapter not in ``lora_ids`` (distinct ids; the scheduler's
        running adapters, at most ``max_loras``: the cost is theirs, not the queue's)."""
        num = self.num_lora
        counts = self.lora_counts
        for lora_id in lora_ids:
            num -= counts.get(lora_id, 0)
        return num

    def add(self, request: Request) -> None:
        raise NotImplementedError

    def add_front(self, request: Request) -> None:
        """Re-queue a preempted request ahead of the others (as far as the policy allows)."""
        raise NotImplementedError

    def requeue(self, request: Request) -> None:
        """Re-queue a preempted request at its place: ahead of every request that arrived after
        it (fcfs), or by priority and arrival."""
        raise NotImplementedError

    def peek(self) -> Request | None:
        raise NotImplementedError

    def pop(self) -> Request:
        raise NotImplementedError

    def discard(self, request: Request) -> None:
        """Forget ``request``, which has just been marked finished."""
        raise NotImplementedError

    def add_front_all(self, requests: list[Request]) -> None:
        """:meth:`add_front` each of ``requests`` so that they lead the queue in their order."""
        for request in reversed(requests):
            self.add_front(request)

    def take_capped(
        self, running: Container[int], ready: Container[int], limit: int
    ) -> list[Request]:
        """Pop, in queue order, the requests at the front that wait only for an adapter slot
        (the LoRA cap is bound): an adapter not in ``running`` but loaded (in ``ready``), no
        grammar compiling, no tokens in flight, overtaken in fewer than ``limit`` steps. Stops
        at the first that is not; the scheduler puts them back with :meth:`add_front_all`."""
        taken: list[Request] = []
        while True:
            request = self.peek()
            if request is None or not _waits_for_a_slot(request, running, ready, limit):
                return taken
            taken.append(self.pop())

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        """Live requests in queue order."""
        raise NotImplementedError


def _waits_for_a_slot(
    request: Request, running: Container[int], ready: Container[int], limit: int
) -> bool:
    lora_id = request.lora_int_id
    return (
        lora_id != 0
        and lora_id not in running
        and lora_id in ready
        and request.status != _WAITING_FOR_GRAMMAR
        and not request.num_output_placeholders
        and request.num_bypassed_steps < limit
    )


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()
        self._num_dead = 0
        self.lora_counts = {}
        self.num_lora = 0

    def add(self, request: Request) -> None:
        self._queue.append(request)
        self._counted_in(request)

    def add_front(self, request: Request) -> None:
        self._queue.appendleft(request)
        self._counted_in(request)

    def requeue(self, request: Request) -> None:
        self._counted_in(request)
        queue = self._queue
        arrival = request.arrival_time
        if not queue or queue[0].arrival_time >= arrival:
            queue.appendleft(request)  # the usual case: it came before everything queued
            return
        for i, queued in enumerate(queue):
            if queued.arrival_time > arrival:
                queue.insert(i, request)
                return
        queue.append(request)

    def peek(self) -> Request | None:
        queue = self._queue
        while queue and queue[0].status > _PREEMPTED:
            queue.popleft()
            self._num_dead -= 1
        return queue[0] if queue else None

    def pop(self) -> Request:
        if self.peek() is None:
            raise IndexError("pop from an empty queue")
        request = self._queue.popleft()
        self._counted_out(request)
        return request

    def discard(self, request: Request) -> None:
        self._num_dead += 1
        self._counted_out(request)

    def add_front_all(self, requests: list[Request]) -> None:
        self._queue.extendleft(reversed(requests))
        for request in requests:
            self._counted_in(request)

    def take_capped(
        self, running: Container[int], ready: Container[int], limit: int
    ) -> list[Request]:
        # One pass over the front, without peek()/pop() per request: with the cap bound, a
        # change of the running adapters walks the queue past every capped request.
        queue = self._queue
        counts = self.lora_counts
        taken: list[Request] = []
        while queue:
            request = queue[0]
            if request.status > _PREEMPTED:
                queue.popleft()
                self._num_dead -= 1
                continue
            if not _waits_for_a_slot(request, running, ready, limit):
                break
            queue.popleft()
            taken.append(request)
            count_out(counts, request.lora_int_id)
        self.num_lora -= len(taken)
        return taken

    def __len__(self) -> int:
        return len(self._queue) - self._num_dead

    def __iter__(self) -> Iterator[Request]:
        return (r for r in self._queue if r.status <= _PREEMPTED)


class PriorityQueue(RequestQueue):
    """Lowest ``priority`` first, then earliest arrival."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()
        self._num_dead = 0
        self.lora_counts = {}
        self.num_lora = 0

    def add(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._counter), request)
        )
        self._counted_in(request)

    add_front = add  # a preempted request keeps its place by priority and arrival
    requeue = add

    def peek(self) -> Request | None:
        heap = self._heap
        while heap and heap[0][3].status > _PREEMPTED:
            heapq.heappop(heap)
            self._num_dead -= 1
        return heap[0][3] if heap else None

    def pop(self) -> Request:
        if self.peek() is None:
            raise IndexError("pop from an empty queue")
        request = heapq.heappop(self._heap)[3]
        self._counted_out(request)
        return request

    def discard(self, request: Request) -> None:
        self._num_dead += 1
        self._counted_out(request)

    def __len__(self) -> int:
        return len(self._heap) - self._num_dead

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap) if e[3].status <= _PREEMPTED)


def make_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}")
