"""The engine loop, ray-free: LLMEngine (scheduler step -> executor -> outputs, its step
variant chosen once), the OutputProcessor (samples, detokenizing, stop strings, n / best_of
groups -> RequestOutput), the StepTimer the draft proposer reads, step containment,
structured outputs, request options.

Owns: request lifecycle from add_request to RequestOutput, incremental detokenization,
stop strings, the re-run of a failed step in parts. Imports scheduler/, worker/ (model
config, model source), cluster.wire and pagedserve.config; never ray, never the
executors (it is handed an executor class), the replica, the front or the CLI.
"""
