"""The ``pagedserve`` command: ``serve`` (a local Ray Serve OpenAI server), ``generate``
(offline completion) and ``kv-size`` (KV-cache sizing for a model and GPU).

Owns: argv -> EngineConfig (flags named as in ``vllm serve``), process lifetime and
signals. May import every other part of cluster/; nothing imports it.
"""
