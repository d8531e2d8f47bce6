"""Planted per-request failures, for the tests of failure isolation (and nothing else).

A real poison request (a seed torch cannot take, a tokenizer that raises on one output)
is a moving target: each one found gets validated away at the edge. The isolation it
exposed must hold for the next one too, so the tests plant a failure at each place a
request can fail inside the step and check that only that request fails.

Inert unless ``PAGEDSERVE_FAULT_INJECTION=1`` is in the environment of the process that
runs the site (Serve passes it on to engine replicas; worker actors inherit it). Then a
request whose ``stop`` strings include ``marker(site)`` raises ``InjectedFault`` there:

    site         where                                              attributable
    setup        worker: its per-request state (generator, ...)     yes: that request fails
    sample       worker: its row of the sampler                     yes
    detokenize   engine: turning its new tokens into text           yes
    step         worker: the step as a whole                        no: the replica fails

The marker never matches generated text in a test: it is refused by no validator, but
the tiny test models cannot produce "<pagedserve-fault:...>" before the failure fires.
"""

from __future__ import annotations

import os

ENV = "PAGEDSERVE_FAULT_INJECTION"
SITES = ("setup", "sample", "detokenize", "step")


class InjectedFault(RuntimeError):
    """Raised at a planted site (a stand-in for any per-request bug)."""


def marker(site: str) -> str:
    if site not in SITES:
        raise ValueError(f"fault site must be one of {SITES}, got {site!r}.")
    return f"<pagedserve-fault:{site}>"


def check(site: str, params) -> None:
    """Raise at ``site`` if this request planted a fault there. Costs one truth test for
    requests without stop strings (the per-token hot path)."""
    stop = params.stop
    if stop and os.environ.get(ENV) == "1" and marker(site) in stop:
        raise InjectedFault(f"injected fault at site {site!r} (test hook, {ENV}=1)")
