"""cluster/: everything that wires scheduler/, worker/ and kernels/ into a running server.

A request's path, outside in::

    cli/      the ``pagedserve`` command: flags -> EngineConfig, then serve / generate / kv-size
    serve/    Ray Serve + FastAPI: the OpenAI routes, validation, SSE, metrics, and the
              per-replica engine actor that runs the step loop on its own thread
    engine/   the step loop itself (LLMEngine, the offline LLM, detokenizer, outputs) and
              the in-process executor. Ray-free: it runs inside a Serve replica or alone
    control/  the Ray control plane: TP worker actors in a placement group, the per-step
              plan broadcast (ZMQ or a compiled graph), ray.init on loopback

Imports point inward: cli -> serve -> {engine, control}, control -> engine. Only control/ and serve/ import ray
(engine/ loads control/ lazily, for TP > 1).
"""
