"""vLLM as a peer: its CPU build in its own venv (.venv-vllm, never a project dependency),
run beside pagedserve on the same cores, model and workload.

    vllm_cpu.py        set up .venv-vllm; vLLM's server, offline run and benchmark client
    vs_vllm.py         the vs-vllm scenario of ``python -m pagedserve.loadtest compare``
    bench_vs_vllm.py   python -m pagedserve.loadtest.peers.bench_vs_vllm: offline, HF static,
                       batch 1 and the HTTP pair in one run
"""
