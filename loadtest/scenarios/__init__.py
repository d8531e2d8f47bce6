"""``python -m pagedserve.loadtest compare``: the side-by-side scenarios, each a set of runs
against named server configurations turned into rows (ratio next to goal).

    compare.py      the driver: starts each server configuration once, runs every
                    scenario part that needs it, stops it; the table, JSON, summary, plots
    core.py         Row, Run, Scenario, and the engine scenarios (continuous batching,
                    paged KV, chunked prefill, prefix caching, mixed saturation, rate sweep)
    robustness.py   overload and cancel-soak: the server against itself
    tenants.py      one tenant bursting beside a steady one (the fair share)

The vs-vllm scenario lives with the other vLLM comparisons, in loadtest/peers/.
"""
