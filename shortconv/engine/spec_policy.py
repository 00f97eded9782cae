"""When speculation pays: per step by batch size, per request by its recent acceptance.

A verify row costs more than a decode row (k + 1 tokens through the model), and it pays only
through the proposals it keeps. Three switches, all from `SpeculativeConfig`:

* a step whose running batch is larger than `disable_by_batch_size` proposes nothing (large
  batches are compute-bound: extra tokens per row cost what they would save);
* each request keeps an exponential moving average of accepted / proposed over its verify
  rows; below `min_acceptance_rate` it stops proposing for `acceptance_backoff_steps` steps,
  then probes again starting at the threshold, so one more poor verify pauses it again;
* adaptive k (`adaptive_k`): each request also keeps, per proposal position i, a moving
  average of "proposal i kept, given the ones before it were"; it proposes position i only
  while the product of those averages up to i (the chance that position i adds a token) is
  at least `min_acceptance_rate`, the same break-even bar: one more verify token costs about
  that fraction of a decode step. A row that keeps all its proposals raises the estimate of
  the first position it did not propose (at a third of an observation's weight), so k
  grows back as acceptance does; a dropped position comes back only at twice the bar, so
  an estimate hovering at the bar does not flip k on every row (halfway to 1 for a bar
  above 1/3, where twice it could never be reached).

None changes what a request outputs, only how many steps it takes (lossless either way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shortconv.configs.speculative import SpeculativeConfig

# Weight of the newest verify row in the moving averages: about the last 3 rows count.
EMA_WEIGHT = 0.3
# Weight of a row that kept all it proposed, as a keep of the first position it did not
# propose: a guess, not an observation, so it counts a third as much. A dropped position
# comes back after a run of such rows, not after the first lucky one.
PROBE_WEIGHT = EMA_WEIGHT / 3


# A position not proposed now is proposed again once its chance reaches twice the bar, or
# halfway from the bar to 1 when that is lower (reachable for any bar). Hysteresis: a
# rejection takes the estimate just under the bar, and one probe would lift it just over.
def regrow_bar(bar: float) -> float:
    return min(2.0 * bar, (1.0 + bar) / 2.0)


@dataclass
class AcceptanceTracker:
    """One request's recent acceptance (starts optimistic: a new request proposes), the
    scheduler step from which it proposes again, and its per-position acceptance
    (`position_rates[i]`: proposal i kept given proposals 0..i-1 were; a position never
    observed reads 1.0) and the k they pay for (None: num_speculative_tokens)."""

    rate: float = 1.0
    paused_until: int = 0
    position_rates: list[float] = field(default_factory=list)
    k: int | None = None


def step_allows(cfg: SpeculativeConfig, num_running: int) -> bool:
    """Whether any request may propose in a step with `num_running` requests."""
    return cfg.disable_by_batch_size is None or num_running <= cfg.disable_by_batch_size


def request_allows(tracker: AcceptanceTracker, step: int) -> bool:
    """Whether the request may propose in scheduler step `step` (pure: asked more than once
    a step, by the draft model's batch and by the row planner)."""
    return step >= tracker.paused_until


def adaptive_k(cfg: SpeculativeConfig, tracker: AcceptanceTracker) -> int:
    """How many proposals the request's acceptance pays for (set by `observe`; pure)."""
    return cfg.num_speculative_tokens if tracker.k is None else tracker.k


def paid_k(cfg: SpeculativeConfig, tracker: AcceptanceTracker) -> int:
    """Positions, in [1, num_speculative_tokens], while the chance of keeping all of them
    stays at or above the bar (`regrow_bar` of it past the current k). Never 0: whether
    the request proposes at all is the pause's call (`request_allows`)."""
    rates, current = tracker.position_rates, adaptive_k(cfg, tracker)
    bars = (cfg.min_acceptance_rate, regrow_bar(cfg.min_acceptance_rate))
    kept, k = 1.0, 0
    while k < cfg.num_speculative_tokens:
        kept *= rates[k] if k < len(rates) else 1.0
        if kept < bars[k >= current]:
            break
        k += 1
    return max(1, k)


def fixed_k(cfg: SpeculativeConfig, tracker: AcceptanceTracker) -> int:
    """`adaptive_k` off: always num_speculative_tokens."""
    return cfg.num_speculative_tokens


def observe(
    cfg: SpeculativeConfig, tracker: AcceptanceTracker, proposed: int, accepted: int, step: int
) -> None:
    """Fold step `step`'s verify row into the averages; below the bar, the request sits out
    the next `acceptance_backoff_steps` steps."""
    if proposed < 1:
        return
    _observe_positions(cfg, tracker, proposed, accepted)
    tracker.k = paid_k(cfg, tracker)
    tracker.rate += EMA_WEIGHT * (accepted / proposed - tracker.rate)
    if tracker.rate < cfg.min_acceptance_rate:
        tracker.paused_until = step + cfg.acceptance_backoff_steps + 1
        tracker.rate = cfg.min_acceptance_rate  # the probe after the pause decides again


def _observe_positions(
    cfg: SpeculativeConfig, tracker: AcceptanceTracker, proposed: int, accepted: int
) -> None:
    """Positions 0..accepted-1 were kept, position `accepted` (if proposed) was rejected, and
    the ones after it were never reached, so they learn nothing. A row that kept everything
    counts as a keep for the next position: without that, a position once dropped would
    never be proposed, so never observed, again."""
    rates = tracker.position_rates
    size = cfg.num_speculative_tokens
    rates.extend([1.0] * (size - len(rates)))
    for i in range(min(accepted + 1, proposed, size)):
        rates[i] += EMA_WEIGHT * (float(i < accepted) - rates[i])
    if accepted == proposed < size:
        rates[accepted] += PROBE_WEIGHT * (1.0 - rates[accepted])
