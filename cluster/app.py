"""The Ray Serve application: OpenAI ingress -> engine replicas (autoscaled) + stats.

    HTTP ─▶ OpenAIIngress (FastAPI, 1 replica) ──handle──▶ EngineDeployment × N replicas
                 │ /metrics                                 (scheduler actor + TP workers,
                 └──────────▶ StatsAggregator (1 replica) ◀── stats pushes)

``build_app(engine_config, ...)`` returns the bound application; ``app_builder(args)`` is
the import path for ``serve run`` / ``serve deploy`` config files (deploy/serve_config.yaml).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import ray
from ray import serve

from pagedserve.cluster.replica.serve_replica import EngineReplica
from pagedserve.cluster.front.metrics import StatsAggregator
from pagedserve.cluster.front.router.routing import ROUTERS
from pagedserve.cluster.placement import (actor_resources, check_group_fits, decide_for_cluster, engine_bundles,
                                          placement_strategy)
from pagedserve.cluster.ray_utils import ON_HEAD_NODE, serve_grpc_on_node_ip
from pagedserve.config import EngineConfig
from pagedserve.platforms import PLACEMENT_STRATEGIES
from pagedserve.worker.cpu_affinity import format_core_list, parse_bind, plan_auto

logger = logging.getLogger("pagedserve")

# Serve-side options a config file or the CLI may set next to the engine fields.
SERVE_OPTION_DEFAULTS: dict[str, Any] = dict(
    min_replicas=1, max_replicas=1, target_ongoing_requests=16.0,
    upscale_delay_s=30.0, downscale_delay_s=600.0, look_back_period_s=30.0,
    metrics_interval_s=10.0, max_ongoing_requests=1024, engine_num_cpus=1.0,
    # The HTTP front's (cluster/front/edge.py IngressConfig); api_key falls back to
    # $PAGEDSERVE_API_KEY, max_request_body_bytes to a bound derived from max_model_len.
    api_key=None, max_request_body_bytes=None,
    # Tenants (cluster/front/tenants.py): a YAML/JSON file of API key -> tenant (+ weight),
    # and whether an x-tenant header may name the tenant of a request.
    api_keys_file=None, allow_tenant_header=False,
    # One engine replica's placement group (the replica + its TP workers): STRICT_PACK
    # keeps it on one node; PACK lets a group that fits no node span several. A
    # placement_group_config's own "strategy" (an engine field) wins over this.
    placement_group_strategy="STRICT_PACK",
    # How long a replica being removed (scale-down, update) may take to finish its
    # streams; None: long enough for a max_model_len stream at GRACE_TOKENS_PER_S.
    graceful_shutdown_timeout_s=None,
    # How the front picks an engine replica (cluster/front/router/routing.py ROUTERS): "kv", "prefix"
    # or "pow2"; None: "kv" where more than one replica can run, else "pow2".
    request_router=None)
# The slowest decode a draining stream is given time for (tokens/s, one stream): a
# replica leaving waits only as long as its streams still need; this bounds a stuck one.
GRACE_TOKENS_PER_S = 10.0
# How often a leaving replica checks whether its last request has ended. Serve sleeps one
# period before the first check (2 s by default): an idle replica would wait that long on
# every scale-down, rolling update and delete.
DRAIN_POLL_S = 0.25


def resolve_cpu_bind(engine_config: EngineConfig, single_replica: bool,
                     cores: list[int] | None = None) -> tuple[EngineConfig, list[int] | None]:
    """``pagedserve serve`` on a node of its own (a private Ray): resolve
    ``cpu_omp_threads_bind`` to explicit cores per rank and return the cores the serving
    path keeps (None: no split). The caller pins itself to those before Ray starts, so
    Ray's processes (proxy, controller, replicas) inherit them; each worker pins itself to
    its own (worker/cpu_affinity.py says why)."""
    bind = engine_config.cpu_omp_threads_bind
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if bind == "nobind" or engine_config.device != "cpu":
        return engine_config, None
    if bind == "auto":
        plan = plan_auto(cores, engine_config.tensor_parallel_size) if single_replica else None
        if plan is None:
            return engine_config, None
        serving, bind = plan
    else:
        used = {c for r in parse_bind(bind, engine_config.tensor_parallel_size) for c in r}
        serving = [c for c in cores if c not in used] or None
    borrow = engine_config.cpu_borrow_cores
    if borrow == "auto":
        # One rank of one core: its GEMMs also take what the serving cores leave idle. Not
        # with several ranks (they would share those cores) nor wider ranks (their OpenMP
        # threads split the GEMMs already).
        ranks = parse_bind(bind, engine_config.tensor_parallel_size)
        borrow = format_core_list(serving) if serving and len(ranks) == 1 and len(ranks[0]) == 1 else "off"
    logger.info("CPU cores: serving path %s, model ranks %s (--cpu-omp-threads-bind to choose); GGUF GEMMs "
                "borrow %s (--cpu-borrow-cores)", format_core_list(serving) if serving else "unpinned", bind,
                "no core" if borrow == "off" else f"core {borrow} when idle")
    return dataclasses.replace(engine_config, cpu_omp_threads_bind=bind, cpu_borrow_cores=borrow), serving


def bound_worker_config(engine_config: EngineConfig) -> EngineConfig:
    """A worker bound to cores must run in a process of its own (the "ray" backend): pinned
    inside the serving replica it would pin the replica's event loop too, and the step then
    waits for the GIL behind it. Async scheduling is on unless the config says otherwise
    (its overlap, planning the next step while this one runs, is what a separate process
    buys)."""
    if parse_bind(engine_config.cpu_omp_threads_bind, engine_config.tensor_parallel_size) is None:
        return engine_config
    if engine_config.distributed_executor_backend == "uni":
        raise ValueError("cpu_omp_threads_bind pins a worker process to cores; with "
                         "distributed_executor_backend 'uni' that process is the serving replica. "
                         "Use 'ray' (the default with a bind) or cpu_omp_threads_bind 'nobind'.")
    return dataclasses.replace(
        engine_config, distributed_executor_backend="ray",
        async_scheduling=True if engine_config.async_scheduling is None else engine_config.async_scheduling)


# The environment an engine replica (and so its worker actors) gets from the process that
# builds the app: every engine-side switch of deploy/README.md's table, and a few of torch's.
ENGINE_ENV = ("TRITON_INTERPRET", "HF_HUB_OFFLINE", "GOMP_SPINCOUNT", "PAGEDSERVE_CACHE",
              "PAGEDSERVE_GGUF_WEIGHT_CACHE", "PAGEDSERVE_CPU_EXT", "PAGEDSERVE_PLUGINS")


@serve.deployment(name="StatsAggregator", num_replicas=1, ray_actor_options={"num_cpus": 0})
class StatsAggregatorDeployment:
    def __init__(self) -> None:
        serve_grpc_on_node_ip()  # before Serve starts this replica's gRPC server
        self.agg = StatsAggregator()

    def report(self, replica_id: str, snapshot: dict) -> None:
        self.agg.report(replica_id, snapshot)

    def remove(self, replica_id: str) -> None:
        self.agg.remove(replica_id)

    def merged(self) -> dict:
        return self.agg.merged()

    def views(self) -> dict:
        return self.agg.views()


# The engine replica as a Serve deployment: the class is the replica's own
# (cluster/replica/serve_replica.py); Serve calls its generate() directly.
EngineDeployment = serve.deployment(name="EngineDeployment")(EngineReplica)


def serve_options(serve_opts: dict[str, Any]) -> dict[str, Any]:
    """The given serve options over SERVE_OPTION_DEFAULTS (None: the default)."""
    return {**SERVE_OPTION_DEFAULTS, **{k: v for k, v in serve_opts.items() if v is not None}}


def request_router(o: dict[str, Any]) -> str:
    """The --request-router choice of these (resolved) serve options."""
    name = o["request_router"] or ("kv" if int(o["max_replicas"]) > 1 else "pow2")
    if name not in ROUTERS:
        raise ValueError(f"request_router must be one of {sorted(ROUTERS)}, got {name!r}.")
    return name


def router_config(engine_config: EngineConfig, o: dict[str, Any]) -> dict:
    """Serve's request_router_config for the engine deployment. Every router routes around
    the replicas the front saw die (routing.py); the KV router also gets what names a block
    as the replicas name it, and the replicas' event addresses within a second of their start."""
    name = request_router(o)
    cfg: dict[str, Any] = dict(request_router_class=ROUTERS[name])
    if name == "kv":
        cfg["request_router_kwargs"] = dict(block_size=engine_config.block_size,
                                            isolate_tenants=engine_config.isolate_tenant_prefix_cache)
        cfg["request_routing_stats_period_s"] = 1.0
    return cfg


def drain_timeout_s(engine_config: EngineConfig, serve_opts: dict[str, Any]) -> float:
    """How long a replica being removed may take to finish its streams (Serve's
    graceful_shutdown_timeout_s): the option, else a max_model_len stream at
    GRACE_TOKENS_PER_S, at least 30 s."""
    grace = serve_options(serve_opts)["graceful_shutdown_timeout_s"]
    if grace is None:
        grace = max(30.0, (engine_config.max_model_len or 2048) / GRACE_TOKENS_PER_S)
    return float(grace)


def engine_deployment_options(engine_config: EngineConfig, **serve_opts: Any) -> dict:
    """Serve's options for the engine deployment. ``engine_config.device`` is decided
    here if it is still "auto" (build_app decides it first, and binds that config)."""
    o = serve_options(serve_opts)
    engine_config = decide_for_cluster(engine_config)
    strategy = placement_strategy(engine_config, default=str(o["placement_group_strategy"]).upper())
    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"placement_group_strategy must be one of {PLACEMENT_STRATEGIES}, got {strategy!r}.")
    grace = drain_timeout_s(engine_config, o)
    opts: dict[str, Any] = dict(max_ongoing_requests=int(o["max_ongoing_requests"]),
                                graceful_shutdown_timeout_s=grace,
                                graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
                                request_router_config=router_config(engine_config, o),
                                # Serve replaces a replica after 3 failed checks in a row: a
                                # dead worker costs ~3 periods before the new replica starts.
                                health_check_period_s=2, health_check_timeout_s=15)
    if o["min_replicas"] == o["max_replicas"]:
        opts["num_replicas"] = int(o["min_replicas"])
    else:
        opts["autoscaling_config"] = dict(
            min_replicas=int(o["min_replicas"]), max_replicas=int(o["max_replicas"]),
            initial_replicas=int(o["min_replicas"]),
            target_ongoing_requests=float(o["target_ongoing_requests"]),
            upscale_delay_s=float(o["upscale_delay_s"]), downscale_delay_s=float(o["downscale_delay_s"]),
            look_back_period_s=float(o["look_back_period_s"]),
            metrics_interval_s=float(o["metrics_interval_s"]))
    replica_cpus = float(o["engine_num_cpus"])
    if engine_config.executor_backend() == "ray":
        # One bundle per TP worker; this replica (the scheduler actor) shares bundle 0 with
        # rank 0. RayExecutor places the workers in the replica's own group (placement.py).
        opts["placement_group_bundles"] = engine_bundles(engine_config, replica_cpus)
        opts["placement_group_strategy"] = strategy
        opts["ray_actor_options"] = {"num_cpus": replica_cpus}
    elif engine_config.placement_group_config is not None:
        # tp=1 with a placement of its own: the replica is the worker and takes the bundle.
        opts["placement_group_bundles"] = engine_bundles(engine_config, replica_cpus)
        opts["placement_group_strategy"] = strategy
        opts["ray_actor_options"] = actor_resources(opts["placement_group_bundles"][0])
    else:
        # tp=1: the worker runs inside the scheduler actor (no dispatch hop at all; see
        # loadtest/offline/bench_dispatch.py for what a worker actor would add).
        worker = engine_bundles(engine_config, 0.0)[0]
        opts["ray_actor_options"] = dict(actor_resources(worker), num_cpus=replica_cpus)
    # The engine's knobs set where the app is built reach the replica even on a Ray cluster that
    # was started before (whose workers have the raylet's environment, not this process's).
    env = {k: os.environ[k] for k in ENGINE_ENV if k in os.environ}
    # The replica runs AsyncEngine.generate on Serve's own loop, not in Serve's default
    # separate thread (a hop per call and per stream item): the engine's own work is off the
    # loop anyway (one step thread, the tokenizer pool).
    env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] = os.environ.get(
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "0")
    opts["ray_actor_options"]["runtime_env"] = {"env_vars": env}
    return opts


# The options of the HTTP front (one ingress for every model), not of one model's engines.
INGRESS_OPTIONS = ("api_key", "max_request_body_bytes", "api_keys_file", "allow_tenant_header")


def build_app(engine_config: EngineConfig, name_prefix: str = "", **serve_opts: Any):
    """The bound Serve application for ``serve.run``: one model. ``serve_opts``: keys of
    SERVE_OPTION_DEFAULTS (min/max replicas, target ongoing requests, delays...)."""
    model_opts = {k: v for k, v in serve_opts.items() if k not in INGRESS_OPTIONS}
    ingress_opts = {k: v for k, v in serve_opts.items() if k in INGRESS_OPTIONS}
    return build_openai_app([(engine_config, model_opts)], name_prefix, **ingress_opts)


def deployment_suffix(model_id: str) -> str:
    """A model's part of its deployments' names, as Ray Serve LLM spells it
    (``LLMServer:<model_id>`` with "/" as "--" and "." as "_")."""
    return model_id.replace("/", "--").replace(".", "_")


def build_openai_app(models: list, name_prefix: str = "",
                     api_key: str | None = None, max_request_body_bytes: int | None = None,
                     api_keys_file: str | None = None, allow_tenant_header: bool = False):
    """One ingress over the engine deployments of ``models``, Ray Serve LLM's
    ``build_openai_app``: each an LLMConfig-shaped dict (split_llm_config) or a pair
    (EngineConfig, its serve options). Each model has its own engine deployment (replicas,
    router, autoscaling) and stats aggregator; the ingress routes a request by its ``model``.
    One model keeps the plain names (EngineDeployment, StatsAggregator); several get
    ``:<model id>`` after them."""
    from pagedserve.cluster.front.edge import IngressConfig
    from pagedserve.cluster.front.ingress import OpenAIIngress
    from pagedserve.cluster.front.tenants import key_weights, load_api_keys

    models = [m if isinstance(m, tuple) else _pinned(split_llm_config(m)) for m in models]
    if not models:
        raise ValueError("llm_configs: give at least one model.")
    several = len(models) > 1
    names = [m.served_model_name or m.model for m, _ in models]
    if several and (None in names or len(set(names)) < len(names)):
        raise ValueError(f"each model of an app needs its own model_id (served_model_name); got {names}.")
    keys = load_api_keys(api_keys_file) if api_keys_file else {}
    on_head = {"num_cpus": 0, "resources": dict(ON_HEAD_NODE)}
    engines, stats_handles, kv_routed = [], [], []
    for (engine_config, serve_opts), name in zip(models, names):
        engine_config = decide_for_cluster(bound_worker_config(engine_config))
        if keys:  # the file's weights join the engine's; a flag names a weight the file does not
            weights = {**key_weights(keys), **(engine_config.tenant_weights or {})}
            engine_config = dataclasses.replace(engine_config, tenant_weights=weights or None)
        engine_opts = engine_deployment_options(engine_config, **serve_opts)
        if ray.is_initialized() and "placement_group_bundles" in engine_opts:  # refused now, not pending for good
            check_group_fits(engine_opts["placement_group_bundles"], engine_opts["placement_group_strategy"])
        suffix = f":{deployment_suffix(name)}" if several else ""
        stats = StatsAggregatorDeployment.options(
            name=name_prefix + "StatsAggregator" + suffix, ray_actor_options=on_head,
            graceful_shutdown_wait_loop_s=DRAIN_POLL_S).bind()
        # A lone engine replica may use the node's cores; beside another model's it may not.
        alone = not several and int(serve_options(serve_opts)["max_replicas"]) == 1
        engines.append(EngineDeployment.options(name=name_prefix + "EngineDeployment" + suffix, **engine_opts)
                       .bind(engine_config, stats, all_cores=alone))
        stats_handles.append(stats)
        kv_routed.append(request_router(serve_options(serve_opts)) == "kv")
    ingress_config = IngressConfig.from_options(
        api_key, max_request_body_bytes, api_keys={k: v.tenant for k, v in keys.items()},
        allow_tenant_header=allow_tenant_header,
        tokenize_for_router=tuple(kv_routed) if several else kv_routed[0])
    ingress = OpenAIIngress.options(name=name_prefix + "OpenAIIngress", ray_actor_options=on_head,
                                    graceful_shutdown_wait_loop_s=DRAIN_POLL_S)
    if not several:  # the one-model app's arguments, as before several were served
        return ingress.bind(engines[0], stats_handles[0], ingress_config)
    return ingress.bind(engines, stats_handles, ingress_config)


def split_args(args: dict[str, Any]) -> tuple[EngineConfig, dict[str, Any]]:
    """Config-file ``args`` (vLLM field names, '-' or '_') -> (EngineConfig, serve options)."""
    args = {k.replace("-", "_"): v for k, v in (args or {}).items()}
    engine_fields = EngineConfig.field_names()
    unknown = set(args) - engine_fields - set(SERVE_OPTION_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown args {sorted(unknown)}; engine fields: {sorted(engine_fields)}, "
                         f"serve options: {sorted(SERVE_OPTION_DEFAULTS)}.")
    cfg = EngineConfig(**{k: v for k, v in args.items() if k in engine_fields})
    return cfg, {k: v for k, v in args.items() if k in SERVE_OPTION_DEFAULTS}


def pinned_model(engine_config: EngineConfig) -> EngineConfig:
    """A repo id ``model`` pinned to the commit it names now, where the app is built (its
    config and tokenizer fetched here): every replica, whenever Serve starts it, and every
    worker then load those same files (worker/loading/model_fetch.py). Other models as they are."""
    from pagedserve.worker.loading.model_fetch import is_remote
    from pagedserve.worker.loading.model_source import resolve_model

    if not is_remote(engine_config.model):
        return engine_config
    resolved = resolve_model(engine_config.model, revision=engine_config.revision,
                             download_dir=engine_config.download_dir, config_only=True)
    return dataclasses.replace(engine_config, revision=resolved.revision or engine_config.revision)


# Ray Serve LLM's deployment_config.autoscaling_config keys that are serve options here.
_AUTOSCALING_KEYS = ("min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s",
                     "downscale_delay_s", "look_back_period_s", "metrics_interval_s")
# An llm_configs entry's keys (Ray Serve LLM's LLMConfig) that pagedserve serves.
LLM_CONFIG_KEYS = ("model_loading_config", "engine_kwargs", "deployment_config", "placement_group_config",
                   "accelerator_type", "lora_config")


def _only(where: str, given: dict, allowed) -> None:
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: {unknown} not supported by pagedserve; it takes {sorted(allowed)}.")


def split_llm_config(entry: dict[str, Any] | str) -> tuple[EngineConfig, dict[str, Any]]:
    """One ``llm_configs`` entry (Ray Serve LLM's LLMConfig as a dict, or the path of a YAML
    file of one) -> (EngineConfig, serve options):

        model_loading_config {model_id, model_source, tokenizer_source}
                                -> served_model_name, model (default: model_id), tokenizer
        engine_kwargs           -> EngineConfig fields (vLLM's names)
        deployment_config       -> num_replicas or autoscaling_config {min_replicas, ...},
                                   max_ongoing_requests, graceful_shutdown_timeout_s,
                                   ray_actor_options {num_cpus}, and any serve option of
                                   SERVE_OPTION_DEFAULTS by its own name (request_router, ...)
        placement_group_config, accelerator_type -> the EngineConfig fields of those names
        lora_config {dynamic_lora_loading_path, max_num_adapters_per_replica}
                                -> enable_lora, dynamic_lora_loading_path, max_cpu_loras
    """
    if isinstance(entry, str):
        import yaml

        with open(entry) as f:
            entry = yaml.safe_load(f)
    if not isinstance(entry, dict):
        raise ValueError(f"an llm_configs entry is a mapping (Ray Serve LLM's LLMConfig), got {type(entry).__name__}.")
    _only("llm_configs entry", entry, LLM_CONFIG_KEYS)
    loading = dict(entry.get("model_loading_config") or {})
    _only("model_loading_config", loading, ("model_id", "model_source", "tokenizer_source"))
    if not loading.get("model_id"):
        raise ValueError("model_loading_config.model_id is required: the name requests give as `model`.")
    kwargs = {k.replace("-", "_"): v for k, v in (entry.get("engine_kwargs") or {}).items()}
    _only("engine_kwargs", kwargs, EngineConfig.field_names() - {"model", "served_model_name"})
    kwargs.update(served_model_name=loading["model_id"], model=loading.get("model_source") or loading["model_id"])
    if loading.get("tokenizer_source"):
        kwargs["tokenizer"] = loading["tokenizer_source"]
    for key in ("placement_group_config", "accelerator_type"):
        if entry.get(key) is not None:
            kwargs[key] = entry[key]
    lora = dict(entry.get("lora_config") or {})
    _only("lora_config", lora, ("dynamic_lora_loading_path", "max_num_adapters_per_replica"))
    if "lora_config" in entry:
        kwargs["enable_lora"] = True
        kwargs.setdefault("dynamic_lora_loading_path", lora.get("dynamic_lora_loading_path"))
        if lora.get("max_num_adapters_per_replica") is not None:
            kwargs.setdefault("max_cpu_loras", int(lora["max_num_adapters_per_replica"]))
    return EngineConfig(**kwargs), _deployment_options(dict(entry.get("deployment_config") or {}))


def _deployment_options(dep: dict[str, Any]) -> dict[str, Any]:
    """A deployment_config (Ray Serve's deployment options) -> serve options."""
    per_model = set(SERVE_OPTION_DEFAULTS) - set(INGRESS_OPTIONS)
    _only("deployment_config", dep, {"num_replicas", "autoscaling_config", "ray_actor_options"} | per_model)
    opts = {k: v for k, v in dep.items() if k in per_model}
    if "num_replicas" in dep:
        opts.update(min_replicas=int(dep["num_replicas"]), max_replicas=int(dep["num_replicas"]))
    scaling = dict(dep.get("autoscaling_config") or {})
    _only("deployment_config.autoscaling_config", scaling, _AUTOSCALING_KEYS)
    opts.update(scaling)
    actor = dict(dep.get("ray_actor_options") or {})
    _only("deployment_config.ray_actor_options", actor, ("num_cpus",))
    if "num_cpus" in actor:
        opts["engine_num_cpus"] = float(actor["num_cpus"])
    return opts


def _pinned(model: tuple[EngineConfig, dict[str, Any]]) -> tuple[EngineConfig, dict[str, Any]]:
    return pinned_model(model[0]), model[1]


def app_builder(args: dict[str, Any]):
    """``import_path: pagedserve.cluster.app:app_builder`` in a Serve config file: one
    model's args (EngineConfig fields and serve options), or Ray Serve LLM's
    ``llm_configs: [...]`` (split_llm_config) beside the HTTP front's options."""
    args = {k.replace("-", "_"): v for k, v in (args or {}).items()}
    if "llm_configs" in args:
        _only("args beside llm_configs (engine fields and serve options go in each entry)", args,
              ("llm_configs", *INGRESS_OPTIONS))
        return build_openai_app(list(args.pop("llm_configs") or ()), **args)
    cfg, opts = split_args(args)
    return build_app(pinned_model(cfg), **opts)
