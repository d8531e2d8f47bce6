"""The HTTP load harness: what every serving bench, ``compare`` and ``python -m
pagedserve.loadtest bench`` drive a server with, timed the way ``vllm bench serve`` times
it. No bench lives here, only the parts they share (prompts come from loadtest/workloads.py).

    arrivals.py   request arrival times (a Gamma process; rate inf: all at once)
    client.py     one streaming OpenAI completions request over httpx: TTFT, ITL, E2EL
    runner.py     one run: a workload at its arrival times under a concurrency cap,
                  /metrics sampled alongside, then the drain (leaked KV blocks)
    metrics.py    vLLM-named benchmark metrics, and the server's own from /metrics
    report.py     the terminal table, result JSON and the PNG plots
    servers.py    start and stop pagedserve or vLLM servers as subprocesses on 127.0.0.1
    browser.py    headless Chromium over CDP, to check /dashboard in a real browser
"""
