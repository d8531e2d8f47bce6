"""cluster/: everything that wires scheduler/, worker/ and kernels/ into a running server,
one sub-package per process or layer, in the order a request walks them
(docs/request-walk.md follows one through)::

    cli/        the ``pagedserve`` command: flags -> EngineConfig, serve / generate / kv-size
    front/      the HTTP front (Ray Serve ingress): routes, schemas, OpenAI formatting,
                tool parsing, the door (shedding, live requests), /metrics
    replica/    the engine replica (the scheduler actor): step loop thread, admission,
                health, live view
    text/       a prompt's text to token ids (chat template, tokenizer pool), in the
                replica and, with several replicas, in the front for its router
    engine/     the engine loop itself (LLMEngine, step containment, detokenizer), ray-free
    executors/  how the loop reaches its workers: in-process, or a TP group of Ray worker
                actors with the ZMQ plan broadcast
    wire/       every type that crosses a process boundary (outputs, stream items, the
                output channel, stats, failures): what the others share instead of
                importing each other

    app.py        the Serve application: the front's and the replica's deployments
    llm.py        the offline ``LLM`` API (the engine loop with an executor)
    ray_utils.py  Ray on loopback, placement groups, Serve's quirks

Only front/, replica/, executors/, app.py and ray_utils.py import ray. The front and the
replica meet only through wire/ (and share text/); the engine loop and the executors never import each
other.
"""
