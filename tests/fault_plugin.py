"""Planted failures, for the tests of failure isolation and containment: a test plugin.

A real poison request (a seed torch cannot take, a top_p float32 flushes to 0) is a
moving target: each one found gets fixed or validated away. The isolation it exposed
must hold for the next one too, so the tests plant a failure at each place a request can
fail and check that only that request fails.

Not in the package: a test loads it with ``PAGEDSERVE_PLUGINS=<path of this file>``
(``PLUGIN_PATH`` below) in the environment of the process when its engine or worker is built
(plugins.py; Serve passes it on to engine replicas, the Ray executor to worker actors,
which load it from the path). Then ``install_engine`` / ``install_runner`` wrap a few
methods of that one object, and a request whose ``stop`` strings include
``marker(site)`` raises ``InjectedFault`` there:

    site         where                                       what the engine does
    setup        worker: its per-request state (generator)   that request fails (row isolation)
    sample       worker: its row of the sampler              that request fails (row isolation)
    detokenize   engine: turning its new tokens into text    that request fails
    step         worker: the whole step, while it is in it   step re-run in parts: it fails alone
    broken       worker: every step from then on, and the    no part and no probe succeeds:
                 probe (a worker that cannot compute)         the engine is dead
    one_rank     worker: the step, on TP ranks > 0 only      ranks out of step: the engine
                 (rank 0 waits in a collective)               is dead

The marker never matches generated text in a test: it is refused by no validator, but
the tiny test models cannot produce "<pagedserve-fault:...>" before the failure fires.
"""

from __future__ import annotations

import os

from pagedserve.plugins import PLUGINS_ENV  # noqa: F401 (for the tests: set it to PLUGIN_PATH)

PLUGIN_PATH = os.path.abspath(__file__)  # the value of PLUGINS_ENV that loads this plugin
SITES = ("setup", "sample", "detokenize", "step", "broken", "one_rank")


class InjectedFault(RuntimeError):
    """Raised at a planted site (a stand-in for any per-request bug)."""


def marker(site: str) -> str:
    if site not in SITES:
        raise ValueError(f"fault site must be one of {SITES}, got {site!r}.")
    return f"<pagedserve-fault:{site}>"


def _planted(site: str, params) -> bool:
    return bool(params.stop) and marker(site) in params.stop


def _fire(site: str) -> None:
    raise InjectedFault(f"injected fault at site {site!r} (test plugin {os.path.basename(PLUGIN_PATH)})")


def install_engine(engine) -> None:
    """LLMEngine: the detokenize site (its OutputProcessor's per-sample step)."""
    process = engine.outputs.process

    def _process(group, sample, out, now):
        if _planted("detokenize", sample.params):
            _fire("detokenize")
        return process(group, sample, out, now)

    engine.outputs.process = _process


def install_runner(runner) -> None:
    """ModelRunner: the setup, sample, step and broken sites."""
    new_state, sample_rows, prepare, probe = (runner._new_state, runner._sample_rows,
                                              runner._prepare_inputs, runner.probe)
    broken = []

    def _new_state(new):
        if _planted("setup", new.sampling_params):
            _fire("setup")
        return new_state(new)

    def _sample_rows(logits, reqs, drafts):
        out = sample_rows(logits, reqs, drafts)  # after the draws: the row-by-row retry must not redraw
        if any(_planted("sample", st.sampling_params) for st in reqs):
            _fire("sample")
        return out

    def _prepare_inputs(num_scheduled, spec_tokens):
        params = [runner.requests[r].sampling_params for r in num_scheduled]
        if any(_planted("broken", p) for p in params):
            broken.append(True)
        if broken:
            _fire("broken")
        if any(_planted("step", p) for p in params):
            _fire("step")
        if any(_planted("one_rank", p) for p in params):
            from pagedserve.worker.parallel_state import get_tp_rank

            if get_tp_rank() > 0:
                _fire("one_rank")
        return prepare(num_scheduled, spec_tokens)

    def _probe():
        if broken:
            _fire("broken")
        probe()

    runner._new_state, runner._sample_rows = _new_state, _sample_rows
    runner._prepare_inputs, runner.probe = _prepare_inputs, _probe
