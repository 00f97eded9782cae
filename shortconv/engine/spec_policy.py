"""When speculation pays: per step by batch size, per request by its recent acceptance.

A verify row costs more than a decode row (k + 1 tokens through the model), and it pays only
through the proposals it keeps. Two switches, both from `SpeculativeConfig`:

* a step whose running batch is larger than `disable_by_batch_size` proposes nothing (large
  batches are compute-bound: extra tokens per row cost what they would save);
* each request keeps an exponential moving average of accepted / proposed over its verify
  rows; below `min_acceptance_rate` it stops proposing for `acceptance_backoff_steps` steps,
  then probes again starting at the threshold, so one more poor verify pauses it again.

Neither changes what a request outputs, only how many steps it takes (lossless either way).
"""

from __future__ import annotations

from dataclasses import dataclass

from shortconv.configs.speculative import SpeculativeConfig

# Weight of the newest verify row in the moving average: about the last 3 rows count.
EMA_WEIGHT = 0.3


@dataclass
class AcceptanceTracker:
    """One request's recent acceptance (starts optimistic: a new request proposes) and the
    scheduler step from which it proposes again."""

    rate: float = 1.0
    paused_until: int = 0


def step_allows(cfg: SpeculativeConfig, num_running: int) -> bool:
    """Whether any request may propose in a step with `num_running` requests."""
    return cfg.disable_by_batch_size is None or num_running <= cfg.disable_by_batch_size


def request_allows(tracker: AcceptanceTracker, step: int) -> bool:
    """Whether the request may propose in scheduler step `step` (pure: asked more than once
    a step, by the draft model's batch and by the row planner)."""
    return step >= tracker.paused_until


def observe(
    cfg: SpeculativeConfig, tracker: AcceptanceTracker, proposed: int, accepted: int, step: int
) -> None:
    """Fold step `step`'s verify row into the average; below the bar, the request sits out
    the next `acceptance_backoff_steps` steps."""
    if proposed < 1:
        return
    tracker.rate += EMA_WEIGHT * (accepted / proposed - tracker.rate)
    if tracker.rate < cfg.min_acceptance_rate:
        tracker.paused_until = step + cfg.acceptance_backoff_steps + 1
        tracker.rate = cfg.min_acceptance_rate  # the probe after the pause decides again
