"""Load generator, benchmarks and checks. Nothing of pagedserve imports it; it may import
anything of pagedserve, but ray only through cluster/. One sub-package per kind:

    __main__.py     python -m pagedserve.loadtest {bench,compare}; --help lists every bench
    workloads.py    the benches' seeded prompts and length distributions, each named once
                    (the HTTP workloads, the offline benches' pairs, the scenarios' request sets)
    gpu_check.py    the one prepared GPU check's entry (with gpu_check_setup.sh, gpu_image_packages.txt)
    gpu/            its code: the image-package block, the harness, the sections by kind, the CLI
    harness/        the HTTP load harness: client, runner, metrics, report, servers
    scenarios/      the side-by-side scenarios of ``compare``
    offline/        benches with no HTTP server (engine, scheduler, workers in process)
    serving/        benches against real pagedserve servers over HTTP
    peers/          vLLM as a peer, in its own venv
    multinode/      the multi-node Ray cluster check
    kernel_checks/  the kernels' own checks and benches
"""
