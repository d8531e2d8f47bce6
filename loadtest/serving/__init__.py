"""Benches against real servers over HTTP: each starts ``pagedserve serve`` itself (some
take ``--base-url`` instead) and drives it with loadtest/harness/. Each is ``python -m
pagedserve.loadtest.serving.X``.

    bench_frontend.py  what one request costs the serving path in CPU, process by process
    bench_door.py      the door under overload: 429s and TTFT at 1x and 3x capacity
    bench_routing.py   the KV router against Ray Serve LLM's and Serve's own routers
    bench_spec.py      speculative decoding on against off, offline at batch 1 and over HTTP
"""
