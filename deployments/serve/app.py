"""The application builder: `import_path: deployments.serve.app:build` in deployments/*.yaml.

`build(args)` validates the YAML `args:` block (AppArgs) and binds the deployments: the
OpenAIIngress (the HTTP app; parses and checks each request, keys the prompt's prefix) bound to
LLMServer (the model replicas, reached by typed handle calls, so its router sees the key) and,
where the ingress can scale past one replica, to ResponseStore (stored Responses API
responses, one replica shared by every ingress replica; see shares_response_store).
Every Serve option is decided here, once, from the args. A YAML `deployments:` entry for
LLMServer or OpenAIIngress overrides them option by option (Serve's rule; a dict option such
as `autoscaling_config` is replaced whole, so the replica bounds are args, not an override).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from deployments.frontend.config.args import AppArgs
from deployments.frontend.config.model_source import served_model_name
from deployments.serve.cpu_plan import INGRESS_NUM_CPUS, CpuPlan, cpu_plan
from deployments.serve.disagg_app import bind_servers, role_args
from deployments.serve.ingress import OpenAIIngress
from deployments.serve.responses_store_server import ResponseStoreServer
from deployments.serve.router import SessionAffinityRouter
from deployments.serve.server import LLMServer

ROUTING_STATS_PERIOD_S = 2.0  # how stale a replica's session report may be (default 10 s)
# Serve lets this many requests more than the engine's admission limit into a replica, so that
# the replica itself answers overload (an OpenAI 503 with Retry-After, counted at admission)
# and /v1/models, /health or stats calls still get through while generation is full.
ADMISSION_HEADROOM = 8


class AppArgsError(ValueError):
    """The `args:` block does not validate; the message lists every bad field."""


def parse_args(args: dict[str, Any] | None) -> AppArgs:
    try:
        return AppArgs.model_validate(args or {})
    except ValidationError as exc:
        lines = [
            f"  {'.'.join(str(p) for p in e['loc']) or '<args>'}: {e['msg']}" for e in exc.errors()
        ]
        raise AppArgsError(
            "invalid args for deployments.serve.app:build (the YAML `args:` block):\n"
            + "\n".join(lines)
        ) from None


def replicas(low: int, high: int, target_ongoing: int) -> dict[str, Any]:
    """Serve's replica options: `num_replicas` when the bounds are equal, else autoscaling
    between them. NOTE: a fixed count, not autoscaling between equal bounds, so that Serve's
    controller runs no scaling policy for nothing (its idle CPU: 5.5% -> 4.1% of a core on the
    2-core machine, docs/serving_path.md)."""
    if low == high:
        return {"num_replicas": low}
    return {
        "autoscaling_config": {
            "min_replicas": low,
            "max_replicas": high,
            "target_ongoing_requests": target_ongoing,
        }
    }


def deployment_options(args: AppArgs, cpus: CpuPlan | None = None) -> dict[str, Any]:
    """Serve options for LLMServer: resources and placement, batching-sized concurrency,
    autoscaling, health checks and the session-affinity router.

    NOTE: every size here is derived from the args (`max_num_seqs`, `max_waiting_requests`,
    `min_replicas`, `max_replicas`); the YAMLs set a deployment option only to mean something
    else than these defaults. `cpus`: the replica's and its ranks' CPUs (default: resolved
    from `replica_num_cpus` now, deployments/serve/cpu_plan.py)."""
    cpus = cpus or cpu_plan(args.replica_num_cpus, args.tp_size)
    opts: dict[str, Any] = {
        # One admission limit: Serve's per-replica cap sits just above the engine's, so a full
        # replica answers 503 itself rather than Serve queueing without telling anyone.
        "max_ongoing_requests": args.admission_limit + ADMISSION_HEADROOM,
        # Add replicas once they average half a batch of requests each.
        **replicas(args.min_replicas, args.max_replicas, max(1, args.max_num_seqs // 2)),
        # Bounded waiting at each proxy too: past it Serve itself answers 503 + Retry-After, so
        # a flood never grows memory without limit (replicas bound theirs: admission_limit).
        "max_queued_requests": args.admission_limit,
        "backpressure_config": BackpressureConfig(status_code=503, retry_after_s=1),
        "health_check_period_s": 10.0,
        "health_check_timeout_s": 30.0,
        "request_router_config": RequestRouterConfig(
            request_router_class=SessionAffinityRouter,
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
    }
    actor: dict[str, Any] = {"num_cpus": cpus.replica}
    if args.tp_size > 1:
        from workers.ray_executor import worker_bundles

        # NOTE: Serve places the replica itself in bundle 0, so bundle 0 carries the replica's
        # CPUs plus rank 0's; rank r of the TP group takes bundle r (RayExecutor).
        bundles = worker_bundles(args.tp_size, args.device, cpus.per_worker)
        bundles[0]["CPU"] = bundles[0].get("CPU", 0) + cpus.replica
        opts["placement_group_bundles"] = bundles
        opts["placement_group_strategy"] = "STRICT_PACK"
    elif args.device == "cuda":
        actor["num_gpus"] = 1  # tp_size=1: the engine runs in the replica process
    opts["ray_actor_options"] = actor
    return opts


def ingress_options(args: AppArgs) -> dict[str, Any]:
    """Serve options for OpenAIIngress.

    It autoscales from one replica up to LLMServer's `max_replicas`, targeting one LLMServer
    replica's worth of requests each: at 0.1 CPU a replica costs little, one is enough until
    the fleet is busy, and keeping it to one while load is light keeps prefix routing exact
    (each ingress replica's router also learns from its own sends; the replicas' reports
    reach all of them within ROUTING_STATS_PERIOD_S). Each may hold every request the whole
    fleet admits: it only waits on the replicas."""
    fleet = args.max_replicas * (args.admission_limit + ADMISSION_HEADROOM)
    return {
        "max_ongoing_requests": fleet,
        "max_queued_requests": fleet,
        "backpressure_config": BackpressureConfig(status_code=503, retry_after_s=1),
        **replicas(1, args.max_replicas, args.admission_limit),
        "health_check_period_s": 10.0,
        "ray_actor_options": {"num_cpus": INGRESS_NUM_CPUS},
    }


def build_app(args: AppArgs, engine_factory: str | None = None, **overrides: Any) -> Application:
    """OpenAIIngress bound to LLMServer; `overrides` replace LLMServer's deployment options
    (tests: num_replicas=2, ...)."""
    # NOTE: disaggregated, the ingress calls the decode deployment (deployments/serve/
    # disagg_app.py): its replica count and TP degree size everything Serve-side here.
    served = role_args(args, "decode") if args.disaggregation is not None else args
    opts = deployment_options(served)
    if "num_replicas" in overrides:
        opts.pop("autoscaling_config", None)
    if "autoscaling_config" in overrides:
        opts.pop("num_replicas", None)
    opts.update(overrides)
    if args.disaggregation is None:
        llm = LLMServer.options(**opts).bind(args.model_dump(), engine_factory)
    else:
        prefill_opts = deployment_options(role_args(args, "prefill"))
        llm = bind_servers(LLMServer, args, engine_factory, opts, prefill_opts)
    cfg = {
        "model_name": served_model_name(args),
        "max_request_bytes": args.max_request_bytes,
        "api_key": args.api_key,
        "responses_ttl_s": args.responses_ttl_s,
        "max_stored_responses": args.max_stored_responses,
        "enable_lora": args.enable_lora,
        "runtime_lora_updating": args.runtime_lora_updating,
    }
    ingress = OpenAIIngress.options(**ingress_options(served))
    if not shares_response_store(served):
        return ingress.bind(llm, cfg)
    store = ResponseStoreServer.bind(args.responses_ttl_s, args.max_stored_responses)
    return ingress.bind(llm, cfg, store)


def shares_response_store(args: AppArgs) -> bool:
    """Whether stored Responses live in a ResponseStore deployment of their own (shared by
    every ingress replica) rather than in the one ingress replica itself.

    NOTE: only where the ingress can scale past one replica (its bound is `max_replicas`,
    ingress_options): a single ingress replica keeps them itself, the same store with the same
    lifetime, one Serve replica fewer. On the 2-core machine that replica was 146 MB resident,
    1.2-1.4% of a core idle, and one more Ray worker importing Serve while the model replica
    loads its weights (docs/serving_path.md). A YAML override of OpenAIIngress's replica count
    above one must raise `max_replicas` too, or each ingress replica keeps its own."""
    return args.max_replicas > 1


def build(args: dict[str, Any]) -> Application:
    """The YAML import_path target."""
    return build_app(parse_args(args))
