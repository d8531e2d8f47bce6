"""Waiting queues: FCFS (a deque) and priority (a heap).

Both put a preempted request back "at the front": the deque literally, the heap by
the request's own key (priority, arrival_time), which is what the front means there.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from pagedserve.scheduler.request import Request


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek_request(self) -> Request:
        return self._queue[0]

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def remove_request(self, request: Request) -> None:
        self._queue.remove(request)  # O(n); only aborts take this path

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Lower ``priority`` first, ties by ``arrival_time``, then by insertion order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = 0

    def add_request(self, request: Request) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (request.priority, request.arrival_time, self._seq, request))

    prepend_request = add_request

    def peek_request(self) -> Request:
        return self._heap[0][3]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_request(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))
