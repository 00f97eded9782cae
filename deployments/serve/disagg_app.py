"""The disaggregated layout (`disaggregation:` in the args; docs/disaggregation.md): a prefill
deployment and a decode deployment of the same LLMServer class, from the same args.

The ingress calls the decode deployment exactly as it calls LLMServer in the plain layout
(its SessionAffinityRouter keeps a session on the decode replica that holds it); a decode
replica that needs a prompt's state calls the prefill deployment itself (its handle is bound
in here, once) and gets the state bundle back through Ray's object store.
"""

from __future__ import annotations

import copy
from typing import Any

from ray.serve.deployment import Application, Deployment

from deployments.frontend.config.args import AppArgs

PREFILL_DEPLOYMENT = "PrefillServer"
# NOTE: a marker, not a count: a node offering a role's resource (the chart: 1 per pod) may
# hold any number of that role's replicas; CPUs and GPUs bound how many fit.
ROLE_RESOURCE_SHARE = 0.001


def role_args(args: AppArgs, role: str) -> AppArgs:
    """The args one role's replicas run with: its replica count as both bounds (a fixed
    count), its TP degree, and no `disaggregation` (a replica serves one role)."""
    d = args.disaggregation
    assert d is not None
    n = d.prefill_replicas if role == "prefill" else d.decode_replicas
    tp = (d.prefill_tp_size or args.tp_size) if role == "prefill" else args.tp_size
    update = {"min_replicas": n, "max_replicas": n, "tp_size": tp, "disaggregation": None}
    return args.model_copy(update=update)


def placed(opts: dict[str, Any], resource: str | None) -> dict[str, Any]:
    """`opts` with its replicas asking for a share of `resource` (None: unchanged). With TP
    the replica sits in placement-group bundle 0, so bundle 0 asks for it too (Serve requires
    the replica's resources to fit bundle 0); STRICT_PACK keeps the other ranks' bundles on
    the same node."""
    if resource is None:
        return opts
    out = copy.deepcopy(opts)
    share = {resource: ROLE_RESOURCE_SHARE}
    actor = out.setdefault("ray_actor_options", {})
    actor["resources"] = {**actor.get("resources", {}), **share}
    if out.get("placement_group_bundles"):
        out["placement_group_bundles"][0].update(share)
    return out


def bind_servers(
    server: Deployment,
    args: AppArgs,
    engine_factory: str | None,
    opts: dict[str, Any],
    prefill_opts: dict[str, Any],
) -> Application:
    """`server` (LLMServer) as the decode deployment (`opts`), bound to itself as the prefill
    deployment (`prefill_opts`).
    NOTE: the prefill replicas are called only by decode replicas, never by session, so they
    keep Serve's default router (least loaded of two)."""
    d = args.disaggregation
    assert d is not None
    opts = placed(opts, d.decode_resource)
    prefill_opts = placed(prefill_opts, d.prefill_resource)
    prefill_opts = {k: v for k, v in prefill_opts.items() if k != "request_router_config"}
    prefill = server.options(name=PREFILL_DEPLOYMENT, **prefill_opts).bind(
        role_args(args, "prefill").model_dump(), engine_factory
    )
    decode = role_args(args, "decode").model_dump()
    return server.options(**opts).bind(decode, engine_factory, prefill)
