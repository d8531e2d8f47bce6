"""The engine replica: the scheduler actor (one per model copy) around the engine loop.

    serve_replica.py    EngineReplica: the class Serve runs as the EngineDeployment's replica
                        (its lifeline, stats handle, CPU threads), around
    engine_replica.py   AsyncEngine: the step loop on its own thread, generate() streams,
                        health, request status
    admission.py        shed load before it becomes queueing delay (429s)
    live_view.py        the block map and step timeline of /dashboard
    step_rates.py       its prefill rate and decode step time, for the fronts' KV router

Imports: ray (Serve's replica context), cluster.engine, cluster.executors (to pick one),
cluster.text, cluster.wire, scheduler/, pagedserve.config; never the front or the CLI.
"""
