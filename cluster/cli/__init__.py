"""The ``pagedserve`` command: ``serve`` (a local Ray Serve OpenAI server), ``generate``
(offline completion) and ``kv-size`` (KV-cache sizing for a model and GPU).

Owns: argv -> EngineConfig (flags named as in ``vllm serve``), process lifetime and
signals, where the serving processes run (serving_cpu.py). Imports: every other part
of cluster/; nothing imports it.
"""
