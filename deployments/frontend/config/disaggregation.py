"""`disaggregation:` in the YAML `args:`: prefill and decode on replicas of their own.

Off by default (None). With it the app runs two LLMServer deployments from the same args: a
prefill deployment (`prefill_replicas` replicas at `prefill_tp_size`, default the app's
`tp_size`) that fills a request's state and hands it over as a state bundle, and the decode
deployment (`decode_replicas` replicas at `tp_size`) that the ingress calls, which imports the
bundle and streams the tokens (docs/disaggregation.md).
"""

from __future__ import annotations

from collections.abc import Set

from pydantic import BaseModel, ConfigDict, Field


class DisaggregationArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill_replicas: int = Field(ge=1)
    decode_replicas: int = Field(ge=1)
    prefill_tp_size: int | None = Field(None, ge=1)  # None: the app's tp_size


def disaggregation_refusal(fields_set: Set[str], enable_lora: bool) -> str | None:
    """Why app args (the names given, `fields_set`, and their values) cannot run
    disaggregated, or None. Checked when the args are validated (AppArgs), so `serve run`
    refuses them before any replica starts."""
    given = fields_set & {"min_replicas", "max_replicas"}
    if given:
        return (
            f"disaggregation sets the replica counts itself (prefill_replicas, "
            f"decode_replicas); remove {', '.join(sorted(given))}"
        )
    if enable_lora:
        # NOTE: the state a prefill makes under an adapter is only right for that adapter,
        # and the prefill replicas would have to hold every adapter a decode replica loads.
        return "disaggregation cannot hand off LoRA requests: enable_lora must be off"
    return None
