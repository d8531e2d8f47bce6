"""Multi-LoRA serving on the worker: PEFT adapters read from disk (peft_adapter.py), kept
on the host, least recently used out first (host_cache.py), copied into a fixed pool of
``max_loras`` slots on the model's device (slot_pool.py), and applied to each step's rows
by their adapter (manager.py builds the step's groups, lora_ops.py adds the deltas).

One step of a mixed batch (rows sorted by adapter inside the decode and the chunk parts,
so each adapter's rows are one or two runs; the base model's rows get nothing added):

    rows:   [ d0 d1 | d2 | d3 d4 | p0 p0 p0 | p1 p1 ]       d: decode, p: prefill chunk
    slot:     base    s1    s0      s0         s1
    qkv += (x[run] @ A_qkv[slot]^T) @ (scale * B[slot])^T    for each run of each slot

The scheduler keeps every step's distinct adapters within ``max_loras`` (scheduler/lora.py),
so the slots always hold them; a slot whose adapter the step does not use is reused, least
recently used first.
"""
