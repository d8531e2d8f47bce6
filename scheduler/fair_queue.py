"""The waiting queue across tenants: a token-weighted fair share (the Virtual Token Counter
of Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).

Each tenant has its own sub-queue (FCFS or priority, as the policy says) and a counter of
the service it received, in weighted tokens:

    counter[t] += (prompt_weight * prefill tokens + output_weight * decode tokens) / weight[t]

charged every step for every scheduled request of t (running ones too, so a tenant with a
large batch in flight pays for it). The next request admitted is the head of the backlogged
tenant with the smallest counter. A tenant that was idle re-enters at
max(own counter, smallest backlogged counter): idle time banks no credit, so a tenant
flooding the server and one sending a request now and then each get half of the tokens
while both are backlogged, and the occasional one never waits behind the flood.

With one tenant this is exactly the sub-queue: FCFS or priority order, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from pagedserve.scheduler.request import Request

DEFAULT_TENANT = "default"
# VTC's weights: a generated token costs about twice a prefilled one (the paper's choice,
# and what a decode step's memory traffic per token suggests).
PROMPT_WEIGHT, OUTPUT_WEIGHT = 1.0, 2.0


class FairRequestQueue:
    def __init__(self, make_queue: Callable[[], object], weights: dict[str, float] | None = None) -> None:
        self._make_queue = make_queue
        self.weights = dict(weights or {})
        for t, w in self.weights.items():
            if not w > 0:
                raise ValueError(f"tenant weight must be > 0, got {t}={w}.")
        self.queues: dict[str, object] = {}  # tenant -> FCFS / priority sub-queue
        self.counters: dict[str, float] = {}
        # Requests of each tenant in the running batch, as the scheduler last told us
        # (set_running): the tie-break between equal counters.
        self.running: dict[str, int] = {}
        self._len = 0

    # ---- the counters ------------------------------------------------------------
    def charge(self, tenant: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        cost = PROMPT_WEIGHT * num_prompt_tokens + OUTPUT_WEIGHT * num_output_tokens
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weights.get(tenant, 1.0)

    def set_running(self, running: dict[str, int]) -> None:
        self.running = running

    def backlogged(self) -> list[str]:
        return [t for t, q in self.queues.items() if len(q)]


    def _order_key(self, t: str) -> tuple[float, float, float]:
        # Smallest counter; ties go to the tenant with fewer running requests per weight
        # (a tenant re-entering the backlog ties with the backlogged one it was lifted
        # to, and it is the one that has been waiting for service), then to the earlier head.
        return (self.counters.get(t, 0.0), self.running.get(t, 0) / self.weights.get(t, 1.0),
                self.queues[t].peek_request().arrival_time)

    def _head_tenant(self) -> str:
        return min(self.backlogged(), key=self._order_key)

    # ---- the queue interface (as FCFSRequestQueue / PriorityRequestQueue) ----------
    def add_request(self, request: Request) -> None:
        t = request.tenant
        q = self.queues.get(t)
        if q is None:
            q = self.queues[t] = self._make_queue()
        if not len(q):  # (re-)entering the backlog: no credit for the idle time
            others = [self.counters.get(u, 0.0) for u in self.backlogged() if u != t]
            floor = min(others) if others else max(self.counters.values(), default=0.0)
            self.counters[t] = max(self.counters.get(t, 0.0), floor)
        q.add_request(request)
        self._len += 1

    def prepend_request(self, request: Request) -> None:
        """A preempted request: the front of its own tenant's queue, counter unchanged."""
        q = self.queues.get(request.tenant)
        if q is None:
            q = self.queues[request.tenant] = self._make_queue()
            self.counters.setdefault(request.tenant, 0.0)
        q.prepend_request(request)
        self._len += 1

    def peek_request(self) -> Request:
        return self.queues[self._head_tenant()].peek_request()

    def pop_request(self) -> Request:
        self._len -= 1
        return self.queues[self._head_tenant()].pop_request()

    def peek_tenant(self, tenant: str) -> Request | None:
        q = self.queues.get(tenant)
        return q.peek_request() if q is not None and len(q) else None

    def pop_tenant(self, tenant: str) -> Request:
        self._len -= 1
        return self.queues[tenant].pop_request()

    def remove_request(self, request: Request) -> None:
        self.queues[request.tenant].remove_request(request)
        self._len -= 1

    def num_waiting(self, tenant: str) -> int:
        q = self.queues.get(tenant)
        return len(q) if q is not None else 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        """The projected service order: tenants by counter, taking turns one request at a
        time (what VTC does when requests cost about the same)."""
        order = sorted(self.backlogged(), key=self._order_key)
        iters = [iter(self.queues[t]) for t in order]
        while iters:
            alive = []
            for it in iters:
                req = next(it, None)
                if req is not None:
                    yield req
                    alive.append(it)
            iters = alive
