"""The one prepared GPU check's code (the entry is loadtest/gpu_check.py, its docstring the
how-to; gpu_check_setup.sh and gpu_image_packages.txt stay beside it in loadtest/):

    image.py               the packages outside the GPU image made unimportable (stdlib only;
                           the entry calls it before torch is imported)
    harness.py             the measuring harness: model shapes, Ctx, run_engine, generate,
                           greedy, agreement, StepTimer
    checkpoint.py          the 8B-shaped random checkpoint, drawn on the device, written in shards
    checks_correctness.py  exact, long_context, tp2, imports: tokens equal, or no optional package
    checks_roofline.py     b1, b1_8b: the batch-1 step against the HBM roofline
    checks_speed.py        throughput, fp8_kv, top_p, ttft, hf_generate, spec_decode
    checks_memory.py       memory_profile: the engine's own KV sizing, a worst-case batch
    checks_gguf.py         gguf: a Q4_1 GGUF served natively (Triton int4) against dequantized
    cli.py                 sections() in order with estimates, add_args, main

Importing this package imports nothing (image.py must run before torch).
"""
