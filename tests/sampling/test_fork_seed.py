"""Per-fork seeds (`SamplingParams.n` > 1): fork 0 keeps the request's seed, the others differ."""

from __future__ import annotations

from shortconv.sampling.sampler import draw_seed, fork_seed


def test_fork_zero_keeps_the_seed_and_the_others_are_distinct_valid_seeds() -> None:
    for seed in (0, 1, 1234, -5, 2**70):
        assert fork_seed(seed, 0) == seed
        seeds = [fork_seed(seed, i) for i in range(1, 64)]
        assert len(set(seeds)) == len(seeds) and seed not in seeds
        assert all(0 <= s < 2**63 for s in seeds)


def test_fork_seeds_are_not_neighbouring_request_seeds() -> None:
    """Fork i of seed s draws nothing that request s+i (or s-i) draws at the same step."""
    for seed in (0, 7, 99):
        for i in range(1, 8):
            forked = {draw_seed(fork_seed(seed, i), step) for step in range(16)}
            for other in (seed + i, seed - i):
                assert not forked & {draw_seed(other, step) for step in range(16)}
