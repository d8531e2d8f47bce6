"""``pagedserve serve``: the OpenAI server on Ray Serve, flags as ``vllm serve`` has them.

    pagedserve serve                          # SmolLM2-135M-Instruct, http://127.0.0.1:8000/v1
    pagedserve serve --model pagedserve-demo  # the random demo model (fast, gibberish)
    pagedserve serve --model DIR -tp 2 --min-replicas 1 --max-replicas 4

Starts a private Ray instance on 127.0.0.1 (or joins ``--ray-address``), deploys the app,
logs the URL and the KV-cache sizing once every replica is ready, and on Ctrl-C/SIGTERM
(to it or to its process group) deletes the app, stops Serve and shuts down the Ray it
started, within the replicas' drain timeout and 30 s: no Ray process is left.
Only argparse is imported at parser-building time (``pagedserve --help`` stays fast).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

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
    s.add_argument("--http-ingress", default=None, choices=["proxy", "haproxy"],
                   help="the private Ray's HTTP ingress: proxy (Serve's Python proxy actor; default) or "
                        "haproxy (Ray Serve's HAProxy ingress, the ingress replica serving HTTP itself: less "
                        "CPU a streamed token, but an unstreamed request whose client leaves is not always "
                        "aborted). RAY_SERVE_ENABLE_HA_PROXY=1 in the environment also chooses haproxy")
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


# A shutdown may take the replicas' drain (the engine's graceful_shutdown_timeout_s) plus
# this, for Serve's and Ray's own steps (the controller, the proxies, the GCS and raylet).
SHUTDOWN_MARGIN_S = 30.0
# The private Ray's GCS counts as gone after this many probes in a row go unanswered.
GCS_PROBE_TIMEOUT_S = 2.0
GCS_PROBE_MISSES = 3


def _shutdown(private: bool, drain_s: float, probe: Callable[[float], bool] | None) -> None:
    """Delete the app (its replicas finish their streams, for up to ``drain_s``), stop
    Serve, shut the private Ray down, in that order, and return. Bounded: every Ray call
    here waits without a deadline, and one whose answer can no longer come (the GCS is
    gone) waits until Ray's reconnect timeout aborts the process, leaving its processes to
    the kernel. So a watchdog ends it with exit status 1 after SIGKILLing the private Ray's
    processes, once the GCS stops answering ``probe`` (its processes were signalled too:
    a supervisor that signals every process of the service, such as systemd's default
    KillMode) or the whole took longer than ``drain_s + SHUTDOWN_MARGIN_S``."""
    import ray
    from ray import serve

    from pagedserve.cluster.ray_utils import kill_private_ray

    probing, done = threading.Event(), threading.Event()
    if probe is not None:
        probing.set()

    def give_up(why: str) -> None:
        logger.error("shutdown: %s; killing the Ray processes this command started", why)
        if private:
            kill_private_ray()
        logging.shutdown()
        os._exit(1)  # not sys.exit: Ray's atexit shutdown would wait on the GCS again

    def watch() -> None:
        deadline = time.monotonic() + drain_s + SHUTDOWN_MARGIN_S
        misses = 0
        while not done.wait(1.0):
            misses = misses + 1 if probing.is_set() and not probe(GCS_PROBE_TIMEOUT_S) else 0
            if misses >= GCS_PROBE_MISSES:
                give_up("Ray's GCS stopped answering")
            if time.monotonic() > deadline:
                give_up(f"it took longer than {drain_s + SHUTDOWN_MARGIN_S:.0f} s")

    threading.Thread(target=watch, name="pagedserve-shutdown-watchdog", daemon=True).start()
    try:
        serve.delete(APP_NAME)
        if private:  # never stop Serve on a shared cluster
            serve.shutdown()
    except Exception:  # Ray may already be gone
        logger.debug("serve shutdown failed", exc_info=True)
    # ray.shutdown stops the GCS itself: no probing from here on, so ask it once now.
    probing.clear()
    if probe is not None and not probe(GCS_PROBE_TIMEOUT_S):
        give_up("Ray's GCS stopped answering")
    try:
        ray.shutdown()  # stops the local Ray processes this command started
    finally:
        done.set()


def run_serve(args: argparse.Namespace) -> int:
    cfg = resolve_model_or_exit(engine_config_from_args(args))
    max_replicas = args.max_replicas if args.max_replicas is not None else args.min_replicas
    if max_replicas < args.min_replicas:
        raise SystemExit(f"--max-replicas ({max_replicas}) must be >= --min-replicas ({args.min_replicas}).")
    from pagedserve.cluster.cli.http_ingress import configure as configure_ingress
    from pagedserve.cluster.ray_utils import gcs_probe, init_ray, is_loopback

    # Before Ray Serve is imported: its constants read the environment once.
    ingress = configure_ingress(args.http_ingress, private=args.ray_address is None, loopback=is_loopback(args.host))
    from ray import serve

    from pagedserve.cluster.cli.serving_cpu import ServingCPU
    from pagedserve.cluster.app import build_app, drain_timeout_s, resolve_cpu_bind
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
    # The probe's client connects now: made once the GCS is gone, it would wait for it.
    # A joined cluster's GCS is not probed (it may be out of this process's reach).
    probe = gcs_probe() if args.ray_address is None else None
    # SIGTERM behaves like Ctrl-C. Installed after ray.init, which puts a C++ failure
    # handler on SIGTERM that dumps a stack and aborts the process mid-cleanup.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)  # also when started in the background (SIG_IGN)
    drain_s = 0.0  # no replica yet, none to drain
    try:
        proxies = args.proxy_location or ("HeadOnly" if is_loopback(args.host) else "EveryNode")
        serve.start(http_options={"host": args.host, "port": args.port}, proxy_location=proxies)
        try:
            drain_s = drain_timeout_s(cfg, _serve_options(args, max_replicas))
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
        logger.info("HTTP ingress: %s", ingress)
        if info.get("device") == "cpu":
            from pagedserve.worker.cuda_graphs import cpu_dtype_warning

            warning = cpu_dtype_warning(info["dtype"], info.get("quantization") == "gguf")
            if warning is not None:
                logger.warning("%s", warning)
        logger.info("ready in %.1f s: %s/v1  (try: curl %s/v1/models)  Ctrl-C to stop",
                    time.monotonic() - t0, url, url)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        logger.info("shutting down")
    finally:
        # A second TERM/Ctrl-C must not cut the cleanup short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if shared is not None:
            shared.stop()
        _shutdown(private=args.ray_address is None, drain_s=drain_s, probe=probe)
    return 0
