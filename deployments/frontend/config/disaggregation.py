"""`disaggregation:` in the YAML `args:`: prefill and decode on replicas of their own.

Off by default (None). With it the app runs two LLMServer deployments from the same args: a
prefill deployment (`prefill_replicas` replicas at `prefill_tp_size`, default the app's
`tp_size`) that fills a request's state and hands it over as a state bundle, and the decode
deployment (`decode_replicas` replicas at `tp_size`) that the ingress calls, which imports the
bundle and streams the tokens (docs/disaggregation.md).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class DisaggregationArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill_replicas: int = Field(ge=1)
    decode_replicas: int = Field(ge=1)
    prefill_tp_size: int | None = Field(None, ge=1)  # None: the app's tp_size
    # A Ray custom resource each role's replicas ask for a share of, so that they land only
    # on nodes offering it (the Helm chart gives each role's worker group its own). None: any
    # node, as on one machine.
    prefill_resource: str | None = Field(None, min_length=1)
    decode_resource: str | None = Field(None, min_length=1)


def disaggregation_refusal(
    d: DisaggregationArgs, given: dict[str, int], enable_lora: bool, replica_num_cpus: float | str
) -> str | None:
    """Why app args cannot run disaggregated, or None. `given`: the replica bounds the args
    name explicitly. Checked when the args are validated (AppArgs), so `serve run` refuses
    them before any replica starts."""
    other = {k: v for k, v in given.items() if v != d.decode_replicas}
    if other:
        # NOTE: equal bounds are accepted so a values file or YAML that names them (the
        # chart's defaults do) only has to agree; autoscaling a role is not supported.
        named = ", ".join(f"{k}={v}" for k, v in sorted(other.items()))
        return (
            f"disaggregation runs a fixed decode_replicas={d.decode_replicas} replicas; "
            f"{named} must equal it or be left out"
        )
    if replica_num_cpus == "all":
        # NOTE: "all" reserves a whole node for one replica; prefill and decode replicas
        # would then never share a node, and on one node the second would never start.
        return "disaggregation runs several replicas: give replica_num_cpus a number, not all"
    if enable_lora:
        # NOTE: the state a prefill makes under an adapter is only right for that adapter,
        # and the prefill replicas would have to hold every adapter a decode replica loads.
        return "disaggregation cannot hand off LoRA requests: enable_lora must be off"
    return None
