"""The engine loop: LLMEngine (scheduler step -> executor -> detokenize -> outputs), the
offline ``LLM`` API, and the in-process executor.

Owns: request lifecycle from add_request to RequestOutput, incremental detokenization,
stop strings. May import scheduler/, worker/ (config, model config, the in-process Worker)
and the standard library; never ray at import time. ``default_executor_class`` reaches
``cluster.control`` lazily, only when tensor_parallel_size > 1.
"""
