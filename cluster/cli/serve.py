"""``pagedserve serve``: the OpenAI server on Ray Serve, flags as ``vllm serve`` has them.

    pagedserve serve                          # SmolLM2-135M-Instruct, http://127.0.0.1:8000/v1
    pagedserve serve --model pagedserve-demo  # the random demo model (fast, gibberish)
    pagedserve serve --model DIR -tp 2 --min-replicas 1 --max-replicas 4

Starts a private Ray instance on 127.0.0.1 (or joins ``--ray-address``), deploys the app,
logs the URL and the KV-cache sizing once every replica is ready, and on Ctrl-C/SIGTERM
deletes the app, stops Serve and shuts down the Ray it started: no Ray process is left.
Only argparse is imported at parser-building time (``pagedserve --help`` stays fast).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time

from pagedserve.cluster.cli.args import _memory as parse_size
from pagedserve.cluster.cli.args import add_engine_args, engine_config_from_args, resolve_model_or_exit

logger = logging.getLogger("pagedserve")
APP_NAME = "pagedserve"


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible server (Ray Serve)",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="bind address (default loopback; 0.0.0.0 exposes it to the network)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--min-replicas", type=int, default=1, help="engine replicas kept running")
    s.add_argument("--max-replicas", type=int, default=None,
                   help="autoscale up to this many engine replicas (default: --min-replicas)")
    s.add_argument("--target-ongoing-requests", type=float, default=16.0,
                   help="Serve autoscaling target of in-flight requests per replica")
    s.add_argument("--upscale-delay-s", type=float, default=30.0)
    s.add_argument("--downscale-delay-s", type=float, default=600.0)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (401 without it); "
                        "default: $PAGEDSERVE_API_KEY, else no key. /health and /metrics stay open")
    s.add_argument("--api-keys-file", default=None,
                   help="YAML/JSON file of API key -> tenant (or {tenant, weight}); each is a valid "
                        "key on /v1/* next to --api-key")
    s.add_argument("--allow-tenant-header", action="store_true",
                   help="let an x-tenant header name the tenant (of a key the file does not map)")
    s.add_argument("--max-request-body-bytes", type=parse_size, default=None,
                   help="413 for a larger request body, e.g. 8MiB (default: 4 MiB + 32 bytes "
                        "per token of max_model_len, room for any prompt the model can take)")
    s.add_argument("--ray-address", default=None,
                   help="join a running Ray cluster ('auto' on a cluster node); default: a "
                        "private local instance on 127.0.0.1")
    s.add_argument("--placement-group-strategy", default="STRICT_PACK",
                   choices=["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"],
                   help="one engine replica's placement group (the replica and its TP workers): "
                        "STRICT_PACK keeps it on one node (default; refused with the numbers when no "
                        "node fits it); PACK lets it span nodes (tensor parallelism over the network)")
    s.add_argument("--request-router", default=None, choices=["kv", "prefix", "pow2"],
                   help="how the front picks an engine replica: kv (the replica that holds the most of "
                        "the prompt's prefix-cache blocks, by its KV events, weighed against load), prefix "
                        "(Ray Serve LLM's PrefixCacheAffinityRouter, needs pyarrow), pow2 (Serve's "
                        "power of two choices). Default: kv with more than one replica, else pow2")
    s.add_argument("--graceful-shutdown-timeout-s", type=float, default=None,
                   help="how long a replica being removed (scale-down, update) may take to finish its "
                        "streams (default: a max_model_len stream at 10 tokens/s, at least 30 s)")
    s.add_argument("--proxy-location", default=None, choices=["HeadOnly", "EveryNode", "Disabled"],
                   help="where Serve runs HTTP proxies (default: HeadOnly on a loopback --host, whose "
                        "proxies elsewhere no client could reach; EveryNode otherwise)")
    s.add_argument("--serving-nice", type=int, default=int(os.environ.get("PAGEDSERVE_SERVING_NICE", "19")),
                   help="with the CPU split of --cpu-omp-threads-bind auto, the serving path may also use "
                        "the model's cores at this nice value, i.e. when the model leaves them idle "
                        "(default %(default)s, or $PAGEDSERVE_SERVING_NICE; 0: its own core only)")
    add_engine_args(p)
    p.set_defaults(func=run_serve)
    return p


def _serve_options(args: argparse.Namespace, max_replicas: int) -> dict:
    return dict(min_replicas=args.min_replicas, max_replicas=max_replicas,
                target_ongoing_requests=args.target_ongoing_requests,
                upscale_delay_s=args.upscale_delay_s, downscale_delay_s=args.downscale_delay_s,
                api_key=args.api_key, max_request_body_bytes=args.max_request_body_bytes,
                api_keys_file=args.api_keys_file, allow_tenant_header=args.allow_tenant_header,
                placement_group_strategy=args.placement_group_strategy,
                graceful_shutdown_timeout_s=args.graceful_shutdown_timeout_s,
                request_router=args.request_router)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def run_serve(args: argparse.Namespace) -> int:
    cfg = resolve_model_or_exit(engine_config_from_args(args))
    max_replicas = args.max_replicas if args.max_replicas is not None else args.min_replicas
    if max_replicas < args.min_replicas:
        raise SystemExit(f"--max-replicas ({max_replicas}) must be >= --min-replicas ({args.min_replicas}).")
    import ray
    from ray import serve

    from pagedserve.cluster.ray_utils import init_ray, is_loopback
    from pagedserve.cluster.cli.serving_cpu import ServingCPU
    from pagedserve.cluster.app import build_app, resolve_cpu_bind
    from pagedserve.platforms import decide_here
    from pagedserve.worker.cpu_affinity import pin_this_process

    t0 = time.monotonic()
    shared = None  # ServingCPU, with the CPU split
    if args.ray_address is None:  # a node of our own: the serving path keeps its cores
        cfg = decide_here(cfg)  # the private Ray is this node: its GPUs are the cluster's
        cores = sorted(os.sched_getaffinity(0))
        cfg, serving = resolve_cpu_bind(cfg, single_replica=max_replicas == 1, cores=cores)
        if serving:
            pin_this_process(serving)  # before Ray starts: its processes inherit the mask
            if args.serving_nice > 0:  # and the model's cores when it idles (serving_cpu.py)
                shared = ServingCPU(cores, args.serving_nice)
                # Ray starts its workers at nice 15 (raylet and GCS at 0); the model worker
                # must stay above the serving path, and an unprivileged process cannot
                # lower its nice later. The serving processes get theirs from ServingCPU.
                os.environ.setdefault("RAY_worker_niceness", "0")
    init_ray(address=args.ray_address)
    # SIGTERM behaves like Ctrl-C. Installed after ray.init, which puts a C++ failure
    # handler on SIGTERM that dumps a stack and aborts the process mid-cleanup.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)  # also when started in the background (SIG_IGN)
    try:
        proxies = args.proxy_location or ("HeadOnly" if is_loopback(args.host) else "EveryNode")
        serve.start(http_options={"host": args.host, "port": args.port}, proxy_location=proxies)
        try:
            app = build_app(cfg, **_serve_options(args, max_replicas))
        except ValueError as e:  # a configuration the cluster cannot hold (placement)
            logger.error("%s", e)
            raise SystemExit(1) from None
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as e:
            # Serve's own message names the deployment only; the replica's error is here.
            logger.error("%s", e)
            for name, dep in serve.status().applications[APP_NAME].deployments.items():
                if dep.message:
                    logger.error("%s: %s", name, dep.message)
            raise SystemExit(1) from None
        if shared is not None:  # the model workers are up and pinned: move the rest
            shared.start()
        info = serve.get_deployment_handle("EngineDeployment", APP_NAME).info.remote().result()
        kv = info.get("kv_sizing") or {}
        url = f"http://{args.host}:{args.port}"
        logger.info("model %r (%s), tensor_parallel_size=%d, replicas %d..%d, max_model_len=%d",
                    info["served_model_name"], info["model"], info["tensor_parallel_size"],
                    args.min_replicas, max_replicas, info["max_model_len"])
        logger.info("KV cache per replica: %d blocks x %d tokens = %d tokens (%.3f GiB per rank, "
                    "%.1f sequences of max_model_len)", info["num_gpu_blocks"], info["block_size"],
                    info["num_gpu_blocks"] * info["block_size"], kv.get("kv_gib_per_rank", 0.0),
                    kv.get("max_concurrency_at_max_model_len", 0.0))
        logger.info("ready in %.1f s: %s/v1  (try: curl %s/v1/models)  Ctrl-C to stop",
                    time.monotonic() - t0, url, url)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        logger.info("shutting down")
    finally:
        if shared is not None:
            shared.stop()
        # A second TERM/Ctrl-C must not cut the cleanup short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            serve.delete(APP_NAME)
            if args.ray_address is None:  # never stop Serve on a shared cluster
                serve.shutdown()
        except Exception:  # Ray may already be gone
            logger.debug("serve shutdown failed", exc_info=True)
        ray.shutdown()  # stops the local Ray processes this command started
    return 0
