"""Request arrival times: a Gamma process, as ``vllm bench serve`` draws them.

Inter-arrival gaps are Gamma(shape=burstiness, scale=1/(rate x burstiness)), so the mean
gap is always 1/rate and only the spread changes:

    burstiness = 1   Poisson arrivals (exponential gaps), the default
    burstiness < 1   burstier: clumps of requests, then lulls
    burstiness > 1   more regular than Poisson, tending to a fixed period
    rate = inf       every request at t = 0 (the offline / saturation case)

``--max-concurrency`` is applied by the runner on top: a request whose arrival time has
come still waits for a free slot.
"""

from __future__ import annotations

import math
import random


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """Seconds from the start of the run at which each request is sent (non-decreasing,
    first gap included so a rate of r gives ~r requests in the first second)."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.gammavariate(burstiness, theta)
        out.append(t)
    return out


def parse_rate(text: str | float) -> float:
    """'inf' / 'Infinity' / '4' / 2.5 -> float."""
    value = float(text)
    if not value > 0:
        raise ValueError(f"request rate must be > 0 or inf, got {text!r}")
    return value
