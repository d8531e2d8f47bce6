"""The kernels' own checks and benches, outside the shipped kernels/ package: they import
kernels/, nothing imports them but the loadtest scripts and the tests.

    paged_batch.py    make_paged_batch: a paged-attention batch as the runner lays it out
                      (shuffled block ids, NaN in unused slots), for tests and checks alike
    gpu_kernels.py    python -m pagedserve.loadtest.kernel_checks.gpu_kernels: the Triton
                      kernels on a GPU, correctness against the torch reference and timings
    gpu_kv_quant.py   the quantised-KV-cache part of it
    aot.py            python -m pagedserve.loadtest.kernel_checks.aot: compile every Triton
                      variant for a GPU architecture without a GPU
    cpu_attention.py  python -m pagedserve.loadtest.kernel_checks.cpu_attention: the CPU
                      decode-attention kernels against torch
"""
